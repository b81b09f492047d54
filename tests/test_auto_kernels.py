"""``--kernels auto``: blocks labelled by an exact minimum cut (checked against every labelling of small random
graphs), a plan mixing reordered convolutions and ONNX Runtime sessions that answers as the model, regions that
hold one kernel's units, and the choice recorded in the plan and run again by ``opsched.load``."""

import itertools
import math

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.small_models import build, check_inductor_region, recipes, unit_costed
from torch import nn

from opsched.cost.table import TableCost
from opsched.graph.blocks import split_blocks
from opsched.graph.capture import capture
from opsched.graph.interpret import all_values
from opsched.runtime.kernels import ChosenKernels, kernels_for
from opsched.runtime.module import OptimizedModule
from opsched.runtime.regions import compiled_regions
from opsched.schedule import RunSettings
from opsched.schedulers import make_schedule
from opsched.schedulers.kernels import cheapest_kernels, labelling_cost

# whole numbers: sums of them are exact in floating point, so that ties are ties and the test can be strict
costs = st.one_of(st.integers(0, 10).map(float), st.just(math.inf))


@st.composite
def labelling_problems(draw):
    n = draw(st.integers(1, 8))
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            graph.add_edge(u, v, crossing=float(draw(st.integers(0, 5))))
    first, second = {}, {}
    for u in range(n):
        a, b = draw(costs), draw(costs)
        if math.isinf(a) and math.isinf(b):
            b = float(draw(st.integers(0, 10)))
        first[u], second[u] = a, b
    return graph, first, second


@settings(max_examples=300, deadline=None)
@given(labelling_problems())
def test_the_minimum_cut_costs_what_the_best_of_every_labelling_costs(problem):
    graph, first, second = problem
    labels = cheapest_kernels(graph, first, second)
    best = min(labelling_cost(graph, dict(enumerate(bits)), first, second)
               for bits in itertools.product((0, 1), repeat=len(graph)))
    got = labelling_cost(graph, labels, first, second)
    assert got == best
    # ties stay on the first kernel: no node on the second could move back without raising the cost
    for u in graph.nodes:
        if labels[u] == 1 and not math.isinf(first[u]):
            assert labelling_cost(graph, {**labels, u: 0}, first, second) > got


def test_a_node_no_kernel_can_run_is_refused():
    graph = nx.DiGraph()
    graph.add_node("a")
    with pytest.raises(ValueError, match="no kernel"):
        cheapest_kernels(graph, {"a": math.inf}, {"a": math.inf})


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.left, self.right = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        y = self.a(x)
        y = self.b(torch.cat([self.left(y), torch.relu(self.right(y))], 1))
        return self.head(y.flatten(1))


