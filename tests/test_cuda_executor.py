"""The CUDA backend on a machine without a GPU: every scheduler's program runs through the CUDA executor on
the stand-in (tests/cuda_standin.py), which enforces CUDA's rules for streams, events, memory and graph
capture, with and without a CUDA graph, and on ``meta`` tensors, which catch every tensor made on the wrong
device. Also the regressions of issue 15, ``opsched.compile`` on CUDA and the measured cost model's GPU
branches."""

import pytest
import torch
from cuda_standin import CudaStandIn
from torch import nn

import opsched
from opsched.cost.measure import SHARING_COPIES
from opsched.cost.simulate import SimulatedGPU
from opsched.errors import OpschedError
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.runtime import cuda, make_executor
from opsched.runtime.cuda.streams import HOLD_EXTRA_MS
from opsched.runtime.kernels import unit_operator
from opsched.runtime.merge import merged_operator
from opsched.runtime.profile import measured_cost
from opsched.runtime.program import Record, Run, StreamProgram, Wait, compile_program
from opsched.schedule import from_stages
from opsched.schedulers import make_schedule


class Branches(nn.Module):
    """An Inception-like block: a stem, three branches (two convolutions without bias and with batch norm
    that can merge, a pool and a convolution), concatenated, then a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Sequential(nn.Conv2d(8, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.c = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(8, 4, 1))
        self.head = nn.Conv2d(14, 4, 1)
        for bn in (self.a[1], self.b[1]):  # statistics that make folding them matter
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        x = self.stem(x).relu()
        return self.head(torch.cat([self.a(x), self.b(x), self.c(x)], 1))


class TwoInputs(nn.Module):
    """Two inputs, a residual diamond and two outputs."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 3, padding=1)
        self.mix = nn.Conv2d(4, 4, 1)

    def forward(self, x, y):
        left, right = self.left(x).relu(), self.right(y).relu()
        joined = self.mix(left + right)
        return joined + left, right.mean(dim=(2, 3))


MODELS = {"branches": (Branches, [(1, 3, 8, 8)]), "two_inputs": (TwoInputs, [(1, 3, 6, 6), (1, 3, 6, 6)])}
METHODS = [("sequential", {}), ("greedy", {}), ("lios", {"streams": 3}), ("nimble", {}), ("ios", {}),
           ("exact", {"streams": 3, "time_limit": 5.0})]


def _load(name: str, device: str = "cpu"):
    torch.manual_seed(0)
    factory, shapes = MODELS[name]
    model = factory().eval().to(device)
    inputs = tuple(torch.randn(*s, device=device) for s in shapes)
    return model, inputs, capture(model, inputs)


@pytest.fixture(scope="module")
def models():
    return {name: _load(name) for name in MODELS}


@pytest.fixture(scope="module")
def on_meta():
    return _load("branches", "meta")


def _merge_plan(g: Graph):
    """Branches with its two batch-normed convolutions merged."""
    i = g.index
    stages = [("concurrent", [[i["stem"]]]), ("merge", [[i["a.0"]], [i["b.0"]]]),
              ("concurrent", [[i["c.0"], i["c.1"]]]), ("concurrent", [[i["cat"]]]), ("concurrent", [[i["head"]]])]
    return from_stages(g, SimulatedGPU(g, "v100"), "merged", stages)


def _run_twice(standin, executor, model, inputs):
    """Call the executor in inference mode (as opsched.verify does), then outside it (as a user does) on
    other inputs; both must equal eager, the caller reading the outputs only once they are joined back."""
    for call, x in enumerate((inputs, tuple(t + 1 for t in inputs))):
        standin.made_on_current(*x)
        with torch.inference_mode(call == 0):
            outputs = executor(*x)
        standin.assert_ready(*outputs)
        with torch.inference_mode():
            want = model(*x)
        want = want if isinstance(want, tuple) else (want,)
        for got, expected in zip(outputs, want):
            assert (got - expected).abs().max().item() <= 1e-5
    standin.check()


@pytest.mark.parametrize("graph_mode", [False, True], ids=["streams", "cuda_graph"])
@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_schedule_runs_on_the_standin_and_matches_eager(models, name, method, options, graph_mode):
    model, inputs, g = models[name]
    plan = make_schedule(method, g, SimulatedGPU(g, "v100"), **options)
    standin = CudaStandIn()
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(plan, g, 1), unit_operator, graph=graph_mode)
        _run_twice(standin, executor, model, inputs)
    if len(executor.program.streams) > 1:
        assert standin.calls["wait"] and standin.calls["record"]  # the streams really were synchronised
        if not graph_mode:
            assert standin.calls["record_stream"]


