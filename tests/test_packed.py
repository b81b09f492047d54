"""Eager CPU units with reordered convolution weights (opsched.runtime.packed): the same values as the model, in
its layout, to float32's own noise, whatever the convolutions and whatever reads their outputs."""

import copy
import gc
import operator
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.runtime import packed
from opsched.runtime.module import OptimizedModule
from opsched.schedulers import make_schedule

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def sequential_plan(model, *inputs):
    graph = capture(model.eval(), inputs)
    for n in graph.nodes:
        n.latency = 1.0
    return graph, OptimizedModule(graph, make_schedule("sequential", graph, TableCost(graph)), 2)


def float64_noise(model, inputs, got):
    """How far ``got`` and the model's own float32 outputs are from the model's float64 outputs (the largest
    difference over every output), and the float64 outputs' largest magnitude."""
    flat = (lambda out: torch.cat([t.flatten() for t in (out if isinstance(out, tuple) else (out,))]))
    with torch.no_grad():
        exact = flat(copy.deepcopy(model).double()(*(x.double() for x in inputs))).float()
        own = flat(model(*inputs))
    got = flat(got)
    return (got - exact).abs().max().item(), (own - exact).abs().max().item(), exact.abs().max().item()


class ConvNet(torch.nn.Module):
    """Convolutions of every kind the rewrite takes (grouped, strided, dilated, 1x1, no bias, depthwise), each
    read by a ReLU, a residual add, a pooling or a view."""

    def __init__(self, groups, stride, dilation, bias, width):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, width, 3, stride=stride, padding=1, bias=bias)
        self.grouped = torch.nn.Conv2d(width, width, 3, padding=dilation, dilation=dilation, groups=groups)
        self.depthwise = torch.nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.point = torch.nn.Conv2d(width, 2 * width, 1)
        self.head = torch.nn.Linear(2 * width * 4, 5)

    def forward(self, x):
        y = self.stem(x).relu()
        y = y + self.grouped(y)
        y = torch.nn.functional.max_pool2d(self.depthwise(y).relu(), 2)
        y = torch.nn.functional.adaptive_avg_pool2d(self.point(y), 2)
        return self.head(y.view(y.shape[0], -1)), y


@settings(max_examples=25, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), stride=st.sampled_from([1, 2]), dilation=st.sampled_from([1, 2]),
       bias=st.booleans(), batch=st.sampled_from([1, 3]), size=st.sampled_from([8, 13]), seed=st.integers(0, 99))
def test_a_plan_with_reordered_convolutions_agrees_with_the_model_to_float32_noise(groups, stride, dilation, bias,
                                                                                   batch, size, seed):
    torch.manual_seed(seed)
    model = ConvNet(groups, stride, dilation, bias, width=8)
    x = torch.randn(batch, 3, size, size)
    graph, plan = sequential_plan(model, x)
    outputs = plan(x)
    assert outputs[1].is_contiguous()  # the model's layout, although the convolutions left it channels_last
    assert any(packed.packed_unit(n.run).convolutions for n in graph.nodes if packed.packs(n.run))
    ours, own, scale = float64_noise(model, [x], outputs)
    # float32's noise on these sums, measured: the model's own float32 error against float64; the reordered
    # convolutions sum in another order, so allow a few times it (and a floor for when the model's is 0)
    assert ours <= 8 * own + 1e-6 * scale


def test_a_view_of_a_convolution_output_runs_on_the_channels_last_value():
    """A patch embedding (ViT): the captured graph views the convolution's output as contiguous."""

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Conv2d(3, 16, 4, stride=4)

        def forward(self, x):
            y = self.proj(x)
            return y.view(y.shape[0], 16, -1).transpose(1, 2)

    model = Patches()
    x = torch.randn(2, 3, 16, 16)
    _, plan = sequential_plan(model, x)
    with torch.no_grad():
        torch.testing.assert_close(plan(x), model.eval()(x), rtol=1e-4, atol=1e-5)