def _mixed(every_other: bool):
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(2, 3, 8, 8)
    graph = unit_costed(model, x)
    default = kernels_for(graph, "eager")
    choice = {n.name: "onnxruntime" if (k % 2 == 0 if every_other else k <= len(graph) // 2) else default.choice[n.name]
              for k, n in enumerate(graph.nodes)}
    return model, x, graph, choice


@pytest.mark.parametrize("method", ["sequential", "greedy", "ios", "lios"])
@pytest.mark.parametrize("regions", [False, True])
@pytest.mark.parametrize("every_other", [False, True])
def test_a_plan_mixing_reordered_convolutions_and_sessions_answers_as_the_model(method, regions, every_other):
    pytest.importorskip("onnxruntime")
    model, x, graph, choice = _mixed(every_other)
    assert "packed" in choice.values()  # values cross between channels_last and NCHW both ways
    kernels = ChosenKernels(choice, all_values(graph, [x]).__getitem__, asked="auto")
    assert kernels.asked == "auto"
    plan = make_schedule(method, graph, TableCost(graph), **({"streams": 2} if method == "lios" else {}))
    plan.run = RunSettings("auto", regions=regions)
    module = OptimizedModule(graph, plan, 2, kernels)
    with torch.inference_mode():
        got, want = module(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert kernels.eager_units == []
    module.close()


def test_regions_chosen_unit_by_unit_hold_consecutive_units_of_one_compiled_kernel():
    _, _, graph, choice = _mixed(every_other=False)
    plan = make_schedule("sequential", graph, TableCost(graph))
    fused, _ = compiled_regions(graph, plan, kernels=choice)
    for node in fused.nodes:
        if node.kind == "region":
            assert {choice[m] for m in _region_members(graph, fused, node)} == {"onnxruntime"}
    sessions = [n for n in fused.nodes if n.kind == "region"]
    assert len(sessions) == 1  # the branches and their concatenation, one session; the units after it stay units
    assert sum(1 for n in fused.nodes if n.kind != "region") == sum(v != "onnxruntime" for v in choice.values())
    # without a choice made unit by unit, the sequential plan is one region
    assert len(compiled_regions(graph, plan)[0]) == 1


def _region_members(graph, fused, region):
    """The units a region of ``fused`` ran: those of ``graph`` that ``fused`` has no node for, up to the
    region's last unit, after the units before it."""
    kept = set(fused.index)
    names = [n.name for n in graph.nodes]
    end = names.index(region.name)
    start = end
    while start > 0 and names[start - 1] not in kept:
        start -= 1
    return names[start:end + 1]


def test_optimize_chooses_kernels_by_block_records_them_and_load_runs_them(tmp_path):
    pytest.importorskip("onnxruntime")
    import opsched

    torch.manual_seed(0)
    model, x = Chain().eval(), torch.randn(2, 3, 8, 8)
    outcome = opsched.optimize(model, (x,), repeats=3, cache=False)
    described = outcome.cost.describe()["kernel_choice"]
    graph = outcome.graph
    assert sum(described["units"].values()) == len(graph)
    choice = outcome.kernels.choice
    for block in split_blocks(graph):  # a block runs wholly on ONNX Runtime or wholly on the default kernels
        on_onnx = {choice[graph.nodes[u].name] == "onnxruntime" for u in block.units}
        assert len(on_onnx) == 1
    if set(choice.values()) == {"onnxruntime"}:  # the model as one session: a plan, which load makes again
        assert "sequential+regions" in outcome.measured_ms
    plan = outcome.plan()
    assert plan.run.kernels == "auto" and plan.unit_kernels == choice
    path = tmp_path / "plan.json"
    outcome.save(path)
    loaded = opsched.load(path, model)
    with torch.inference_mode():
        want = model(x)
        torch.testing.assert_close(loaded(x), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_a_unit_onnx_cannot_take_keeps_its_block_on_the_default_kernels_and_says_why():
    pytest.importorskip("onnxruntime")
    from opsched.runtime.auto import auto_cost

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.mid, self.tail = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 2, 1)

        def forward(self, x):  # the unit ONNX cannot take early, blocks after it
            y = torch.special.i1e(self.conv(x)) + 1  # no ONNX export for the modified Bessel function
            return self.tail(torch.relu(self.mid(y)))

    x = torch.randn(1, 3, 8, 8)
    graph = capture(Odd().eval(), (x,))
    cost, kernels = auto_cost(graph, [x], all_values(graph, [x]), cache=False)
    odd = next(n.name for n in graph.nodes if any("i1e" in str(op) for op in n.ops))
    assert kernels.choice[odd] != "onnxruntime"
    # only that unit is named: the whole graph's region, which fails for it too, is not put on its last unit
    assert set(cost.describe()["kernel_choice"]["not_offered"]["onnxruntime"]) == {odd}
    assert len(split_blocks(graph)) > 2 and graph.nodes[-1].name != odd


def test_without_onnxruntime_auto_is_the_default_kernels_said_once(monkeypatch, capsys):
    import sys

    from opsched.runtime import auto

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    monkeypatch.setattr(auto, "_said_missing", False)
    x = torch.randn(1, 3, 8, 8)
    graph = capture(Chain().eval(), (x,))
    for _ in range(2):
        cost, kernels = auto.auto_cost(graph, [x], all_values(graph, [x]), cache=False)
        assert kernels.asked == "eager" and set(kernels.choice.values()) <= {"eager", "packed"}
        assert cost.kernel_choice is None
    assert capsys.readouterr().err.count("ONNX Runtime is not installed") == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 10.0), st.booleans()), min_size=1, max_size=9),
       st.floats(0.0, 2.0), st.floats(0.0, 1.0))
