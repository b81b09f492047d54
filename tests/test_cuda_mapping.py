"""Plans mapped onto CUDA devices and the CPU run for real: every mapping method's plan for a branching CNN
(and GoogLeNet) on ``cuda:0``, ``cuda:1`` and the CPU runs through the stand-in (tests/cuda_standin.py, here
modelling two GPUs and the host) and equals eager; each rule of the stand-in that such a plan meets catches the
executor when it is made to break it; ``opsched map`` measures on CUDA devices and ``opsched run`` executes the
plans, both refusing in one line where there is no GPU. The same plans on real GPUs are at the end (skipped
where PyTorch sees none)."""

import inspect
import json
import textwrap

import pytest
import test_mapping_run
import torch
from cuda_standin import BrokenRule, CudaStandIn
from torch import nn

from opsched.cli import main
from opsched.errors import OpschedError
from opsched.graph.capture import capture
from opsched.mapping import MappingError
from opsched.mapping.execute import check_runnable
from opsched.mapping.plan import Mapping, to_schedule
from opsched.mapping.platform import platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.solve import solve
from opsched.runtime import cuda, make_executor
from opsched.runtime.cpu import UnitFailed
from opsched.runtime.cuda.devices import DevicesCall
from opsched.runtime.kernels import unit_operator
from opsched.runtime.module import OptimizedModule
from opsched.runtime.program import compile_program

METHODS = ["best-device", "met", "greedy", "heft", "sa", "ea", "milp", "milp-split"]
THREE = {"devices": [{"name": "gpu0", "kind": "cuda:0"}, {"name": "gpu1", "kind": "cuda:1"},
                     {"name": "cpu", "kind": "cpu", "threads": 1}],
         "links": {"default": {"bandwidth": 1e6, "latency": 0.001}}}


class Branchy(nn.Module):
    """A stem, three branches of different widths and kernels, concatenated, and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 4 * k, k, padding=k // 2), nn.ReLU())
                                      for k in (1, 3, 5))
        self.mix = nn.Conv2d(8, 4, 1)
        self.head = nn.Conv2d(40, 4, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.head(torch.cat([b(x) for b in self.branches] + [self.mix(x)], 1)), x.mean()


class Chain(nn.Module):
    """Three convolutions one after another: the smallest plan in which a value crosses each kind of device."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)).relu())


def _loaded(factory, shape, device="cpu"):
    torch.manual_seed(0)
    model = factory().eval().to(device)
    x = torch.randn(*shape, device=device)
    return model, x, capture(model, (x,))


@pytest.fixture(scope="module")
def branchy():
    return _loaded(Branchy, (1, 3, 12, 12))


def _spread(graph, platform):
    """Costs that make each unit fastest on a different device (unit u on device -u mod 3), so that every
    method but best-device spreads the units and values cross devices."""
    def measure(device, threads):
        d = platform.names.index(device.name)
        return [1.0 + 0.5 * ((u + d) % 3) for u in range(len(graph))]
    return measure


def _plan(graph, method, platform_doc=THREE):
    platform = platform_from_dict(platform_doc, "gpus")
    problem = build_problem(graph, platform, measure=_spread(graph, platform))
    solved = solve(problem, method, time_limit=1.0, seed=0)
    return to_schedule(problem, solved.mapping, solved.timeline, method, solved.lower_bound, solved.optimal, {})


def _placed(graph, device_of, platform_doc=THREE):
    """The plan that puts unit u on device ``device_of[u]``, each device running its units in graph order."""
    platform = platform_from_dict(platform_doc, "gpus")
    problem = build_problem(graph, platform, measure=lambda device, threads: [1.0] * len(graph))
    mapping = Mapping.from_devices(len(graph), device_of, range(len(graph)), len(platform.devices))
    return to_schedule(problem, mapping, replay(problem, mapping), "placed", 0.0, False, {})


def _equals_eager(module, model, x, tolerance=1e-5):
    """Call the module in inference mode (as opsched.verify does), then outside it on other inputs; both
    must equal the eager model's outputs."""
    for call, inputs in enumerate((x, x + 1)):
        with torch.inference_mode(call == 0):
            got = module(inputs)
        with torch.inference_mode():
            want = model(inputs)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() <= tolerance


