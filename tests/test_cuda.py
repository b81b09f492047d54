"""The CUDA backend on a real GPU (skipped where PyTorch sees none), and the default device interface's
mapping onto torch.cuda. On a machine without a GPU the backend runs through the stand-in instead: see
tests/test_cuda_executor.py and tests/cuda_standin.py."""

from unittest import mock

import pytest
import torch

import opsched
from opsched.cost.simulate import SimulatedGPU
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.runtime import cuda
from opsched.runtime.kernels import unit_operator
from opsched.runtime.profile import measured_cost
from opsched.runtime.program import compile_program
from opsched.schedulers import make_schedule

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_the_cuda_executor_says_when_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda.CUDAExecutor(None, unit_operator)


def test_the_default_interface_is_torch_cuda_called_as_documented():
    assert isinstance(cuda.current_api(), cuda.TorchCuda) and cuda.current_api().api is torch.cuda
    api = mock.MagicMock()
    api.current_device.return_value = 0
    api.get_device_capability.return_value = (8, 0)
    api.get_device_name.return_value = "A100"
    gpu = cuda.TorchCuda(api)
    stream, event, end, tensor, graph = (mock.MagicMock() for _ in range(5))
    assert gpu.available() is api.is_available.return_value
    assert gpu.describe().startswith("cuda|A100|sm_80|cuda ")
    assert gpu.current_stream() is api.current_stream.return_value
    assert gpu.new_stream() is api.Stream.return_value
    assert gpu.use_stream(stream) is api.stream.return_value
    api.stream.assert_called_with(stream)
    assert gpu.new_event(timing=True) is api.Event.return_value
    api.Event.assert_called_with(enable_timing=True)
    gpu.record(event, stream)
    event.record.assert_called_with(stream)
    gpu.wait(stream, event)
    stream.wait_event.assert_called_with(event)
    gpu.record_stream(tensor, stream)
    tensor.record_stream.assert_called_with(stream)
    gpu.synchronize()
    api.synchronize.assert_called_once_with()
    assert gpu.elapsed_ms(event, end) is event.elapsed_time.return_value
    event.elapsed_time.assert_called_with(end)
    assert gpu.new_graph() is api.CUDAGraph.return_value
    assert gpu.capture(graph) is api.graph.return_value
    api.graph.assert_called_with(graph, capture_error_mode="thread_local")
    gpu.replay(graph)
    graph.replay.assert_called_once_with()
    elapsed = api.Event.return_value.elapsed_time
    elapsed.return_value = 2.0  # a million cycles in 2 ms: the hold's clock, timed at its first call
    gpu.hold(0.5)
    api._sleep.assert_called_with(250_000)


@pytest.fixture(scope="module")
def on_gpu():
    m = load_model("inception_v3", batch=1, image_size=75)
    model = m.model.cuda().eval()
    inputs = [x.cuda() for x in m.inputs]
    return model, inputs, capture(model, tuple(inputs))


@needs_cuda
@pytest.mark.parametrize("method", ["sequential", "greedy", "lios", "nimble", "ios"])
@pytest.mark.parametrize("graph_mode", [False, True])
def test_every_schedule_runs_on_streams_and_matches_eager(on_gpu, method, graph_mode):
    model, inputs, g = on_gpu
    schedule = make_schedule(method, g, SimulatedGPU(g, "v100"))
    executor = cuda.CUDAExecutor(compile_program(schedule, g, 1), unit_operator, graph=graph_mode)
    with torch.inference_mode():
        want = model(*inputs)
        for _ in range(2):  # the second call replays the graph
            got = executor(*inputs)[0]
        torch.cuda.synchronize()
    assert (got - want).abs().max().item() <= 1e-3


@needs_cuda
def test_timeline_from_cuda_events(on_gpu):
    _, inputs, g = on_gpu
    schedule = make_schedule("greedy", g, SimulatedGPU(g, "v100"))
    executor = cuda.CUDAExecutor(compile_program(schedule, g, 1), unit_operator)
    executor(*inputs, record_timeline=True)
    assert len({u for _, units, _, _ in executor.timeline for u in units}) == len(g)
    assert all(0.0 <= start <= finish for _, _, start, finish in executor.timeline)
    assert cuda.time_cuda(lambda: executor(*inputs), repeats=3) > 0


@needs_cuda
def test_a_cuda_graph_verified_in_inference_mode_then_called_normally(on_gpu):
    model, inputs, g = on_gpu
    plan = make_schedule("ios", g, SimulatedGPU(g, "v100"))
    plan.device = "cuda"
    module = opsched.compile(g, plan, cuda_graph=True)
    assert opsched.verify(module, model, inputs).ok
    with torch.no_grad():
        got = module(*inputs).clone()
        assert (got - model(*inputs)).abs().max().item() <= 1e-3


@needs_cuda
def test_measured_costs_on_the_gpu(on_gpu):
    _, inputs, g = on_gpu
    cost = measured_cost(g, inputs, device="cuda", cache=False, repeats=3)
    assert cost.thread_options == [1] and cost.capacity >= 1.0
    assert cost.device.startswith("cuda|")
    # Behind a hold the launches are hidden: the units take no longer than with them (at this batch, less).
    replayed = measured_cost(g, inputs, device="cuda", cache=False, repeats=3, replayed=True)
    assert sum(replayed.best) <= 1.1 * sum(cost.best)
    # an extra stream's hand-off is host work (on an H200 0.05 ms on streams, about 0 behind a hold)
    assert replayed.sync_overhead < 0.5 * cost.sync_overhead


@needs_cuda
def test_a_hold_keeps_the_device_busy_for_about_its_time():
    api = cuda.current_api()
    api.hold(0.1)  # the clock is timed at the first hold
    ms = cuda.time_cuda(lambda: api.hold(2.0), repeats=5, warmup=1)
    assert 1.0 <= ms <= 4.0


def test_cuda_graph_without_a_cuda_device_is_bad_input(capsys):
    from opsched.cli import main

    assert main(["optimize", "squeezenet", "--image-size", "32", "--cuda-graph"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graph needs --device cuda" in err and len(err.strip().splitlines()) == 1


@needs_cuda
def test_a_model_batch_is_fused_scheduled_verified_and_timed_on_the_gpu():
    from opsched.multi.optimize import optimize

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                  torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval().cuda() for _ in range(4)]
    x = torch.randn(1, 3, 16, 16, device="cuda")
    result = optimize(models, (x,), methods=("sequential", "hivemind"), repeats=3, cache=False)
    ev = result.outcome.evaluation
    assert {"sequential", "hivemind", "sequential_models", "threads", "vmap"} <= set(ev.measured_ms)
    assert max(result.model_errors) <= 1e-3 and result.plan().device == "cuda"


@needs_cuda
def test_fused_training_on_the_gpu_matches_the_models_trained_alone():
    from opsched.multi.train import compare_training

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                  torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)).cuda()
              for _ in range(4)]
    result = compare_training(models, (torch.randn(8, 3, 16, 16, device="cuda"),), steps=5, device="cuda")
    assert result["method"] == "channels" and result["ms_per_step"]["fused"] > 0
    assert result["max_param_diff"] <= max(4 * result["float32_noise"], 1e-5)