def test_weights_changed_in_place_are_reordered_again():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 9, 9)
    _, plan = sequential_plan(model, x)
    before = plan(x)
    with torch.no_grad():
        model[0].weight.mul_(-1)  # the unit holds the model's own weight
        torch.testing.assert_close(plan(x), model(x), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(before, plan(x))


def test_where_autograd_records_the_unit_runs_as_it_is():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(1, 3, 9, 9, requires_grad=True)
    unit = capture(model.eval(), (x.detach(),)).nodes[0].run
    run = packed.packed_unit(unit)
    run(x).sum().backward()  # no backward through oneDNN's reordered convolution: it was not used
    assert x.grad is not None and run.convolutions == 0


def test_units_off_the_cpu_and_units_without_convolutions_are_not_rewritten():
    x = torch.randn(1, 3, 8, 8)
    conv = capture(torch.nn.Conv2d(3, 4, 3).eval(), (x,)).nodes[0].run
    assert packed.packs(conv)
    assert not packed.packs(conv.to("meta"))
    assert not packed.packs(capture(torch.nn.ReLU(), (x,)).nodes[0].run)


def test_a_rewritten_unit_does_not_outlive_its_graph():
    x = torch.randn(1, 3, 8, 8)
    unit = capture(torch.nn.Conv2d(3, 4, 3).eval(), (x,)).nodes[0].run
    with torch.inference_mode():
        packed.packed_unit(unit)(x)
    gone = weakref.ref(unit)
    del unit
    gc.collect()
    assert gone() is None


def test_outputs_have_the_models_strides_whatever_reads_the_channels_last_values():
    """Views the reordered convolution's channels_last output cannot take as they are (view_as, a flatten),
    and outputs that are views of it (a slice, a transpose), are the model's in values and in strides."""

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)

        def forward(self, x, like):
            y = self.conv(x).relu()
            return (y + 1).view_as(like), y.flatten(2), y[:, :4], y.transpose(2, 3)

    model = Views().eval()
    x, like = torch.randn(2, 3, 10, 10), torch.randn(2, 512)
    graph, plan = sequential_plan(model, x, like)
    assert any(packed.packs(n.run) for n in graph.nodes)
    with torch.no_grad():
        for got, want in zip(plan(x, like), model(x, like)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert got.stride() == want.stride()


def test_weights_replaced_or_retyped_are_seen():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 9, 9)
    _, plan = sequential_plan(model, x)
    plan(x)
    model[0].weight.data = torch.randn_like(model[0].weight)  # other storage, no in-place write
    with torch.no_grad():
        torch.testing.assert_close(plan(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_convolution_onednn_cannot_run_reordered_runs_as_captured(monkeypatch):
    x = torch.randn(1, 3, 8, 8)
    unit = capture(torch.nn.Conv2d(3, 4, 3).eval(), (x,)).nodes[0].run

    def unsupported(*args):
        raise RuntimeError("no oneDNN kernel for this")

    monkeypatch.setattr(packed, "_POINTWISE", unsupported)
    run = packed.packed_unit(unit)
    with torch.inference_mode():
        torch.testing.assert_close(run(x), unit(x))
    assert run.convolutions == 0


class Addressing(torch.nn.Module):
    """Operators that read memory through strides and offsets, on views of a convolution's output: what they
    read must be the model's, not the channels_last layout's."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, (3, 2))

    def forward(self, x):
        y = self.conv(x)                                                   # 1 x 4 x 4 x 2
        transposed = y.transpose(2, 3).as_strided((1, 2, 2, 2), (32, 8, 2, 1))
        offset = y[:, 1:].as_strided((1, 2, 2, 2), (32, 8, 2, 1), 10)     # an offset into the whole storage
        return transposed, offset, torch.view_as_complex(y).abs(), y.view(torch.int16), y + 1


def assert_packed_plan_agrees(model, x):
    """The model's packed sequential plan gives the model's outputs (integer views of float32 bits compared as
    the floats they are)."""
    graph, plan = sequential_plan(model.eval(), x)
    assert packed.packs_graph(graph)
    with torch.no_grad():
        for got, want in zip(plan(x), model(x)):
            if want.dtype == torch.int16:
                got, want = got.view(torch.float32), want.view(torch.float32)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_operators_that_address_memory_read_the_models_layout():
    assert_packed_plan_agrees(Addressing(), torch.randn(1, 3, 6, 3))


def test_an_expanded_output_keeps_the_plans_strides():
    class Expand(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x).expand(2, -1, -1, -1)

    model = Expand().eval()
    x = torch.randn(1, 3, 6, 6)
    _, plan = sequential_plan(model, x)
    with torch.no_grad():
        torch.testing.assert_close(plan(x), model(x), rtol=1e-4, atol=1e-5)


def unit_addressing(example: torch.Tensor) -> torch.fx.GraphModule:
    """A unit without a convolution that addresses its input's memory, the input's value at capture being ``example``."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    value.meta["val"] = example
    addressed = graph.call_function(torch.ops.aten.as_strided.default, (value, (2, 2), (2, 1), 1))
    graph.output(addressed)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_whose_units_address_memory_they_cannot_lay_out_is_not_packed():
    """A unit addressing a value that was a view of another unit's value at capture cannot make that value's
    memory again: no unit of its graph packs, so no value reaches it channels_last."""
    from opsched.graph.ir import Graph, Node

    conv = capture(torch.nn.Conv2d(3, 4, 3).eval(), (torch.randn(1, 3, 8, 8),)).nodes[0].run
    owned, viewed = unit_addressing(torch.randn(3, 3)), unit_addressing(torch.randn(4, 3)[1:])
    assert packed.packs(owned) and not packed.packs(viewed)

    def graph(addressing):
        return Graph([Node("c", args=("x",), run=conv), Node("a", args=("c",), run=addressing)], inputs=["x"],
                     outputs=["a"])

    assert packed.packs_graph(graph(owned)) and not packed.packs_graph(graph(viewed))
    assert not packed.packs_graph(graph(owned), examples=False)  # pickled units lose the examples
    assert not packed.packs_graph(graph(lambda v: v))  # a unit of Python code the rewrite cannot read


def test_a_unit_reading_a_list_of_tensors_that_need_gradients_runs_as_captured():
    x = torch.randn(1, 3, 8, 8)
    graph = torch.fx.Graph()
    values = graph.placeholder("xs")
    weight = graph.get_attr("weight")
    graph.output(graph.call_function(torch.ops.aten.conv2d.default,
                                     (graph.call_function(operator.getitem, (values, 0)), weight)))
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3), requires_grad=False)
    unit = torch.fx.GraphModule(holder, graph)
    run = packed.packed_unit(unit)
    leaf = x.clone().requires_grad_()
    run([leaf]).sum().backward()
    assert leaf.grad is not None and run.convolutions == 0