@pytest.mark.parametrize("method", METHODS)
def test_every_methods_plan_runs_on_two_gpus_and_the_cpu_and_equals_eager(branchy, method):
    model, x, graph = branchy
    plan = _plan(graph, method)
    standin = CudaStandIn(devices=2)
    with cuda.use_api(standin):
        module = OptimizedModule(graph, plan, cores=2)
        assert isinstance(module.executor, cuda.DevicesExecutor)
        _equals_eager(module, model, x)
        standin.check()
    used = {op.stream for op in plan.ops}
    if method != "best-device":
        assert used == {0, 1, 2}  # both GPUs and the CPU: values cross every kind of link
        assert standin.calls["wait"] and standin.calls["record_stream"] and standin.calls["synchronize_event"]
    assert standin.calls["to"] >= 2 * 2  # at least the input in and the outputs out, on each call


def test_on_meta_every_tensor_of_the_gpus_is_made_on_their_device():
    # Rule 8 on top of the devices: a tensor created without device= inside a GPU's unit shows up on the CPU.
    _, x, graph = _loaded(Branchy, (1, 3, 12, 12), "meta")
    standin = CudaStandIn("meta", devices=2)
    with cuda.use_api(standin):
        module = OptimizedModule(graph, _plan(graph, "heft"), cores=2)
        with torch.inference_mode():
            out, mean = module(x)
        standin.check()
    assert out.device.type == "meta" and out.shape == (1, 4, 12, 12) and mean.shape == ()


def _googlenet():
    """GoogLeNet at 64x64, seeded, and its captured graph."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
    x = torch.randn(1, 3, 64, 64)
    return model, x, capture(model, (x,))


def test_googlenet_mapped_onto_two_gpus_and_the_cpu_equals_eager():
    model, x, graph = _googlenet()
    plan = _plan(graph, "heft")
    assert {op.stream for op in plan.ops} == {0, 1, 2}
    standin = CudaStandIn(devices=2)
    with cuda.use_api(standin):
        module = OptimizedModule(graph, plan, cores=2)
        with torch.inference_mode():
            assert (module(x) - model(x)).abs().max().item() <= 1e-4
        standin.check()


def test_two_devices_on_one_gpu_share_memory_without_copies():
    model, x, graph = _loaded(Chain, (1, 3, 8, 8))
    doc = {"devices": [{"name": "a", "kind": "cuda:0"}, {"name": "b", "kind": "cuda:0"}],
           "links": {"default": {"bandwidth": 1e6, "latency": 0.0}}}
    standin = CudaStandIn(devices=1)
    with cuda.use_api(standin):
        module = OptimizedModule(graph, _placed(graph, [0, 1, 0], doc), cores=1)
        _equals_eager(module, model, x)
        standin.check()
    assert standin.calls["to"] == 2 * 2  # only the input in and the output out, on each call
    assert standin.calls["record_stream"] == 2 * 2  # a's value read on b's stream, b's back on a's


# -- each rule catches the executor breaking it --

CHAIN_PLANS = {"gpu to gpu": [0, 1, 1], "gpu to cpu": [0, 2, 2], "cpu to gpu": [2, 0, 0]}


@pytest.fixture(scope="module")
def chain():
    return _loaded(Chain, (1, 3, 8, 8))


def _run_chain(chain, device_of):
    """Run the Chain placed by ``device_of`` on a fresh two-GPU stand-in; the module's outputs must equal eager."""
    model, x, graph = chain
    standin = CudaStandIn(devices=2)
    with cuda.use_api(standin):
        module = OptimizedModule(graph, _placed(graph, device_of), cores=1)
        with torch.inference_mode():
            assert (module(x) - model(x)).abs().max().item() <= 1e-5
        standin.check()
    return standin


@pytest.mark.parametrize("crossing", list(CHAIN_PLANS))
def test_as_written_the_executor_keeps_every_rule(chain, crossing):
    _run_chain(chain, CHAIN_PLANS[crossing])


def test_a_value_read_on_another_gpu_without_a_copy_is_caught(chain, monkeypatch):
    copy_to = DevicesCall._value

    def without_copies_between_gpus(call, slot, k, device):
        made_on = call.executor.device_of(slot)
        if made_on is not None and device is not None:
            return call.values[slot]
        return copy_to(call, slot, k, device)

    monkeypatch.setattr(DevicesCall, "_value", without_copies_between_gpus)
    with pytest.raises(UnitFailed, match="reads a tensor on cuda:0 without copying it to cuda:1"):
        _run_chain(chain, CHAIN_PLANS["gpu to gpu"])


def test_weights_left_on_the_host_are_caught(chain, monkeypatch):
    monkeypatch.setattr(CudaStandIn, "place", lambda self, module, device: module)
    with pytest.raises(UnitFailed, match="reads a tensor on the host without copying it to cuda:0"):
        _run_chain(chain, CHAIN_PLANS["gpu to gpu"])


