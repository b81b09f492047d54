"""torch.compile(model, backend="opsched"): each graph dynamo captures is scheduled and verified."""

import pytest
import torch
import torchvision

from opsched.dynamo import OpschedBackendWarning, opsched_backend


def test_the_backend_is_registered_with_dynamo():
    assert "opsched" in torch._dynamo.list_backends()


@pytest.mark.filterwarnings("error::opsched.dynamo.OpschedBackendWarning")  # scheduled, not run as given
def test_googlenet_through_torch_compile_matches_eager():
    torch._dynamo.reset()
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
    x = torch.randn(1, 3, 64, 64)
    fast = torch.compile(model, backend="opsched", options={"cost": "sim:v100"})
    with torch.no_grad():
        want = model(x)
        got = fast(x)
        again = fast(torch.ones_like(x))  # a second call reuses the compiled schedule on new inputs
    assert torch.allclose(got, want, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(again, model(torch.ones_like(x)), atol=1e-4)


class WithGraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.left = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.right = torch.nn.Conv2d(3, 4, 1)
        self.after = torch.nn.Conv2d(8, 2, 3)

    def forward(self, x):
        y = torch.cat([torch.relu(self.left(x)), torch.relu(self.right(x))], dim=1)
        print(end="")  # a graph break: dynamo hands the backend two graphs
        return self.after(y).sigmoid()


@pytest.mark.filterwarnings("error::opsched.dynamo.OpschedBackendWarning")
def test_a_model_with_a_graph_break_is_scheduled_graph_by_graph(monkeypatch):
    from opsched import dynamo

    torch._dynamo.reset()
    scheduled, compiled = [], []
    real = dynamo._schedule

    def schedule(gm, inputs, options):
        scheduled.append(gm)
        compiled.append(real(gm, inputs, options))
        return compiled[-1]

    monkeypatch.setattr(dynamo, "_schedule", schedule)
    model = WithGraphBreak().eval()
    x = torch.randn(2, 3, 12, 12)
    fast = torch.compile(model, backend="opsched", options={"cost": "sim:t4", "method": "lios"})
    with torch.no_grad():
        assert torch.allclose(fast(x), model(x), atol=1e-5)
    assert len(scheduled) == 2
    # dynamo keeps the resumed half's compiled code (and its module) past reset: end its worker threads, which
    # test_reliability counts
    for fn in compiled:
        if hasattr(fn, "module"):
            fn.module.close()


def test_graphs_opsched_cannot_schedule_run_as_dynamo_gave_them():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    x = torch.randn(1, 3, requires_grad=True)
    with pytest.warns(OpschedBackendWarning, match="gradients"):
        fn = opsched_backend(gm, [x])
    assert torch.equal(fn(x), gm(x))
    with pytest.raises(Exception, match="unknown opsched backend option"):
        opsched_backend(gm, [x.detach()], options={"speed": "max"})


def test_measured_graphs_go_through_the_one_runner_and_answer_as_the_faster(monkeypatch):
    # verified against the graph dynamo gave and timed interleaved with it: the plan only where it is faster
    from opsched import dynamo, pipeline

    torch._dynamo.reset()
    outcomes, returned = [], []
    real_run, real_schedule = pipeline.run_workload, dynamo._schedule

    def run_workload(job):
        outcomes.append(real_run(job))
        return outcomes[-1]

    def schedule(gm, inputs, options):
        returned.append((gm, real_schedule(gm, inputs, options)))
        return returned[-1][1]

    monkeypatch.setattr(pipeline, "run_workload", run_workload)
    monkeypatch.setattr(dynamo, "_schedule", schedule)
    model = WithGraphBreak().eval()
    x = torch.randn(2, 3, 12, 12)
    fast = torch.compile(model, backend="opsched", options={"method": "sequential"})
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast(x + 1), model(x + 1), rtol=1e-4, atol=1e-5)
    assert len(outcomes) == len(returned) == 2
    for outcome, (gm, fn) in zip(outcomes, returned):
        assert {"sequential", "eager"} <= set(outcome.evaluation.measured_ms)
        assert (fn == gm.forward) == (outcome.chosen == "eager")
        if hasattr(fn, "module"):
            fn.module.close()


class Convs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).relu()


@pytest.mark.filterwarnings("error::opsched.dynamo.OpschedBackendWarning")
def test_the_weights_dynamo_passes_as_inputs_are_held_by_the_plan_and_followed():
    # dynamo hands the parameters over as graph inputs: with freeze the plan holds them (so its convolutions can
    # be reordered once) and a weight changed in place, or replaced, is answered by the graph, never stale
    from opsched import dynamo

    torch._dynamo.reset()
    model = Convs().eval()
    x = torch.randn(1, 3, 16, 16)
    graph = torch.fx.symbolic_trace(lambda x, wa, ba, wb, bb: torch.nn.functional.conv2d(
        torch.relu(torch.nn.functional.conv2d(x, wa, ba, padding=1)), wb, bb, padding=1).relu())
    params = [model.a.weight, model.a.bias, model.b.weight, model.b.bias]
    fn = dynamo._schedule(graph, (x, *params), {**dynamo.OPTIONS, "cost": "sim:v100", "freeze": True})
    from opsched.runtime.packed import PackedUnit

    lowered = fn.module.executor.lowered
    assert any(isinstance(c.fn, PackedUnit) for k in range(len(lowered.streams)) for c in lowered.calls(k))
    with torch.no_grad():
        torch.testing.assert_close(fn(x, *params), model(x), rtol=1e-4, atol=1e-5)
        model.a.weight.mul_(2)  # in place, as an optimizer step
        torch.testing.assert_close(fn(x, *params), model(x), rtol=1e-4, atol=1e-5)
        other = torch.nn.Parameter(model.b.weight.detach() * 3)
        torch.testing.assert_close(fn(x, *params[:2], other, params[3]),
                                   torch.nn.functional.conv2d(torch.relu(model.a(x)), other, model.b.bias,
                                                              padding=1).relu(), rtol=1e-4, atol=1e-5)
    fn.module.close()


def test_by_default_the_parameters_stay_inputs_and_a_write_through_data_is_seen():
    from opsched import dynamo

    model = Convs().eval()
    x = torch.randn(1, 3, 16, 16)
    graph = torch.fx.symbolic_trace(lambda x, wa, ba, wb, bb: torch.nn.functional.conv2d(
        torch.relu(torch.nn.functional.conv2d(x, wa, ba, padding=1)), wb, bb, padding=1).relu())
    params = [model.a.weight, model.a.bias, model.b.weight, model.b.bias]
    with torch.no_grad():  # as the backend schedules a graph whose inputs require gradients (opsched_backend)
        fn = dynamo._schedule(graph, (x, *params), {**dynamo.OPTIONS, "cost": "sim:v100"})
        model.a.weight.data.mul_(2)  # off the version counter: only a plan that reads the weights sees it
        torch.testing.assert_close(fn(x, *params), model(x), rtol=1e-4, atol=1e-5)
    fn.module.close()
