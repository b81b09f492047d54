"""One kernel choice per unit (opsched.runtime.choice), recorded in the plan: what the cost model measures with is
what every executor runs, and a plan runs on the kernels it records, or refuses in one line."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.compare import compare_outputs
from opsched.cost.table import TableCost
from opsched.errors import OpschedError
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.runtime import packed
from opsched.runtime.choice import check_choice, choose_kernels, place_of
from opsched.runtime.kernels import ChosenKernels, kernels_for, plan_kernels
from opsched.runtime.module import OptimizedModule
from opsched.schedule import RunSettings, ScheduleError, from_dict
from opsched.schedulers import make_schedule
from tests.support.small_models import TOLERANCE, build, recipes

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packs with oneDNN only")


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.left = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())
        self.right = torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return torch.flatten(self.left(x) + self.right(x), 1).softmax(-1)


def graph_and_plan(model, inputs, method="sequential"):
    graph = capture(model.eval(), inputs)
    for n in graph.nodes:
        n.latency = 1.0
    return graph, make_schedule(method, graph, TableCost(graph, capacity=2))


def ran_kernels(module):
    """What each run step of a compiled module runs: ``packed`` for a unit with reordered convolutions, ``other``
    for anything else, by the step's first unit."""
    program = module.program
    return {program.graph.nodes[c.units[0]].name: "packed" if isinstance(c.fn, packed.PackedUnit) else "other"
            for stream in range(len(program.streams)) for c in module.executor.lowered.calls(stream)}


def expected(choice, module):
    return {name: "packed" if choice[name] == "packed" else "other" for name in ran_kernels(module)}


@needs_onednn
def test_the_cpu_packs_only_where_every_unit_runs_on_the_cpu():
    graph, _ = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    convolutions = {n.name for n in graph.nodes if "conv" in n.name}
    on_cpu = choose_kernels(graph)
    assert {n for n, k in on_cpu.items() if k == "packed"} >= convolutions
    assert set(choose_kernels(graph, device="cuda").values()) == {"eager"}
    # a mapping onto CPU and GPU devices: values must not reach a GPU unit channels_last
    assert set(choose_kernels(graph, device="cpu+cuda").values()) == {"eager"}
    assert set(choose_kernels(graph, "inductor").values()) == {"inductor"}
    assert place_of(["cpu", "cpu"]) == "cpu" and place_of(["cpu", "cuda:1"]) == "cpu+cuda"
    assert place_of(["cuda:0", "cuda:1"]) == "cuda" and place_of("cuda") == "cuda"
    with pytest.raises(OpschedError, match="unknown kernels"):
        choose_kernels(graph, "tensorrt")


@needs_onednn
def test_units_shipped_to_another_process_pack_only_what_needs_no_capture_examples():
    conv = capture(torch.nn.Conv2d(3, 4, 3).eval(), (torch.randn(1, 3, 8, 8),)).nodes[0].run
    example = torch.randn(3, 3)
    addressing = torch.fx.Graph()
    value = addressing.placeholder("x")
    value.meta["val"] = example
    addressing.output(addressing.call_function(torch.ops.aten.as_strided.default, (value, (2, 2), (2, 1), 1)))
    unit = torch.fx.GraphModule(torch.nn.Module(), addressing)
    graph = Graph([Node("c", args=("x",), run=conv), Node("a", args=("c",), run=unit)], inputs=["x"], outputs=["a"])
    assert choose_kernels(graph)["c"] == "packed"
    assert set(choose_kernels(graph, shipped=True).values()) == {"eager"}


@needs_onednn
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), method=st.sampled_from(["sequential", "greedy", "ios"]))
def test_every_executor_step_runs_the_kernel_the_choice_names(recipe, method):
    model, inputs = build(recipe)
    graph, plan = graph_and_plan(model, inputs, method)
    kernels = kernels_for(graph)
    given_kernels = OptimizedModule(graph, plan, 2, kernels)
    by_default = OptimizedModule(graph, plan, 2)  # the plan's own choice: the same one
    assert ran_kernels(given_kernels) == ran_kernels(by_default) == expected(kernels.choice, given_kernels)
    recorded = copy.deepcopy(plan)
    recorded.unit_kernels = {name: "eager" for name in kernels.choice}
    assert set(ran_kernels(OptimizedModule(graph, recorded, 2)).values()) <= {"other"}
    with torch.inference_mode():
        want = model(*inputs)
        for module in (given_kernels, by_default):
            # each output at its own scale: an absolute 5e-2 passed any answer on a softmax's small outputs
            verdict = compare_outputs(module(*inputs), want, TOLERANCE[inputs[0].dtype])
            assert verdict.ok, verdict.why
    for module in (given_kernels, by_default):
        module.close()


