"""Compiled regions: back-to-back units fused into one, cut wherever a value is read outside, and run by
the usual backends with the same outputs."""

import pytest
import torch
from torch import nn

from opsched.cost.simulate import SimulatedGPU
from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.runtime.module import OptimizedModule, verify
from opsched.runtime.regions import compiled_regions
from opsched.schedule import from_stages, validate
from opsched.schedulers import make_schedule


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.left, self.right = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        return self.head(torch.cat([self.left(y), self.right(y)], 1)).sigmoid()


def _graph():
    model = Branchy().eval()
    x = torch.randn(1, 3, 8, 8)
    graph = capture(model, (x,))
    for n in graph.nodes:
        n.latency = 1.0
    return model, x, graph


def test_a_sequential_plan_is_one_region_and_a_concurrent_stage_cuts_the_runs():
    model, x, graph = _graph()
    names = [n.name for n in graph.nodes]
    fused, plan = compiled_regions(graph, make_schedule("sequential", graph, TableCost(graph)))
    assert len(fused) == 1 and fused.nodes[0].kind == "region" and fused.nodes[0].name == names[-1]
    i = graph.index
    stages = [("concurrent", [[i["stem"]]]), ("concurrent", [[i["left"]], [i["right"]]]),
              ("concurrent", [[i[n] for n in names if n not in ("stem", "left", "right")]])]
    fused, plan = compiled_regions(graph, from_stages(graph, TableCost(graph), "t", stages))
    validate(plan, fused)
    assert [len(g) for st in plan.stages for g in st.groups] == [1, 1, 1, 1]  # stem alone: both branches read it
    assert "stem" in fused.index and "left" in fused.index
    with torch.inference_mode():
        assert torch.equal(OptimizedModule(fused, plan, 2)(x), model(x))


@pytest.fixture(scope="module")
def randwire():
    m = load_model("randwire", image_size=32)
    graph = capture(m.model.eval(), m.inputs)
    return m, graph, SimulatedGPU(graph, "sim:v100")


@pytest.mark.parametrize("method", ["sequential", "greedy", "ios"])
def test_every_schedule_of_a_random_network_runs_the_same_with_regions(randwire, method):
    m, graph, cost = randwire
    schedule = make_schedule(method, graph, cost)
    fused, plan = compiled_regions(graph, schedule)
    validate(plan, fused)
    assert len(fused) <= len(graph)
    schedule.options["regions"] = True
    assert verify(OptimizedModule(graph, schedule, 2), m.model, m.inputs).max_abs_error < 1e-5


def test_regions_compiled_by_inductor_match_eager():
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import operator_for

    model, x, graph = _graph()
    schedule = make_schedule("sequential", graph, TableCost(graph))
    schedule.options["regions"] = True
    operator = operator_for("inductor", all_values(graph, [x]).__getitem__)
    module = OptimizedModule(graph, schedule, 2, operator)
    assert len(module.program.runs()) == 1  # the whole graph compiled as one region
    assert verify(module, model, (x,)).max_abs_error < 1e-5


def test_one_compiler_serves_units_and_the_regions_named_after_them():
    # a region is named after its last unit: compiled code must be looked up by operator, not by name
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import operator_for

    model, x, graph = _graph()
    operator = operator_for("inductor", all_values(graph, [x]).__getitem__)
    schedule = make_schedule("sequential", graph, TableCost(graph))
    units = OptimizedModule(graph, schedule, 2, operator)
    schedule.options["regions"] = True
    regions = OptimizedModule(graph, schedule, 2, operator)
    assert verify(units, model, (x,)).ok and verify(regions, model, (x,)).ok