@pytest.mark.parametrize("graph_mode", [False, True], ids=["streams", "cuda_graph"])
def test_a_merge_stage_runs_on_the_standin(models, graph_mode):
    model, inputs, g = models["branches"]
    standin = CudaStandIn()
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(_merge_plan(g), g, 1), unit_operator, graph=graph_mode)
        _run_twice(standin, executor, model, inputs)


@pytest.mark.parametrize("graph_mode", [False, True], ids=["streams", "cuda_graph"])
@pytest.mark.parametrize("plan", ["merge", "greedy", "lios"])
def test_on_meta_no_tensor_is_made_on_another_device(on_meta, plan, graph_mode):
    # Regression (merge.py): the zero bias of a convolution without bias was made on the CPU and mixed with
    # the model's weights when the batch norm was folded; on meta as on CUDA that fails.
    _, inputs, g = on_meta
    schedule = _merge_plan(g) if plan == "merge" else make_schedule(plan, g, SimulatedGPU(g, "v100"))
    standin = CudaStandIn("meta")
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(schedule, g, 1), unit_operator, graph=graph_mode)
        for _ in range(2):
            (out,) = executor(*inputs)
            standin.assert_ready(out)
    assert out.device.type == "meta" and out.shape == (1, 4, 8, 8)


def test_the_merged_bias_of_convolutions_without_bias_is_on_their_device(on_meta):
    _, _, g = on_meta
    merged = merged_operator([g.nodes[g.index["a.0"]], g.nodes[g.index["b.0"]]])
    a, b = merged(torch.randn(1, 8, 8, 8, device="meta"))
    assert a.device.type == b.device.type == "meta"


def test_a_timeline_of_many_steps_from_events(models):
    # Regression (cuda.py): the timeline took min() over CUDA events, which have no order: any program
    # of two or more steps raised TypeError.
    _, inputs, g = models["branches"]
    plan = make_schedule("greedy", g, SimulatedGPU(g, "v100"))
    standin = CudaStandIn()
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(plan, g, 1), unit_operator)
        executor(*inputs, record_timeline=True)
    assert sorted(u for _, units, _, _ in executor.timeline for u in units) == list(range(len(g)))
    assert all(0.0 <= start <= finish for _, _, start, finish in executor.timeline)
    assert len({stream for stream, *_ in executor.timeline}) > 1


def test_a_cuda_graph_has_no_timeline_and_says_so(models):
    _, inputs, g = models["branches"]
    with cuda.use_api(CudaStandIn()):
        executor = cuda.CUDAExecutor(compile_program(_merge_plan(g), g, 1), unit_operator, graph=True)
        with pytest.raises(cuda.CudaError, match="timeline"):
            executor(*inputs, record_timeline=True)


def test_cuda_graph_static_tensors_are_not_inference_tensors(models):
    # Regression (cuda.py): the static inputs were cloned in the caller's grad mode; captured during
    # opsched.verify (inference mode), the next ordinary call failed with "Inplace update to inference
    # tensor outside InferenceMode".
    model, inputs, g = models["branches"]
    plan = make_schedule("greedy", g, SimulatedGPU(g, "v100"))
    with cuda.use_api(CudaStandIn()):
        module = opsched.compile(g, plan, device="cuda", cuda_graph=True)
        assert opsched.verify(module, model, inputs).ok
        again = module(*inputs)  # an ordinary call: copies into the static inputs
    assert not any(t.is_inference() for t in module.executor._static_inputs + module.executor._static_outputs)
    assert (again - model(*inputs)).abs().max().item() <= 1e-5


def test_the_executor_checks_its_inputs_and_reports_a_deadlock(models):
    _, inputs, g = models["branches"]
    with cuda.use_api(CudaStandIn()):
        executor = cuda.CUDAExecutor(compile_program(_merge_plan(g), g, 1), unit_operator)
        with pytest.raises(ValueError, match="takes 1 inputs"):
            executor(*inputs, *inputs)
        executor.close()
        tiny = Graph([Node("a", args=("x",), run=torch.neg)], inputs=["x"])
        stuck = StreamProgram(tiny, [[Wait(0), Run((0,), 1)], [Record(1)]], events=2, cores=1, readers=[0, 0],
                              outputs=(1,))
        with pytest.raises(RuntimeError, match="deadlocks"):
            cuda.CUDAExecutor(stuck, unit_operator)(torch.ones(1))


def test_without_cuda_the_executor_refuses_in_one_line():
    class NoGPU(CudaStandIn):
        def available(self):
            return False

    with cuda.use_api(NoGPU()):
        assert not cuda.available()
        with pytest.raises(cuda.CudaError, match="CUDA is not available"):
            make_executor(None, unit_operator, "cuda")