def test_a_copy_that_does_not_wait_for_the_maker_is_a_race(chain, monkeypatch):
    monkeypatch.setattr(CudaStandIn, "wait", lambda self, stream, event: None)
    with pytest.raises(UnitFailed, match="a copy on <stream .* of cuda:1> reads a tensor written on <stream .* of "
                                         r"cuda:0> without waiting for it \(a race\)"):
        _run_chain(chain, CHAIN_PLANS["gpu to gpu"])


def test_a_copied_value_freed_without_record_stream_is_caught(chain, monkeypatch):
    monkeypatch.setattr(CudaStandIn, "record_stream", lambda self, tensor, stream: None)
    # found when the host drops the value, raised at the stand-in's next call (here, in the next unit)
    with pytest.raises((BrokenRule, UnitFailed), match="read on <stream .* of cuda:1> was freed without record_stream"):
        _run_chain(chain, CHAIN_PLANS["gpu to gpu"])


def test_a_copy_to_the_host_read_before_synchronising_is_caught(chain, monkeypatch):
    monkeypatch.setattr(CudaStandIn, "synchronize_event", lambda self, event: None)
    with pytest.raises(UnitFailed, match="the host reads .* a copy to the host from <stream .* of cuda:0> before "
                                         "synchronising with it"):
        _run_chain(chain, CHAIN_PLANS["gpu to cpu"])


def test_the_host_copy_rule_holds_for_the_outputs_too(chain, monkeypatch):
    monkeypatch.setattr(CudaStandIn, "synchronize_event", lambda self, event: None)
    with pytest.raises(BrokenRule, match="the host reads .* before synchronising with it"):
        _run_chain(chain, [0, 0, 0])  # every unit on cuda:0; the caller reads the output


def test_the_stand_in_refuses_an_event_recorded_on_another_device():
    standin = CudaStandIn(devices=2)
    event = standin.new_event()
    standin.record(event, standin.new_stream(0))
    with pytest.raises(BrokenRule, match="an event of cuda:0 recorded on <stream .* of cuda:1>"):
        standin.record(event, standin.new_stream(1))
    with pytest.raises(BrokenRule, match="synchronises with an event that was never recorded"):
        standin.synchronize_event(standin.new_event())
    with pytest.raises(ValueError, match="cuda:2 is not a device"):
        standin.new_stream(2)
    assert standin.to(torch.ones(2), None).tolist() == [1.0, 1.0]  # the host's already


def test_synchronizing_with_an_event_during_capture_is_refused():
    standin = CudaStandIn()
    event = standin.new_event()
    standin.record(event, standin.current_stream())
    with pytest.raises(BrokenRule, match="synchronises with an event during graph capture"), \
            standin.capture(standin.new_graph()):
        standin.synchronize_event(event)


# -- the executor's own errors --

def test_the_executor_refuses_what_it_cannot_run(chain):
    _, x, graph = chain
    plan = _placed(graph, CHAIN_PLANS["gpu to gpu"])
    program = compile_program(plan, graph, 1)

    class NoGPU(CudaStandIn):
        def available(self):
            return False

    with cuda.use_api(NoGPU(devices=2)), pytest.raises(cuda.CudaError, match="CUDA is not available"):
        cuda.DevicesExecutor(program, unit_operator, [0, 1])
    with cuda.use_api(CudaStandIn(devices=1)):
        with pytest.raises(cuda.CudaError, match="runs on cuda:1, but PyTorch sees 1 CUDA device"):
            cuda.DevicesExecutor(program, unit_operator, [0, 1])
        with pytest.raises(ValueError, match="2 streams, but 3 devices"):
            cuda.DevicesExecutor(program, unit_operator, [0, 0, None])
        with pytest.raises(OpschedError, match="not as one CUDA graph"):
            make_executor(program, unit_operator, [0, 1], cuda_graph=True)
    with cuda.use_api(CudaStandIn(devices=2)):
        executor = cuda.DevicesExecutor(program, unit_operator, [0, 1])
        with pytest.raises(ValueError, match="takes 1 inputs"):
            executor(x, x)
        with pytest.raises(cuda.CudaError, match="no per-unit timeline"):
            executor(x, record_timeline=True)
        with pytest.raises(cuda.CudaError, match="takes its inputs on the host"):
            executor(_OnGPU(x))
        for _ in range(2):  # a call after close starts the workers again
            with torch.inference_mode():
                assert executor(x)[0].shape == (1, 2, 8, 8)
            executor.close()
        executor.close()  # closed already: nothing to stop


class _OnGPU(torch.Tensor):
    """A tensor that says it is on a GPU (the only thing the executor looks at before refusing it)."""

    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device="cuda")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} ran on a tensor the executor should have refused")