def test_the_block_chain_prices_one_session_start_per_run_of_onnx_blocks(blocks, start_ms, switch_ms):
    """Each block measured as its own session (one start each); a run of consecutive blocks on ONNX Runtime is
    one session, so the chain must cost the blocks less one start for every block that continues a run, and the
    measured switch cost once for every two neighbours on different kernels."""
    from opsched.graph.ir import Graph, Node
    from opsched.runtime.auto import _less_starts, block_chain

    n = len(blocks)
    graph = Graph([Node(f"u{k}", args=(f"u{k - 1}",) if k else ()) for k in range(n)])
    on_default = {k: d for k, (d, _, _) in enumerate(blocks)}
    on_onnx = {k: o for k, (_, o, _) in enumerate(blocks)}
    labels = {k: int(on) for k, (_, _, on) in enumerate(blocks)}
    chain = block_chain(graph, [[k] for k in range(n)], dict.fromkeys(range(n), 0.0), start_ms, switch_ms)
    starts = sum(labels[k] and (k == 0 or not labels[k - 1]) for k in range(n))
    switches = sum(labels[k] != labels[k - 1] for k in range(1, n))
    want = sum(on_default[k] if not labels[k] else on_onnx[k] - start_ms for k in range(n)) + start_ms * starts \
        + switch_ms * switches
    got = labelling_cost(chain, labels, on_default, _less_starts(on_onnx, start_ms))
    assert got == pytest.approx(want, abs=1e-9)


def test_a_mix_is_kept_only_where_it_ran_faster_than_each_kernel_alone():
    from opsched.runtime.auto import _kept

    mix, other = (0, 1, 1), (1, 1, 0)
    assert _kept(mix, {mix: (4.0, 5.0, 4.5)}) == mix
    assert _kept(mix, {mix: (4.8, 5.0, 4.5)}) == (1, 1, 1)  # ONNX Runtime alone ran faster
    assert _kept(mix, {mix: (5.2, 5.0, 5.5)}) == (0, 0, 0)
    assert _kept((1, 1, 1), {mix: (4.0, 5.0, 4.5)}) == mix  # relabelled whole, but the mix had run faster
    assert _kept((0, 0, 0), {mix: (4.8, 5.0, 4.5)}) == (1, 1, 1)  # relabelled whole: the faster alone, as run
    assert _kept(other, {mix: (4.4, 5.0, 4.5), other: (4.2, 5.0, 4.5)}) == other  # the fastest mix that ran
    assert _kept(mix, {}) == mix  # nothing run: the cut's labels


def _chain_captured():
    """Chain, an input, and its captured graph."""
    torch.manual_seed(0)
    model, x = Chain().eval(), torch.randn(2, 3, 8, 8)
    return model, x, capture(model, (x,))


def _kept_answers_as_the_model(graph, cost, kernels, model, x):
    """Whatever auto_cost kept runs, and answers as the model."""
    with torch.inference_mode():
        module = OptimizedModule(graph, make_schedule("sequential", graph, cost), 2, kernels)
        want = model(x)
        torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        module.close()