class AddressingChained(torch.nn.Module):
    """Addressing operators reading each other's outputs and one value twice, in one unit."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)                                                   # 1 x 4 x 4 x 4
        chained = torch.view_as_complex(y.as_strided((1, 4, 4, 2), (64, 16, 4, 1)))
        twice = torch.cat([y.as_strided((1, 2, 2, 2), (64, 16, 4, 1)), y.as_strided((1, 2, 2, 2), (64, 8, 4, 2), 3)])
        scattered = torch.as_strided_scatter(y, torch.ones(1, 2, 2, 2), (1, 2, 2, 2), (64, 8, 4, 2), 3)
        return chained.abs(), twice, scattered


def test_addressing_operators_reading_each_other_or_one_value_twice():
    assert_packed_plan_agrees(AddressingChained(), torch.randn(1, 3, 6, 6))


def test_a_model_batchs_member_selection_keeps_the_graph_packed():
    """The unit that takes one model's output from a batched unit calls ``contiguous`` as a method."""
    from opsched.graph.ir import Graph, Node
    from opsched.multi.stack import _select_module

    conv = capture(torch.nn.Conv2d(3, 4, 3).eval(), (torch.randn(1, 3, 8, 8),)).nodes[0].run
    graph = Graph([Node("c", args=("x",), run=conv), Node("s", args=("c",), run=_select_module(0))], inputs=["x"],
                  outputs=["s"])
    assert packed.packs_graph(graph)
