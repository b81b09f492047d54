import pytest
import torch
from torch import nn

import opsched
from opsched.errors import CaptureError
from opsched.graph.capture import capture
from opsched.graph.interpret import run_graph
from opsched.graph.ir import can_merge


def check(model, *inputs, **kw):
    g = opsched.capture(model, inputs, **kw)
    with torch.no_grad():
        expected = model(*inputs)
        got = opsched.run_graph(g, *inputs)
    # exact, but for the batch norms folded into their convolutions (rounding)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    return g


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.b = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.c = nn.Conv2d(3, 8, 5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(24 * 4 * 4, 10)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x), self.c(x).relu()], 1)
        return self.fc(torch.flatten(self.pool(y), 1))


def test_units_group_heavy_ops_with_their_light_followers():
    g = check(Branches().eval(), torch.randn(2, 3, 8, 8))
    assert [(n.name, n.kind) for n in g.nodes] == [
        ("a.0", "conv"), ("b.0", "conv"), ("c", "conv"), ("cat", "cat"), ("pool", "pool"), ("fc", "linear")]
    a, b, c = g.nodes[:3]
    assert a.ops == ("conv2d", "batch_norm", "relu") and a.args == ("x",)
    assert g.nodes[3].args == ("a.0", "b.0", "c")
    assert g.nodes[4].ops == ("max_pool2d", "flatten") and g.nodes[5].ops == ("linear",)
    assert a.shape == (2, 8, 8, 8) and a.dtype == "float32"
    out = 2 * 8 * 8 * 8
    assert a.flops == out * 2 * 3 * 1 * 1 + out + out  # conv (2 x Cin x k x k per output), batch norm, relu
    assert b.attrs["kernel"] == (3, 3) and b.attrs["padding"] == (1, 1) and b.attrs["post"] == ("batch_norm", "relu")
    assert a.param_bytes == (8 * 3 + 8 + 4 * 8) * 4
    assert a.bytes_read == 2 * 3 * 8 * 8 * 4 + a.param_bytes and a.bytes_written == 2 * 8 * 8 * 8 * 4
    assert can_merge([a, b]) and can_merge([a, b, c])  # c's activation is its relu, like a and b's
    assert g.outputs == ("fc",) and g.inputs == ("x",)