def test_a_mix_of_kernels_is_run_beside_each_kernel_alone_before_it_is_kept(monkeypatch):
    """Whatever the cut labels, a mix is kept only after it ran faster than each kernel alone: here the cut is
    made to answer a mix, which then runs (in place, with its regions) and is kept or dropped by what it ran."""
    pytest.importorskip("onnxruntime")
    from opsched.runtime import auto
    from opsched.schedulers import kernels as labelling

    model, x, graph = _chain_captured()
    calls = []

    def mixed_first(chain, first, second):
        calls.append(dict(first))
        return {k: k % 2 for k in chain.nodes} if len(calls) == 1 else labelling.cheapest_kernels(chain, first, second)

    monkeypatch.setattr(auto, "cheapest_kernels", mixed_first)
    cost, kernels = auto.auto_cost(graph, [x], all_values(graph, [x]), cache=False)
    ran = cost.kernel_choice["mixes_run_ms"]
    assert ran and ran[0]["blocks_on_onnxruntime"] >= 1 and ran[0]["default"] > 0
    kept = {kernels.choice[n.name] == "onnxruntime" for n in graph.nodes}
    faster = [r for r in ran if r["mix"] < min(r["default"], r["onnxruntime"] or math.inf)]
    assert len(kept) == (2 if faster else 1)  # a mix only where one ran faster than each kernel alone
    _kept_answers_as_the_model(graph, cost, kernels, model, x)


@pytest.mark.parametrize("cut_says_onnx", [False, True])
@pytest.mark.parametrize("onnx_ran_faster", [False, True])
def test_one_kernel_for_every_block_is_run_against_the_other_whole_before_it_is_kept(monkeypatch, cut_says_onnx,
                                                                                     onnx_ran_faster):
    """The costs the cut labels with sum the default kernels' units but measure ONNX Runtime's whole graph as it
    runs (BERT: the default kernels chosen on 7.70 ms of units, whose plan ran 8.7, where ONNX Runtime's
    session ran 7.9): a labelling of one kernel is kept only once each kernel's whole graph ran, the faster."""
    pytest.importorskip("onnxruntime")
    from opsched.runtime import auto

    model, x, graph = _chain_captured()
    ran = []

    def timed(graph, kernel_sets, cost):
        ran.append([set(k.choice.values()) for k in kernel_sets])
        return [5.0, 4.0] if onnx_ran_faster else [4.0, 5.0]

    monkeypatch.setattr(auto, "cheapest_kernels", lambda chain, first, second: dict.fromkeys(chain, int(cut_says_onnx)))
    monkeypatch.setattr(auto, "sequential_ms", timed)
    cost, kernels = auto.auto_cost(graph, [x], all_values(graph, [x]), cache=False)
    assert len(ran) == 1 and ran[0][0] <= {"eager", "packed"} and ran[0][1] == {"onnxruntime"}
    assert set(kernels.choice.values()) == ({"onnxruntime"} if onnx_ran_faster else set(ran[0][0]))
    assert cost.kernel_choice["mixes_run_ms"][0]["onnxruntime"] == (4.0 if onnx_ran_faster else 5.0)
    _kept_answers_as_the_model(graph, cost, kernels, model, x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), labels=st.lists(st.booleans(), min_size=16, max_size=16),
       method=st.sampled_from(["sequential", "greedy", "ios"]), regions=st.booleans())
def test_random_models_on_random_mixes_of_kernels_answer_as_the_model(recipe, labels, method, regions):
    """Random models (views, in-place writes, pools, gates, several inputs and outputs) with their units put on
    ONNX Runtime or the default kernels at random, not as measurement would: every crossing between
    ``channels_last`` and NCHW values, and every region cut where the kernel changes, must still give the
    model's outputs (compared at each output's own scale)."""
    pytest.importorskip("onnxruntime")
    from opsched.compare import compare_outputs

    model, inputs = build({**recipe, "dtype": "float32"})  # (ONNX Runtime's CPU kernels are float32's)
    graph = unit_costed(model, *inputs)
    default = kernels_for(graph, "eager")
    choice = {n.name: "onnxruntime" if labels[k % len(labels)] else default.choice[n.name]
              for k, n in enumerate(graph.nodes)}
    kernels = ChosenKernels(choice, all_values(graph, list(inputs)).__getitem__, asked="auto")
    plan = make_schedule(method, graph, TableCost(graph))
    plan.run = RunSettings("auto", regions=regions)
    module = OptimizedModule(graph, plan, 2, kernels)
    with torch.inference_mode():
        verdict = compare_outputs(module(*inputs), model(*inputs))
    module.close()
    assert verdict.ok, verdict.why


