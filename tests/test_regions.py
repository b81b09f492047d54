"""Compiled regions: back-to-back units fused into one, cut wherever a value is read outside, and run by
the usual backends with the same outputs."""

import pytest
import torch
from support.small_models import ChannelSplit
from torch import nn

from opsched.cost.simulate import SimulatedGPU
from opsched.cost.table import TableCost
from opsched.evaluation import verify
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.runtime.module import OptimizedModule
from opsched.runtime.regions import compiled_regions
from opsched.schedule import RunSettings, from_stages, validate
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
    with torch.inference_mode():  # eager units' convolutions reorder their weights: the same sums, another order
        torch.testing.assert_close(OptimizedModule(fused, plan, 2)(x), model(x))


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
    schedule.run = RunSettings(regions=True)
    assert verify(OptimizedModule(graph, schedule, 2), m.model, m.inputs).max_abs_error < 1e-5


def test_regions_compiled_by_inductor_match_eager():
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import kernels_for

    model, x, graph = _graph()
    schedule = make_schedule("sequential", graph, TableCost(graph))
    schedule.run = RunSettings(regions=True)
    operator = kernels_for(graph, "inductor", example=all_values(graph, [x]).__getitem__)
    module = OptimizedModule(graph, schedule, 2, operator)
    assert len(module.program.runs()) == 1  # the whole graph compiled as one region
    assert verify(module, model, (x,)).max_abs_error < 1e-5


def test_one_compiler_serves_units_and_the_regions_named_after_them():
    # a region is named after its last unit: compiled code must be looked up by operator, not by name
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import kernels_for

    model, x, graph = _graph()
    operator = kernels_for(graph, "inductor", example=all_values(graph, [x]).__getitem__)
    schedule = make_schedule("sequential", graph, TableCost(graph))
    units = OptimizedModule(graph, schedule, 2, operator)
    schedule.run = RunSettings(regions=True)
    regions = OptimizedModule(graph, schedule, 2, operator)
    assert verify(units, model, (x,)).ok and verify(regions, model, (x,)).ok


class _RegionPricedTable(TableCost):
    """A table whose runs of units compiled as one region cost ``factor`` times their units' sum."""

    def __init__(self, graph, factor, capacity=0.0):
        super().__init__(graph, capacity=capacity)
        self.factor = factor
        self.asked: list[list[tuple[int, ...]]] = []

    def region_latencies(self, regions):
        self.asked.append([tuple(r) for r in regions])
        for r in regions:
            self.regions[tuple(r)] = self.factor * sum(self.latencies[u] for u in r)
        return [self.regions[tuple(r)] for r in regions]


def _two_chain_blocks():
    """A stem, two branches of three units, a join and a tail of three: blocks [stem], [branches + join],
    [tail units]."""
    from opsched.graph.ir import Graph, Node

    nodes = [Node("stem", latency=1.0)]
    for side in "ab":
        nodes += [Node(f"{side}0", args=("stem",), latency=1.0), Node(f"{side}1", args=(f"{side}0",), latency=1.0),
                  Node(f"{side}2", args=(f"{side}1",), latency=1.0)]
    nodes += [Node("join", args=("a2", "b2"), latency=1.0), Node("t0", args=("join",), latency=1.0),
              Node("t1", args=("t0",), latency=1.0)]
    return Graph(nodes)


@pytest.mark.parametrize("factor", [0.5, 0.95, 1.2])
def test_ios_runs_a_block_as_a_compiled_region_only_where_that_is_cheaper(factor):
    graph = _two_chain_blocks()
    cost = _RegionPricedTable(graph, factor)
    plain = make_schedule("ios", graph, TableCost(graph))  # branches side by side: 1 + 3 + 1 + 1 + 1 = 7
    plan = make_schedule("ios", graph, cost)
    validate(plan, graph)
    assert plain.predicted_latency == 7.0
    widths = [len(st.groups) for st in plan.stages]
    if factor == 0.5:  # every block a region (the branches' 3.5 < 4), joined into one run of all 10 units
        assert plan.run.regions is True and widths == [1]
        assert plan.predicted_latency == pytest.approx(5.0)
        assert cost.asked[-1] == [tuple(range(len(graph)))]  # the joined run was priced as what runs
        from opsched.commands.optimize import explain

        assert explain(plan, graph, cost).startswith("1 of 1 blocks of several units run as compiled regions")
    elif factor == 0.95:  # the branches stay side by side (6.65 > 4); the runs around them pay as regions
        assert plan.run.regions is True and widths == [1, 2, 1]
        assert plan.predicted_latency == pytest.approx(0.95 + 3 + 0.95 * 3)
    else:  # regions cost more than units: the plan without them
        assert "regions" not in plan.options and plan.predicted_latency == 7.0
    assert plan.bounds["lower_bound"] <= plan.predicted_latency + 1e-9


def test_a_plan_with_regions_priced_by_the_cost_model_runs_and_matches_eager():
    model, x, graph = _graph()
    cost = _RegionPricedTable(graph, 0.5)
    plan = make_schedule("ios", graph, cost)
    assert plan.run.regions is True
    module = OptimizedModule(graph, plan, 2)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), model(x))
    module.close()


def test_a_schedule_with_regions_joins_its_runs_and_is_predicted_as_them():
    from opsched.pipeline import with_regions

    graph = _two_chain_blocks()
    cost = _RegionPricedTable(graph, 0.5)
    plan = with_regions(make_schedule("sequential", graph, TableCost(graph)), graph, cost)
    validate(plan, graph)
    assert plan.run.regions is True and len(plan.stages) == 1 and plan.predicted_latency == pytest.approx(5.0)
    assert plan.bounds["lower_bound"] <= plan.predicted_latency + 1e-9
    unpriced = with_regions(make_schedule("sequential", graph, TableCost(graph)), graph, TableCost(graph))
    assert unpriced.run.regions is True and unpriced.predicted_latency == 10.0  # tables fuse nothing


def test_units_whose_attributes_have_the_same_names_keep_their_own_in_one_region():
    from torch import fx

    from opsched.graph.ir import Graph, Node

    def scaled(factor: float) -> fx.GraphModule:  # each unit names its weight w0, as a batched unit does
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(torch.mul, (x, g.get_attr("w0"))))
        return fx.GraphModule({"w0": torch.tensor(factor)}, g)

    graph = Graph([Node("a", args=("x",), run=scaled(2.0), latency=1.0),
                   Node("b", args=("a",), run=scaled(3.0), latency=1.0)], inputs=["x"])
    fused, plan = compiled_regions(graph, make_schedule("sequential", graph, TableCost(graph)))
    assert len(fused) == 1
    x = torch.ones(2)
    with torch.inference_mode():
        torch.testing.assert_close(OptimizedModule(fused, plan, 1)(x), x * 6)


def test_inductor_compiles_units_that_read_or_return_lists():
    # ShuffleNet V2 failed here ("output spec mismatch"): inductor takes tensors in and a tuple of tensors out
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import kernels_for

    model = ChannelSplit().eval()
    x = torch.randn(1, 8, 6, 6)
    graph = capture(model, (x,))
    for n in graph.nodes:
        n.latency = 1.0
    values = all_values(graph, [x])
    assert any(isinstance(values[n.name], (list, tuple)) for n in graph.nodes)  # the case is here
    operator = kernels_for(graph, "inductor", example=values.__getitem__)
    module = OptimizedModule(graph, make_schedule("sequential", graph, TableCost(graph)), 2, operator)
    assert verify(module, model, (x,)).max_abs_error < 1e-5
