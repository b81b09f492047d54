"""The CUDA backend. These tests run where PyTorch sees a CUDA device and are skipped elsewhere."""

import pytest
import torch

from opsched.cost.simulate import SimulatedGPU
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.runtime import cuda
from opsched.runtime.kernels import unit_operator
from opsched.runtime.program import compile_program
from opsched.schedulers import make_schedule

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_the_cuda_executor_says_when_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda.CUDAExecutor(None, unit_operator)


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
    assert cuda.time_cuda(lambda: executor(*inputs), repeats=3) > 0