class Attention(nn.Module):
    """One pre-norm self-attention block: what the CNN-tuned choice of ONNX Runtime blocks does not speed up."""

    def __init__(self, width=16):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.out(weights @ v)


@pytest.mark.parametrize("choice, offered", [
    ({"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": 5.0}, False),
    ({"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": 8.4}, False),
    ({"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": 8.5}, True),
    ({"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": 18.0}, True),
    ({"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": None}, True),  # ORT failed on it
    ({"units": {"eager": 3}, "not_offered": {"onnxruntime": {"(every unit)": "choosing failed: ..."}}}, True),
])
def test_inductor_is_offered_the_whole_graph_where_onnx_runtime_gains_little_over_the_default_kernels(choice,
                                                                                                      offered):
    from opsched.runtime.auto import inductor_offered

    class Costed:
        kernel_choice = choice

    got, why = inductor_offered(Costed())
    assert got == offered and why
    assert inductor_offered(object())[0] is False  # a cost model auto did not make on the CPU


def test_without_onnxruntime_inductor_is_offered_the_whole_graph_and_the_plan_says_why(monkeypatch, tmp_path,
                                                                                        capsys):
    import sys

    import opsched
    from opsched.cli import main
    from opsched.runtime import auto

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    monkeypatch.setattr(auto, "_said_missing", True)

    class Costed:
        kernel_choice = None

    assert auto.inductor_offered(Costed()) == (True, "ONNX Runtime is not installed")
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    outcome = opsched.optimize(model, (x,), repeats=3, cache=False)
    assert "sequential+regions+inductor" in outcome.measured_ms, outcome.evaluation.dropped
    outcome.plan().save(tmp_path / "plan.json")  # whichever was chosen, its plan records why
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    assert "offered Inductor for the whole graph: ONNX Runtime is not installed" in capsys.readouterr().out


def test_the_whole_graph_on_inductor_is_verified_and_timed_beside_the_plans_and_its_plan_runs_again(monkeypatch,
                                                                                                   tmp_path, capsys):
    """Offered (here whatever ONNX Runtime measured), the whole graph compiled by Inductor as one region is one
    more schedule of the run, verified against the model: its plan records every unit on Inductor and compiles
    again from a new capture, as ``opsched.load`` and a weight change rebuild it."""
    pytest.importorskip("onnxruntime")
    import opsched
    from opsched.compare import compare_outputs
    from opsched.deploy import recompile
    from opsched.runtime import auto

    monkeypatch.setattr(auto, "INDUCTOR_FROM", 0.0)
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    outcome = opsched.optimize(model, (x,), repeats=3, cache=False)
    name = "sequential+regions+inductor"
    assert name in outcome.measured_ms, outcome.evaluation.dropped
    offer = outcome.cost.kernel_choice["inductor_whole_graph"]
    assert offer["offered"] and offer["compile_seconds"] >= 0  # what offering it cost is said
    plan = outcome.plan(name)
    assert plan.run.regions and set(plan.unit_kernels.values()) == {"inductor"} and len(plan.unit_kernels) == len(
        outcome.graph)
    assert plan.measured.measured_as == name
    plan.save(tmp_path / "plan.json")  # opsched show says why Inductor was offered
    from opsched.cli import main

    assert main(["show", str(tmp_path / "plan.json")]) == 0
    shown = capsys.readouterr().out
    assert "offered Inductor for the whole graph: " in shown and "measured and not costed" in shown
    assert name in outcome.every_schedule  # what opsched optimize's table lists
    with torch.no_grad():
        model.qkv.weight.mul_(0.5)  # new weights: compiled again, and verified against the model as it is now
    module, verdict = recompile(model, (x,), plan, {"repeats": 3})
    assert verdict.ok
    with torch.inference_mode():
        assert compare_outputs(module(x), model(x)).ok