@needs_onednn
def test_a_job_records_the_kernels_it_measured_with_and_its_modules_run_them():

    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(1, 3, 8, 8)
    from opsched.jobs import optimize_once

    outcome = optimize_once(model, (x,), method="ios", kernels="eager", repeats=3, cache=False)
    plan = outcome.plan()
    assert plan.unit_kernels == outcome.kernels.choice == outcome.cost.runs.kernels.choice
    assert "packed" in plan.unit_kernels.values()
    for name, module in outcome.modules.items():
        assert ran_kernels(module) == expected(plan.unit_kernels, module), name
    again = from_dict(plan.to_dict())
    assert again.unit_kernels == plan.unit_kernels


@needs_onednn
def test_a_plan_runs_on_the_kernels_it_records_or_says_why_not(tmp_path):
    import json

    import opsched

    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(1, 3, 8, 8)
    outcome = opsched.optimize(model, (x,), method="sequential", kernels="eager", repeats=3, cache=False)
    path = tmp_path / "plan.json"
    outcome.save(path)
    doc = json.loads(path.read_text())
    assert "packed" in doc["unit_kernels"].values()
    doc["unit_kernels"] = {name: "eager" for name in doc["unit_kernels"]}  # recorded: eager everywhere
    module = opsched.compile(model, from_dict(doc), (x,))
    assert set(ran_kernels(module).values()) == {"other"}
    with torch.inference_mode():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)
    module.close()
    doc["unit_kernels"] = {name: "tensorrt" for name in doc["unit_kernels"]}
    path.write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match="kernel 'tensorrt'"):
        opsched.load(path, model)


def test_a_recorded_choice_must_name_every_unit_and_no_other():
    graph, plan = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    choice = {n.name: "eager" for n in graph.nodes}
    assert check_choice(choice, graph) == choice
    with pytest.raises(ScheduleError, match="no kernel for unit"):
        check_choice(dict(list(choice.items())[1:]), graph)
    with pytest.raises(ScheduleError, match="which the graph lacks"):
        check_choice({**choice, "ghost": "eager"}, graph)
    doc = plan.to_dict()
    doc["unit_kernels"] = ["eager"]
    with pytest.raises(ScheduleError, match="unit_kernels must map"):
        from_dict(doc)


@needs_onednn
def test_a_module_refuses_kernels_other_than_the_plan_records():
    graph, plan = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    plan.unit_kernels = choose_kernels(graph)
    eager = ChosenKernels({n.name: "eager" for n in graph.nodes})
    with pytest.raises(OpschedError, match="on packed kernels, but the kernels given run it on eager"):
        OptimizedModule(graph, plan, 2, eager)
    assert plan_kernels(graph, plan).choice == plan.unit_kernels


def test_compiled_kernels_need_example_values():
    graph, _ = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    with pytest.raises(OpschedError, match="compiled for example values"):
        ChosenKernels(choose_kernels(graph, "inductor"))


def test_the_ray_engine_runs_the_recorded_kernels_or_refuses():
    from opsched.runtime.ray.actors import shipped_kernels
    from opsched.runtime.ray.cluster import ClusterError

    graph, plan = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    plan.unit_kernels = {n.name: "inductor" for n in graph.nodes}
    with pytest.raises(ClusterError, match="inductor kernels, compiled in this process"):
        shipped_kernels(graph, plan)
    plan.unit_kernels = None
    assert shipped_kernels(graph, plan).choice == choose_kernels(graph, shipped=True)