def test_a_stream_waiting_on_an_event_never_recorded_deadlocks_and_says_so():
    from opsched.graph.ir import Graph, Node
    from opsched.runtime.program import Run, StreamProgram, Wait

    tiny = Graph([Node("a", args=("x",), run=torch.neg)], inputs=["x"])
    stuck = StreamProgram(tiny, [[Wait(0), Run((0,), 1)]], events=1, cores=1, readers=[0, 0], outputs=(1,))
    with cuda.use_api(CudaStandIn()), pytest.raises(RuntimeError, match="deadlocks"):
        cuda.DevicesExecutor(stuck, unit_operator, [0])


def test_a_failing_unit_stops_every_stream_and_is_named_once(chain):
    model, x, graph = chain
    calls = []

    def operator(nodes, threads):
        run = unit_operator(nodes, threads)
        if nodes[0].name != "a":
            return run

        def failing_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("out of memory")
            return run(*args)
        return failing_once

    plan = _placed(graph, [0, 2, 1])  # the CPU and cuda:1 wait for a, which fails
    with cuda.use_api(CudaStandIn(devices=2)):
        module = OptimizedModule(graph, plan, cores=1, operator=operator)
        with pytest.raises(UnitFailed, match="unit 'a' failed: RuntimeError: out of memory"):
            module(x)
        with torch.inference_mode():  # the workers are free again
            assert (module(x) - model(x)).abs().max().item() <= 1e-5


def test_the_default_interface_calls_torch_cuda_for_several_devices_as_documented():
    from unittest import mock

    api = mock.MagicMock()
    gpu = cuda.TorchCuda(api)
    assert gpu.device_count() is api.device_count.return_value
    assert gpu.new_stream(1) is api.Stream.return_value
    api.Stream.assert_called_with(device=1)
    tensor, event = mock.MagicMock(), mock.MagicMock()
    assert gpu.to(tensor, 1) is tensor.to.return_value
    tensor.to.assert_called_with(torch.device("cuda", 1), non_blocking=True)
    gpu.to(tensor, None)
    tensor.to.assert_called_with(torch.device("cpu"), non_blocking=True)
    gpu.synchronize_event(event)
    event.synchronize.assert_called_once_with()

    class Weights:
        def to(self, device):
            self.device = device
            return self

    original = Weights()
    placed = gpu.place(original, 1)
    assert placed is not original and placed.device == torch.device("cuda", 1) and not hasattr(original, "device")


# -- opsched map and opsched run --

# the branchy CNN test_mapping_run maps onto CPU devices, as a model file for the command line
MODEL_FILE = f"""
import torch
from torch import nn


{inspect.getsource(test_mapping_run.Branchy)}

def make():
    torch.manual_seed(0)
    return Branchy().eval(), (torch.randn(1, 3, 12, 12),)
"""


@pytest.fixture
def on_gpus(tmp_path):
    """A model file and a platform of two GPUs and the CPU (links that make spreading pay)."""
    model = tmp_path / "branchy.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    platform = tmp_path / "gpus.json"
    platform.write_text(json.dumps({**THREE, "links": {"default": {"bandwidth": 1e9, "latency": 0.0}}}))
    return f"{model}:make", str(platform)


