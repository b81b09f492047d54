"""Several models at once on CUDA, on a machine without a GPU: a fused model batch (batched units, their
member selections) runs through the CUDA executor on the stand-in (tests/cuda_standin.py), which enforces
CUDA's rules for streams, events and memory, and on ``meta`` tensors, which catch a tensor made on the wrong
device; the ``threads`` peer puts each model on a stream of its own; fused training steps on the backend's
stream. The real-GPU run is the same code under ``torch.cuda`` (tests/test_cuda.py runs that where CUDA is)."""

import pytest
import torch
from cuda_standin import CudaStandIn

from opsched import peers
from opsched.cost.simulate import SimulatedGPU
from opsched.multi import ModelBatch, fuse_graph
from opsched.multi.train import FusedTraining, compare_training
from opsched.runtime import cuda
from opsched.runtime.kernels import unit_operator
from opsched.runtime.program import compile_program
from opsched.schedulers import make_schedule

METHODS = [("sequential", {}), ("lios", {"streams": 3}), ("hivemind", {}), ("ios", {})]


def small_cnn(device: str = "cpu") -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(6, 3)).eval().to(device)


def _batch(device: str = "cpu", count: int = 4) -> tuple[ModelBatch, torch.Tensor]:
    torch.manual_seed(0)
    models = [small_cnn(device) for _ in range(count)]
    x = torch.randn(1, 3, 8, 8, device=device)
    return ModelBatch(models, [(x,)] * count), x


@pytest.fixture(scope="module")
def fused():
    batch, x = _batch()
    fusion = fuse_graph(batch)  # no cost model: every batchable group is batched
    assert fusion.fused["same_input"] and fusion.fused["same_shape"]
    return batch, x, fusion.graph


@pytest.mark.parametrize("graph_mode", [False, True], ids=["streams", "cuda_graph"])
@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_a_fused_batch_runs_on_streams_and_every_model_gets_its_own_outputs(fused, method, options, graph_mode):
    batch, x, g = fused
    plan = make_schedule(method, g, SimulatedGPU(g, "v100"), **options)
    standin = CudaStandIn()
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(plan, g, 1), unit_operator, graph=graph_mode)
        for call, inputs in enumerate((x, x + 1)):
            standin.made_on_current(inputs)
            with torch.inference_mode(call == 0):
                outputs = executor(inputs)
            standin.assert_ready(*outputs)
            with torch.inference_mode():
                want = batch(inputs)
            assert len(outputs) == len(want)
            for got, expected in zip(outputs, want):
                assert (got - expected).abs().max().item() <= 1e-5
        standin.check()
    if len(executor.program.streams) > 1:
        assert standin.calls["wait"] and standin.calls["record"]


@pytest.mark.parametrize("method", ["sequential", "hivemind"])
def test_on_meta_a_fused_batch_makes_no_tensor_on_another_device(method):
    batch, x = _batch("meta")
    g = fuse_graph(batch).graph
    assert any(n.kind == "batched" for n in g.nodes)
    plan = make_schedule(method, g, SimulatedGPU(g, "v100"))
    standin = CudaStandIn("meta")
    with cuda.use_api(standin):
        executor = cuda.CUDAExecutor(compile_program(plan, g, 1), unit_operator)
        standin.made_on_current(x)
        outputs = executor(x)
        standin.assert_ready(*outputs)
    assert all(o.device.type == "meta" for o in outputs)


def test_the_threads_peer_runs_each_model_on_a_stream_of_its_own():
    batch, x = _batch()
    batch.device = "cuda"  # the stand-in models one GPU on which the models and inputs already are
    standin = CudaStandIn()
    with cuda.use_api(standin):
        runner = peers.threads(batch, (x,), cores=1, sync=standin.synchronize)[0]
        standin.made_on_current(x)
        outputs = runner.run()
        standin.assert_ready(*outputs)
    assert len(standin.streams) == 1 + len(batch.models) and standin.calls["use_stream"] >= len(batch.models)
    assert standin.calls["wait"] >= len(batch.models)  # every stream waited for the inputs
    with torch.inference_mode():
        assert all(torch.allclose(o, m(x), atol=1e-6) for o, m in zip(outputs, batch.models))


def _trainable(device: str = "cpu", count: int = 3) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [small_cnn(device).train() for _ in range(count)]


@pytest.mark.parametrize("method", ["channels", "vmap"])
def test_on_meta_fused_training_makes_no_tensor_on_another_device(method):
    """A training step (forward, summed loss, backward, SGD with a rate per model) of the fused models, watched
    on ``meta``: a tensor the step made on the host (the learning rates once were) is caught."""
    models = _trainable("meta")
    x = torch.randn(2, 3, 8, 8, device="meta")
    labels = torch.zeros(2, dtype=torch.long, device="meta")
    standin = CudaStandIn("meta")
    with cuda.use_api(standin), standin.use_stream(standin.current_stream()):
        standin.made_on_current(x, labels)
        fused = FusedTraining(models, (x,), method=method)
        assert fused.method == method
        for _ in range(2):
            fused.summed_loss(fused.stacked_forward(x), labels).backward()
            fused.step([0.1, 0.2, 0.3])
    assert all(p.device.type == "meta" and p.grad is None for p in fused.stacked)
    standin.check()


def test_training_on_the_cuda_backend_syncs_each_step_and_matches_the_models_alone():
    """compare_training(device="cuda") through the stand-in: every step on the backend's current stream, timed
    between synchronisations, the fused models ending where the models trained one after another do."""
    models = _trainable()
    x = torch.randn(4, 3, 8, 8)
    standin = CudaStandIn()
    with cuda.use_api(standin):
        standin.made_on_current(x)
        result = compare_training(models, (x,), steps=4, lrs=[0.05, 0.1, 0.2], device="cuda")
        standin.check()
    assert standin.calls["synchronize"] >= 2 * result["steps"] * 2  # before and after each step of both trainings
    assert result["method"] == "channels"
    assert result["max_param_diff"] <= max(4 * result["float32_noise"], 1e-6)


def test_the_models_optimized_as_cuda_graphs_beside_the_batch_captured_whole():
    # `opsched multi --device cuda --cuda-graph`: every plan replayed as one CUDA graph, timed beside the models
    # one after another captured as one graph (what a user of CUDA graphs runs), every model verified.
    from opsched.multi.optimize import optimize

    batch, x = _batch()
    standin = CudaStandIn()
    with cuda.use_api(standin):
        result = optimize(batch.models, (x,), methods=("sequential", "hivemind"), repeats=3, cache=False,
                          cuda_graph=True, device="cuda")
    ev = result.outcome.evaluation
    assert {"sequential", "hivemind", "sequential_models", "cuda_graph"} <= set(ev.measured_ms), ev.dropped
    assert max(result.model_errors) <= 1e-5 and result.plan().run.cuda_graph
    assert standin.calls["replay"] and standin.calls["capture"]
    standin.check()