def test_time_cuda_times_with_events_on_the_current_stream():
    standin = CudaStandIn()
    with cuda.use_api(standin):
        assert cuda.time_cuda(lambda: torch.ones(64).sum(), repeats=3, warmup=1) >= 0
    assert standin.calls["elapsed_ms"] == 3


# -- opsched.compile --

def test_compile_runs_a_plan_on_the_device_it_was_made_for(models):
    # Regression: opsched.compile took no device, so a plan made for CUDA ran on the CPU.
    model, inputs, g = models["branches"]
    plan = make_schedule("lios", g, SimulatedGPU(g, "v100"), streams=2)
    plan.device = "cuda"
    with cuda.use_api(CudaStandIn()):
        module = opsched.compile(model, plan, inputs)
        assert isinstance(module.executor, cuda.CUDAExecutor)
        assert opsched.verify(module, model, inputs).ok
    seen = []

    def operator(nodes, threads):
        seen.append(tuple(n.name for n in nodes))
        return unit_operator(nodes, threads)

    module = opsched.compile(g, plan, device="cpu", operator=operator)
    assert opsched.verify(module, model, inputs).ok and len(seen) == len(g)


def test_compile_refuses_what_cannot_run():
    *_, g = _load("two_inputs", "meta")
    plan = make_schedule("sequential", g, SimulatedGPU(g, "v100"))
    with pytest.raises(OpschedError, match="CUDA graph needs device 'cuda'"):
        opsched.compile(g, plan, device="cpu", cuda_graph=True)
    with pytest.raises(OpschedError, match="unknown device"):
        opsched.compile(g, plan, device="tpu")
    cpu_model, cpu_inputs, _ = _load("two_inputs")
    with cuda.use_api(CudaStandIn("meta")):
        with pytest.raises(OpschedError, match="example inputs are on cpu"):
            opsched.compile(cpu_model, plan, cpu_inputs, device="cuda")
        with pytest.raises(OpschedError, match="weights are on cpu"):
            opsched.compile(capture(cpu_model, cpu_inputs), plan, device="cuda")


# -- the measured cost model on a GPU --

def test_measured_costs_on_a_gpu_profile_once_and_measure_how_units_share_the_device(models, tmp_path):
    # Regression (measure.py): a GPU was costed as CPU cores (capacity = core count, a profile per thread
    # count, work spread over cores); and with events that had no order, profiling died on the first units.
    from opsched.cost.cache import LatencyCache

    _, inputs, g = models["branches"]
    threads = torch.get_num_threads()
    cache = LatencyCache(tmp_path / "c.sqlite")
    standin = CudaStandIn()
    with cuda.use_api(standin):
        cost = measured_cost(g, inputs, cores=2, device="cuda", cache=cache, repeats=2)
    assert torch.get_num_threads() == threads
    assert cost.thread_options == [1] and cost.counts["units_measured"] == len(g)
    assert cost.device.startswith("cuda|stand-in")
    assert all(1.0 / SHARING_COPIES <= f <= 1.0 for f in cost.fill)
    assert cost.capacity == pytest.approx(1.0 / min(cost.fill))
    assert "cores" not in cost.describe() and cost.describe()["capacity"] == cost.capacity
    i = g.index
    groups = [[i["a.0"]], [i["b.0"]], [i["c.0"], i["c.1"]]]
    longest = max(sum(cost.op_latency(u) for u in grp) for grp in groups)
    filled = sum(cost.op_latency(u) * cost.fill[u] for grp in groups for u in grp)
    assert cost.stage_latency(groups) == pytest.approx(max(longest, filled) + 2 * cost.sync_overhead)
    assert cost.stream_latency(0.0, groups) == pytest.approx(filled)
    with cuda.use_api(standin):
        cost.measure_schedule([("concurrent", ((u,),)) for u in range(i["a.0"])]
                              + [("concurrent", tuple(tuple(grp) for grp in groups))]
                              + [("concurrent", ((u,),)) for u in range(i["cat"], len(g))], refresh=True)
        assert cost.measure_program(compile_program(make_schedule("lios", g, cost, streams=2), g, 1)) > 0
        again = measured_cost(g, inputs, device="cuda", cache=cache, repeats=2)
    assert again.counts["units_cached"] == len(g) and again.fill == cost.fill