def test_map_measures_on_each_gpu_and_run_executes_the_plan(on_gpus, tmp_path, capsys):
    model, platform = on_gpus
    plan = tmp_path / "plan.json"
    standin = CudaStandIn(devices=2)
    with cuda.use_api(standin):
        assert main(["map", model, "--platform", platform, "--method", "heft", "--time-limit", "1", "--repeats", "2",
                     "--out", str(plan), "--json"]) == 0
        mapped = json.loads(capsys.readouterr().out)
        assert not mapped["simulated"] and mapped["unit"] == "ms" and sum(mapped["devices"].values()) == 6
        assert standin.calls["place"] and standin.calls["elapsed_ms"]  # the GPUs' costs were timed on them
        # real devices: the mapped plan verified and timed beside eager, as optimize does
        assert "heft" in mapped["measured_ms"] and "eager" in mapped["measured_ms"] and mapped["max_abs_error"] <= 1e-4
        assert main(["run", model, "--plan", str(plan), "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == "local" and sum(result["devices"].values()) == 6
    assert result["max_abs_error"] <= 1e-4


class NoGPU(cuda.TorchCuda):
    """torch.cuda on a machine without a GPU, whatever this machine has (the suite runs on GPU machines too)."""

    def available(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0


def test_without_a_gpu_map_and_run_refuse_in_one_line(on_gpus, tmp_path, capsys):
    model, platform = on_gpus
    *_, graph = _loaded(Branchy, (1, 3, 12, 12))
    plan = tmp_path / "plan.json"
    _plan(graph, "heft").save(str(plan))
    with cuda.use_api(NoGPU()):
        assert main(["map", model, "--platform", platform, "--method", "heft"]) == 2
        err = capsys.readouterr().err
        assert "the platform has CUDA device(s) gpu0 (cuda:0); PyTorch sees no CUDA device here" in err
        assert len(err.strip().splitlines()) == 1
        assert main(["run", model, "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "maps units onto CUDA device(s) gpu0 (cuda:0), gpu1 (cuda:1); PyTorch sees no CUDA device here" in err
    assert len(err.strip().splitlines()) == 1


def test_a_gpu_the_machine_lacks_is_refused_in_one_line(on_gpus, tmp_path, capsys):
    model, platform = on_gpus
    with cuda.use_api(CudaStandIn(devices=1)):
        assert main(["map", model, "--platform", platform, "--method", "heft"]) == 2
        err = capsys.readouterr().err
        assert "the platform has gpu1 (cuda:1); PyTorch sees 1 CUDA device" in err and len(err.splitlines()) == 1
        *_, graph = _loaded(Branchy, (1, 3, 12, 12))
        with pytest.raises(MappingError, match=r"onto gpu1 \(cuda:1\); PyTorch sees 1 CUDA device"):
            check_runnable(_plan(graph, "heft"))


def test_run_refuses_ray_and_trace_for_a_plan_on_gpus(on_gpus, tmp_path, capsys):
    model, _ = on_gpus
    plan = tmp_path / "plan.json"
    *_, graph = _loaded(Branchy, (1, 3, 12, 12))
    _plan(graph, "heft").save(str(plan))
    with cuda.use_api(CudaStandIn(devices=2)):
        assert main(["run", model, "--plan", str(plan), "--engine", "ray"]) == 2
        err = capsys.readouterr().err
        assert "--engine ray runs CPU devices" in err and "gpu0, gpu1" in err and len(err.strip().splitlines()) == 1
        assert main(["run", model, "--plan", str(plan), "--trace", str(tmp_path / "t.json")]) == 2
        err = capsys.readouterr().err
        assert "--trace records per-unit times" in err and len(err.strip().splitlines()) == 1


# -- on real GPUs --

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices")
ONE_GPU = {"devices": [THREE["devices"][0], THREE["devices"][2]], "links": THREE["links"]}


@pytest.fixture
def full_precision(monkeypatch):
    """No TF32 in cuDNN and cuBLAS (cuDNN's default on recent GPUs): the GPUs then compute what the CPU does, up
    to float32 rounding, and a difference beyond that is the executor's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@needs_cuda
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("method", METHODS)
def test_on_a_real_gpu_every_methods_plan_equals_eager(branchy, method):
    model, x, graph = branchy
    module = OptimizedModule(graph, _plan(graph, method, ONE_GPU), cores=2)
    _equals_eager(module, model, x, tolerance=1e-4)


@needs_two_gpus
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("method", METHODS)
def test_on_two_real_gpus_every_methods_plan_equals_eager(branchy, method):
    model, x, graph = branchy
    module = OptimizedModule(graph, _plan(graph, method), cores=2)
    for _ in range(3):  # again and again: memory freed by one call is reused by the next
        _equals_eager(module, model, x, tolerance=1e-4)


@needs_two_gpus
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("crossing", list(CHAIN_PLANS))
def test_on_two_real_gpus_every_crossing_equals_eager(chain, crossing):
    model, x, graph = chain
    module = OptimizedModule(graph, _placed(graph, CHAIN_PLANS[crossing]), cores=1)
    _equals_eager(module, model, x, tolerance=1e-4)


@needs_two_gpus
@pytest.mark.usefixtures("full_precision")
def test_on_two_real_gpus_googlenet_equals_eager():
    model, x, graph = _googlenet()
    module = OptimizedModule(graph, _plan(graph, "heft"), cores=2)
    with torch.inference_mode():
        assert (module(x) - model(x)).abs().max().item() <= 1e-3


@needs_two_gpus
@pytest.mark.usefixtures("full_precision")
def test_on_two_real_gpus_map_measures_and_run_verifies(on_gpus, tmp_path, capsys):
    model, platform = on_gpus
    plan = tmp_path / "plan.json"
    assert main(["map", model, "--platform", platform, "--method", "heft", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", model, "--plan", str(plan), "--repeats", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_abs_error"] <= 1e-3