class ViewAfterBranches(torch.nn.Module):
    """Two convolutions side by side, then a view of their concatenation: a compiled region holding the view
    reads the packed convolutions' channels_last values."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.a, self.b = torch.nn.Conv2d(8, 4, 1), torch.nn.Conv2d(8, 4, 1)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        x = self.stem(x)
        y = torch.cat([self.a(x), self.b(x)], 1)
        return torch.relu(self.fc(y.view(y.shape[0], -1)))


@needs_onednn
def test_an_eager_plan_with_regions_runs_each_region_on_the_plans_kernels():
    model, x = ViewAfterBranches().eval(), torch.randn(2, 3, 6, 6)
    graph, plan = graph_and_plan(model, (x,))
    plan.run = RunSettings(regions=True)
    assert "packed" in choose_kernels(graph).values()
    module = OptimizedModule(graph, plan, 2)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)
    module.close()


def test_a_step_onnx_cannot_take_changes_no_units_kernel_but_its_own(monkeypatch):
    graph, _ = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    kernels = ChosenKernels({n.name: "onnxruntime" for n in graph.nodes}, example=lambda name: None)
    session = object()

    def compile_unless_merged(nodes, threads):  # a stand-in for ONNX Runtime: merged steps fail to export,
        if len(nodes) > 1 or nodes[0].name == graph.nodes[-1].name:  # and say so as the operator does
            return kernels.onnxruntime._stays_eager(nodes, nodes[0].run, "a stand-in's export failed")
        return session

    monkeypatch.setattr(kernels.onnxruntime, "_compile", compile_unless_merged)
    first, second, last = graph.nodes[0], graph.nodes[1], graph.nodes[-1]
    assert kernels([first, second], 1) is first.run  # a merge stage that stays eager ...
    assert kernels.choice[first.name] == kernels.choice[second.name] == "onnxruntime"  # ... says nothing of its units
    assert kernels([first], 1) is session
    kernels([last], 1)
    assert kernels.choice[last.name] == "eager" and kernels.choice[first.name] == "onnxruntime"


@needs_onednn
def test_a_recorded_packed_unit_must_be_one_the_choice_could_pack():
    graph, plan = graph_and_plan(Branches(), (torch.randn(1, 3, 8, 8),))
    plan.unit_kernels = choose_kernels(graph)
    assert check_choice(plan.unit_kernels, graph) == plan.unit_kernels
    with pytest.raises(ScheduleError, match="its units run on cuda"):
        check_choice(plan.unit_kernels, graph, device="cuda")
    softmax = next(n.name for n in graph.nodes if not packed.packs(n.run))
    with pytest.raises(ScheduleError, match=f"unit {softmax!r} has nothing the rewrite handles"):
        check_choice({**plan.unit_kernels, softmax: "packed"}, graph)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("onnxruntime"), reason="needs ONNX Runtime")
def test_compile_runs_a_plan_on_compiled_kernels_for_its_example_inputs():
    import opsched

    model, x = Branches().eval(), torch.randn(1, 3, 8, 8)
    graph, plan = graph_and_plan(model, (x,))
    plan.run = RunSettings(kernels="onnxruntime")
    module = opsched.compile(graph, plan, (x,))  # (before, it ran eager kernels without a word)
    assert set(ran_kernels(module).values()) == {"other"}
    sessions = [c.fn for c in module.executor.lowered.calls(0)]
    assert all(getattr(fn, "__name__", "") == "call" for fn in sessions)  # ONNX Runtime sessions' callables
    with torch.inference_mode():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)
    module.close()


@needs_onednn
def test_a_saved_plan_runs_from_python_on_its_recorded_kernels(tmp_path):
    import opsched

    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(1, 3, 8, 8)
    path = tmp_path / "plan.json"
    opsched.optimize(model, (x,), method="sequential", repeats=3, cache=False).plan().save(path)
    outcome = opsched.run(path, model, (x,), repeats=3)
    label = outcome.requested
    assert {"eager", label} <= set(outcome.measured_ms) and outcome.evaluation.errors[label] < 1e-5
    assert ran_kernels(outcome.modules[label]) == expected(outcome.kernels.choice, outcome.modules[label])
    # a plan is a schedule of the graph, whatever its weights; a model of another graph is refused in one line
    assert opsched.run(path, Branches().eval(), (x,), repeats=3).evaluation.errors[label] < 1e-5
    with pytest.raises(ScheduleError, match="made for another graph"):
        opsched.run(path, ViewAfterBranches().eval(), (torch.randn(2, 3, 6, 6),), repeats=3)
    simulated = opsched.optimize(model, (x,), cost="sim:v100").plan()
    with pytest.raises(OpschedError, match="made for a simulated device"):
        opsched.run(simulated, model, (x,))