def test_costs_for_replayed_graphs_time_every_run_behind_a_hold_and_are_cached_apart(models, tmp_path):
    # At batch 1 on an H100, IOS's costs timed on streams carried every launch, concurrency rarely paid, and
    # its plan replayed as a CUDA graph ran 1.02-1.23x the whole model's graph where LIOS's ran 1.76-2.10x.
    from opsched.cost.cache import LatencyCache

    _, inputs, g = models["branches"]
    cache = LatencyCache(tmp_path / "c.sqlite")
    launched, replayed = CudaStandIn(), CudaStandIn()
    with cuda.use_api(launched):
        with_launches = measured_cost(g, inputs, device="cuda", cache=cache, repeats=2)
    with cuda.use_api(replayed):
        without = measured_cost(g, inputs, device="cuda", cache=cache, repeats=2, replayed=True)
        holds = replayed.calls["hold"]
        program = compile_program(make_schedule("lios", g, without, streams=2), g, 1)
        assert without.measure_program(program) > 0
        assert replayed.calls["hold"] == holds + 2  # each timed run of the program, not its warm-up
    replayed.check()
    assert "hold" not in launched.calls
    # the units in order, their copies side by side, and the two hand-off probes, 2 timed runs each: every timed
    # run held, none of the warm-ups
    assert holds == 2 + 2 + 2 * 2
    # each on the stream the run is timed from, long enough to cover the host, and followed first by the run's
    # origin (a timing event): a hold after the run, or on another stream, would hide nothing
    assert all(stream == 0 and ms >= HOLD_EXTRA_MS and following == "a timing event"
               for stream, ms, following in replayed.holds), replayed.holds
    assert without.device == with_launches.device + "|launches hidden, as replayed"
    assert without.counts["units_measured"] == len(g)  # not the other's timings from the cache
    timed = CudaStandIn()
    with cuda.use_api(timed):
        cuda.time_cuda(lambda: None, repeats=4, warmup=1, queued=True)
    assert [following for *_, following in timed.holds] == ["a timing event"] * 4


# -- the whole model as one CUDA graph (the cuda_graph peer), and the command line on the device interface --

def test_the_cuda_graph_peer_replays_the_model_within_cudas_rules(models, monkeypatch):
    from opsched.peers import cuda_graph

    model, inputs, _ = models["branches"]
    standin = CudaStandIn()
    with cuda.use_api(standin):
        replay = cuda_graph(model, inputs)
        for scale in (1.0, -2.0):  # a new call's inputs are copied in: the replay answers for them, not the first
            x = inputs[0] * scale
            standin.made_on_current(x)
            out = replay(x)
            standin.synchronize()
            standin.assert_ready(out)
            with torch.no_grad():
                assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-6)
        assert standin.calls["replay"] == 2
        with pytest.raises(cuda.CudaError, match="captured for inputs"):
            replay(torch.cat([inputs[0], inputs[0]]))  # another batch would be broadcast into the static input
        with torch.inference_mode():  # made inside inference mode, the graph's tensors still serve later calls
            inside = cuda_graph(model, inputs)
        out = inside(inputs[0])
        standin.synchronize()
        with torch.no_grad():
            assert torch.allclose(out, model(inputs[0]), rtol=1e-5, atol=1e-6)
    standin.check()
    # under CUDA autocast (which a machine without CUDA cannot enter: asked as the code asks it)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device=None: device == "cuda")
    with pytest.raises(cuda.CudaError, match="autocast"):
        cuda_graph(model, inputs, standin)


def test_optimize_on_cuda_runs_through_the_device_interface(tmp_path, capsys):
    # The command line asked torch.cuda whether there was a GPU and moved the model to "cuda" itself, so that
    # nothing of `opsched optimize --device cuda` could run before a GPU was at hand.
    import json

    from support.fault_trials import MODEL_FILE

    from opsched.cli import main

    model = tmp_path / "branches.py"
    model.write_text(MODEL_FILE)
    standin = CudaStandIn()
    with cuda.use_api(standin):
        assert main(["optimize", f"{model}:make", "--device", "cuda", "--cuda-graph", "--method", "lios",
                     "--repeats", "3", "--no-cache", "--json", "-q", "--out", str(tmp_path / "p.json")]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {"eager", "cuda_graph", "lios"} <= set(answer["measured_ms"]) and answer["chosen"]
    assert standin.calls["replay"] and standin.calls["wait"]
    assert standin.calls["hold"]  # plans to be replayed are costed with their launches hidden
    standin.check()
    on_streams = CudaStandIn()
    with cuda.use_api(on_streams):  # on streams alone, the answer says what --cuda-graph would add
        assert main(["optimize", f"{model}:make", "--device", "cuda", "--method", "lios", "--repeats", "3",
                     "--no-cache", "--json", "-q", "--out", str(tmp_path / "q.json")]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert "cuda_graph" not in answer["measured_ms"] and any("--cuda-graph" in w for w in answer["warnings"])
    assert "hold" not in on_streams.calls  # plans run on streams pay their launches, and are costed with them