class SharedInplace(nn.Module):
    """relu_ mutates a tensor that another operator read first: capture must keep eager's result."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.other = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        z = self.other(y)
        y.relu_()
        return y + z


def test_inplace_op_on_a_shared_tensor_is_functionalized():
    g = check(SharedInplace().eval(), torch.randn(1, 3, 5, 5))
    assert all(not op.endswith("_") for n in g.nodes for op in n.ops)


class Chunks(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 1)
        self.d, self.e = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        a, b = self.c(x).chunk(2, 1)
        scale = torch.sigmoid(self.w).view(1, 4, 1, 1)  # depends on no input: recomputed in its readers
        return {"sum": self.d(a) * scale + self.e(b), "b": b}


def test_multi_output_ops_constants_and_dict_outputs():
    g = check(Chunks().eval(), torch.randn(2, 3, 6, 6))
    assert isinstance(opsched.run_graph(g, torch.randn(2, 3, 6, 6)), dict)
    assert len(g.outputs) == 2


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(5, 3), nn.Linear(7, 3)

    def forward(self, x, y):
        return self.f(x) - self.g(y), self.f(x)


def test_several_inputs_and_outputs():
    g = check(TwoInputs().eval(), torch.randn(4, 5), torch.randn(4, 7))
    assert g.inputs == ("x", "y")


class SepConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x):
        return self.bn(self.pw(self.dw(torch.relu(x)))) + x.mean()


def test_depthwise_then_pointwise_is_one_separable_unit():
    g = check(SepConv().eval(), torch.randn(1, 8, 6, 6))
    sep = [n for n in g.nodes if n.kind == "sepconv"]
    assert len(sep) == 1 and sep[0].ops == ("relu", "conv2d", "conv2d", "batch_norm")
    assert sep[0].attrs["pre"] == ("relu",) and sep[0].attrs["groups"] == 8


def test_falls_back_to_torch_fx_when_export_fails(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("export is broken here")

    monkeypatch.setattr(torch.export, "export", broken)
    g = check(Branches().eval(), torch.randn(1, 3, 8, 8))
    assert [n.kind for n in g.nodes] == ["conv", "conv", "conv", "cat", "pool", "linear"]
    assert g.nodes[0].attrs["kernel"] == (1, 1) and g.nodes[0].flops > 0


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_uncapturable_model_names_the_model_and_both_reasons():
    with pytest.raises(CaptureError) as info:
        opsched.capture(DataDependent(), (torch.randn(3),))
    msg = str(info.value)
    assert msg.startswith("cannot capture DataDependent: torch.export failed (") and "torch.fx failed (" in msg
    assert "\n" not in msg


def test_not_a_module():
    with pytest.raises(CaptureError, match="expected a torch.nn.Module"):
        opsched.capture(lambda x: x, (torch.randn(1),))


def test_output_that_ignores_the_inputs_is_refused():
    class Const(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return self.w * 2

    with pytest.raises(CaptureError, match="output 0 does not depend on the inputs"):
        opsched.capture(Const(), (torch.randn(2),))


def test_an_output_that_is_not_a_tensor_is_named_in_the_refusal():
    class WithNone(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return self.conv(x), None

    with pytest.raises(CaptureError, match="output 1 is None, not a tensor"):
        opsched.capture(WithNone(), (torch.randn(1, 3, 4, 4),))


def test_units_read_weights_under_flat_names_and_activate_in_place_only_what_they_made():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
            self.head = torch.nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = torch.relu(self.stem(x))
            return torch.relu(self.head(y)) + torch.relu(y)  # relu(y): y is read twice, never overwritten

    model = Net().eval()
    x = torch.randn(1, 3, 8, 8)
    g = capture(model, (x,))
    code = "\n".join(n.run.code for n in g.nodes)
    assert "self.stem." not in code and "self.stem_0_0_weight" in code  # one lookup per weight, not per level
    assert "aten.relu_.default" in code
    for n in g.nodes:  # never in place on a unit's input: another unit may read it at the same time
        for node in n.run.graph.nodes:
            if node.target is torch.ops.aten.relu_.default:
                assert node.args[0].op != "placeholder"
    with torch.inference_mode():  # the batch norm folded into the convolution: equal up to rounding
        torch.testing.assert_close(run_graph(g, x), model(x), rtol=1e-5, atol=1e-6)


def test_units_merge_only_when_the_operators_around_the_convolution_are_the_same():
    # HRNet's fuse layers: 1x1 convolutions of one input, each upsampled by its own factor. Merged, the
    # stacked output was upsampled by the first unit's factor for every unit (found by benchmarks/sweep.py).
    class Fuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(4, 2, 1), nn.Conv2d(4, 2, 1), nn.Conv2d(4, 2, 1)

        def forward(self, x):
            up = nn.functional.interpolate
            return up(self.a(x), scale_factor=2.0), up(self.b(x), scale_factor=4.0), up(self.c(x), scale_factor=2.0)

    g = capture(Fuse().eval(), (torch.randn(1, 4, 4, 4),))
    a, b, c = (g.nodes[g.index[n]] for n in ("a", "b", "c"))
    assert not can_merge([a, b]) and can_merge([a, c])


def test_a_convolution_whose_unit_output_is_smaller_is_costed_on_a_simulated_gpu():
    from opsched.cost.simulate import SimulatedGPU

    class Shrink(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x)[:, :1, :1, :1]  # the unit's output: one value of the convolution's

    g = capture(Shrink().eval(), (torch.randn(1, 3, 16, 16),))
    assert SimulatedGPU(g, "sim:v100").op_latency(0) > 0


def test_a_capture_on_another_thread_silences_that_thread_alone(capsys):
    # it swapped sys.stderr, the process's one, for a buffer: while a plan was built in the background, every line
    # the user's own thread wrote there was lost (opsched's note of an autocast call it answered meanwhile among them)
    import sys
    import threading
    import warnings

    inside, release = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x):
            inside.set()
            release.wait(30)
            print("the tracer's noise", file=sys.stderr)
            warnings.warn("the tracer's warning")
            return x + 1

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        capturing = threading.Thread(target=capture, args=(Waits(), (torch.ones(2),)))
        capturing.start()
        assert inside.wait(60)
        print("the user's line", file=sys.stderr)
        warnings.warn("the user's warning")  # a process-wide filter dropped it too
        release.set()
        capturing.join(60)
    err = capsys.readouterr().err
    assert "the user's line" in err and "the tracer's noise" not in err, err
    assert [str(w.message) for w in seen] == ["the user's warning"]


class _Counts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.calls += 1
        return self.conv(x) + self.calls


class _WritesThroughAView(_Counts):
    def forward(self, x):
        self.seen[1:3] += x.mean()
        return self.conv(x)


class _WritesItsInput(_Counts):
    def forward(self, x):
        x.mul_(2)
        return self.conv(x)


class _CountsWithGrad(_Counts):
    def forward(self, x):
        with torch.enable_grad():  # a region of its own in the exported program
            self.calls.add_(1)
        return self.conv(x)


class _CountsByForeach(_Counts):
    def forward(self, x):
        torch._foreach_add_([self.calls, self.seen], 1)
        return self.conv(x)


class _WritesATensorAttribute(_Counts):
    def __init__(self):
        super().__init__()
        self.table = torch.zeros(3)  # neither a buffer nor a parameter

    def forward(self, x):
        self.table.add_(1)
        return self.conv(x)


@pytest.mark.parametrize("model, written", [
    (_Counts, "its forward writes buffer calls in place"), (_WritesThroughAView, "its forward writes buffer seen"),
    (_WritesItsInput, "its forward writes input x"), (_CountsWithGrad, "its forward writes buffer calls"),
    (_CountsByForeach, "its forward writes buffer calls, buffer seen"),
    (_WritesATensorAttribute, "cannot tell what its forward writes in place")])
def test_a_forward_that_writes_its_state_or_inputs_is_refused_in_one_line(model, written):
    # a plan runs on a copy of the model and its units at once: optimize failed on such a model with every
    # schedule "StaleWeights: calls changed (updated in place)", or "differs from the model's by 0.9 of its
    # magnitude" for an input written twice
    import opsched

    with pytest.raises(CaptureError, match=written) as refused:
        opsched.optimize(model().eval(), (torch.randn(1, 3, 8, 8),))
    assert "\n" not in str(refused.value)