@pytest.mark.parametrize("inductor_ms, plan_ms, compiled", [(2.0, 1.0, False), (1.0, 1.0, False), (0.9, 1.0, True)])
def test_the_whole_graph_on_inductor_is_not_compiled_again_where_it_ran_slower_than_a_plan_here(
        monkeypatch, inductor_ms, plan_ms, compiled):
    """The Inductor region's median and the fastest plan's, timed in one run, are kept in the cost cache; the next
    optimize of the graph compiles Inductor again only where it was the faster (compiling takes seconds to a
    minute), and says why not; without the cache it is compiled."""
    pytest.importorskip("onnxruntime")
    import opsched
    from opsched.runtime import auto, kernels

    monkeypatch.setattr(auto, "INDUCTOR_FROM", 0.0)
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    first = opsched.optimize(model, (x,), repeats=3)
    assert "sequential+regions+inductor" in first.measured_ms, first.evaluation.dropped
    race = first.cost.whole_graph_race("inductor")  # what this run measured, kept
    assert race[:2] == (first.measured_ms["sequential+regions+inductor"],
                        min(first.measured_ms[n] for n in first.schedules if n in first.measured_ms))
    first.cost.remember_whole_graph_race("inductor", inductor_ms, plan_ms, 3)
    real, compiles = kernels.InductorOperator._compile, []
    monkeypatch.setattr(kernels.InductorOperator, "_compile",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    again = opsched.optimize(model, (x,), repeats=3)
    offer = again.cost.kernel_choice["inductor_whole_graph"]
    assert bool(compiles) == compiled == offer["offered"] == ("sequential+regions+inductor" in again.measured_ms)
    if not compiled:
        assert f"ran {inductor_ms / plan_ms:.2f}x the fastest plan when last timed beside it" in offer["why"]
        compiles.clear()
        assert "sequential+regions+inductor" in opsched.optimize(model, (x,), repeats=3, cache=False).measured_ms
        assert compiles


def test_the_race_is_kept_by_the_graph_whatever_kernels_were_chosen():
    """A small graph's kernel choice can change from one optimize to the next on a busy machine (the suite once
    saw it): the race is found again whichever kernels the graph's units were chosen to run on."""
    pytest.importorskip("onnxruntime")
    from opsched.pipeline import cost_model

    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    graph = capture(model, (x,))
    on_onnx, _ = cost_model(graph, (x,), kernels="onnxruntime")
    on_default, _ = cost_model(graph, (x,), kernels="eager")
    on_onnx.remember_whole_graph_race("inductor", 2.0, 1.0, 3)
    assert on_default.whole_graph_race("inductor") == (2.0, 1.0, 1, 0)
    other = capture(nn.Sequential(nn.Linear(16, 16)), (x,))  # another graph: none
    assert cost_model(other, (x,), kernels="eager")[0].whole_graph_race("inductor") is None


def test_a_lost_race_is_run_again_after_4_optimizes_then_8_and_a_won_one_every_time(monkeypatch):
    """A loss within the noise, or a failure that passes (a compile killed on a busy machine), was remembered for
    good: --no-cache tried it but kept nothing, so only clearing the whole cache brought Inductor back."""
    pytest.importorskip("onnxruntime")
    from opsched.pipeline import Outcome, Workload, cost_model, whole_graph_on_inductor
    from opsched.runtime import auto

    monkeypatch.setattr(auto, "INDUCTOR_FROM", 0.0)
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    graph = capture(model, (x,))
    cost, kernels = cost_model(graph, (x,), kernels="auto")
    job = Workload(model, (x,), graph, {}, kernels="auto", whole_on_inductor=True)
    schedules = {"sequential": make_schedule("sequential", graph, cost)}

    def offers(optimizes):
        return [whole_graph_on_inductor(job, Outcome(cost, schedules, kernels, graph=graph)) is not None
                for _ in range(optimizes)]

    cost.remember_whole_graph_race("inductor", 1.01, 1.0, 3)  # lost, by a hair
    assert offers(4) == [False] * 4
    assert cost.kernel_choice["inductor_whole_graph"]["why"].endswith(
        "ran 1.01x the fastest plan when last timed beside it here; not compiled again for 1 optimizes of this "
        "graph, this one included (--no-cache tries it now)")
    assert offers(1) == [True]
    cost.remember_whole_graph_race("inductor", math.inf, 1.0, 0)  # the retry did not compile: two in a row
    assert offers(9) == [False] * 8 + [True]
    assert "did not compile or verify when last tried here, 2 time(s) in a row; tried again after 8" in \
        cost.kernel_choice["inductor_whole_graph"]["why"]
    cost.remember_whole_graph_race("inductor", 0.9, 1.0, 3)  # won: compiled on every optimize, as it is chosen
    assert offers(3) == [True] * 3
    cost.remember_whole_graph_race("inductor", 1.2, 1.0, 3)  # lost once after a win: 4 again
    assert offers(5) == [False] * 4 + [True]


def test_a_whole_graph_inductor_cannot_compile_is_dropped_with_why_and_the_others_stand(monkeypatch):
    pytest.importorskip("onnxruntime")
    import opsched
    from opsched.errors import OpschedError
    from opsched.runtime import auto, kernels

    def fails(self, nodes, threads):
        raise OpschedError(f"inductor could not compile unit {nodes[0].name!r}: LoweringException: made up")

    monkeypatch.setattr(auto, "INDUCTOR_FROM", 0.0)
    monkeypatch.setattr(kernels.InductorOperator, "_compile", fails)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    outcome = opsched.optimize(model, (x,), repeats=3, cache=False)
    assert "made up" in outcome.evaluation.dropped["sequential+regions+inductor"]
    assert outcome.plan() is not None and outcome.plan().measured.measured_as != "sequential+regions+inductor"


def test_a_whole_graph_inductor_could_not_compile_is_not_tried_again_on_the_next_optimize(monkeypatch):
    pytest.importorskip("onnxruntime")
    import opsched
    from opsched.errors import OpschedError
    from opsched.runtime import auto, kernels

    tries = []

    def fails(self, nodes, threads):
        tries.append(1)
        raise OpschedError(f"inductor could not compile unit {nodes[0].name!r}: LoweringException: made up")

    monkeypatch.setattr(auto, "INDUCTOR_FROM", 0.0)
    monkeypatch.setattr(kernels.InductorOperator, "_compile", fails)
    model, x = Attention().eval(), torch.randn(2, 6, 16)
    assert "made up" in opsched.optimize(model, (x,), repeats=3).evaluation.dropped["sequential+regions+inductor"]
    tried = len(tries)
    again = opsched.optimize(model, (x,), repeats=3)
    offer = again.cost.kernel_choice["inductor_whole_graph"]
    assert len(tries) == tried and not offer["offered"]
    assert offer["why"] == ("the whole graph on Inductor did not compile or verify when last tried here; not "
                            "compiled again for 4 optimizes of this graph, this one included (--no-cache tries it "
                            "now)")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes())
def test_random_models_as_one_inductor_region_answer_as_the_model(recipe):
    """Random models (views, in-place writes, pools, gates, several inputs and outputs, float32, float64 and
    bfloat16) run as auto offers them to Inductor: each answers as the model, or Inductor refuses it in one line
    (float64 convolutions), never a wrong answer."""
    refused = check_inductor_region(recipe)
    assert not refused or refused.startswith("inductor could not compile"), refused
