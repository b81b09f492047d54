"""Eager CPU units with their convolutions' weights reordered for oneDNN once, instead of on every call.

PyTorch's eager CPU convolution hands oneDNN a weight in PyTorch's own layout, and oneDNN reorders it into its
blocked layout on every call. Where the weight is large and the image small, the reorder is most of the
convolution. ONNX Runtime and Inductor (with ``freezing``) reorder weights once: most of their lead over
eager ResNets at small images is this. Measured on this 2-core machine (2 threads, a 3x3 convolution and its
ReLU, ms):

=====================================  =====  ==========================  ============================
channels, image, batch                 eager  reordered, NCHW input       reordered, ``channels_last``
=====================================  =====  ==========================  ============================
512 to 512, 4 x 4, 2                   2.97   1.23                        1.31
512 to 512, 7 x 7, 1                   3.62   2.00                        1.96
64 to 64, 56 x 56, 1                   2.02   1.79                        1.38
3 to 64 (7x7, stride 2), 224 x 224, 1  6.52   3.51 (7.90 made NCHW again)  2.56
=====================================  =====  ==========================  ============================

oneDNN's reordered convolution returns ``channels_last``, and making its output NCHW again costs more than the
convolution saves on large images (last row), so values stay ``channels_last`` from the first such
convolution on. :func:`packed_unit` gives a unit's callable that runs every 2-D float32 convolution whose
weight is the unit's own through ``mkldnn._convolution_pointwise`` with the weight reordered, its input
``channels_last`` (the ReLU that follows, when it alone reads the convolution, fused in as oneDNN's
post-op), and every view as a reshape (a view the captured graph made of a contiguous value may not exist of
a ``channels_last`` one; a reshape is that view wherever it exists). The same oneDNN convolution computes
the same sums in another order: outputs agree to float32's rounding, not bit for bit. A plan's outputs are
made contiguous again where the unit gave them ``channels_last`` (:func:`eager_layout`).

The reorder needs the input's shape, so the unit is rewritten at its first call, from the shapes of that
call. Each call then checks that the weights were not changed in place (their version counters) and
rewrites the unit again if they were. Where autograd records, the unit runs as it is (oneDNN's reordered
convolution has no backward).

>>> import torch
>>> from opsched.graph.capture import capture
>>> x = torch.randn(2, 8, 12, 12)
>>> unit = capture(torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU()), (x,)).nodes[0].run
>>> run = packed_unit(unit)
>>> with torch.inference_mode():
...     y = run(x)
>>> run.convolutions, y.is_contiguous(memory_format=torch.channels_last), torch.allclose(y, unit(x), atol=1e-5)
(1, True, True)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from opsched.graph.ops import get_attr_value

_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
_CONV2D = torch.ops.aten.conv2d.default
_CONVOLUTION = torch.ops.aten.convolution.default
_RELUS = {torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.relu, torch.nn.functional.relu}
_POINTWISE = torch.ops.mkldnn._convolution_pointwise.default if torch.backends.mkldnn.is_available() else None
_REORDER = torch.ops.mkldnn._reorder_convolution_weight.default if _POINTWISE is not None else None

_units: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one PackedUnit per unit: the reorder is paid once


class PackedUnit:
    """A unit's callable that, from its first call, runs the unit with its convolutions' weights reordered
    (see the module docstring). ``convolutions``: how many run reordered (0 before the first call, and
    where none can)."""

    def __init__(self, unit: fx.GraphModule):
        self._unit = weakref.ref(unit)  # not the unit itself: the table of PackedUnits would keep every unit alive
        self.convolutions = 0
        self.weights: list[tuple[torch.Tensor, int]] = []  # each reordered weight and its version then
        self.rewritten: Callable[..., Any] | None = None

    @property
    def unit(self) -> fx.GraphModule:
        return self._unit()

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled() and (any(p.requires_grad for p in self.unit.parameters())
                                        or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self.unit.forward(*args)  # mkldnn's reordered convolution has no backward
        rewritten = self.rewritten
        if rewritten is None or any(w._version != v for w, v in self.weights):
            rewritten = self._rewrite(args)
        return rewritten(*args)

    def _rewrite(self, args: tuple) -> Callable[..., Any]:
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.unit.graph, {}))
        views = [n for n in graph.nodes if n.op == "call_function" and n.target in _VIEWS]
        for view in views:
            view.target = torch.ops.aten.reshape.default
        module = fx.GraphModule(self.unit, graph, class_name="PackedUnit")
        # run on copies: a unit may write into its inputs, and the call this rewrite is for still has to run
        shapes = _TensorShapes(module)
        shapes.run(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        weights, self.convolutions = [], 0
        for conv in [n for n in graph.nodes if n.op == "call_function" and n.target in (_CONV2D, _CONVOLUTION)]:
            options = _convolution_options(conv, module, shapes.of)
            if options is None:
                continue
            x, weight, bias, padding, stride, dilation, groups = options
            packed_name = f"_packed_{self.convolutions}"
            with torch.no_grad():
                module.register_buffer(packed_name, _REORDER(weight, padding, stride, dilation, groups,
                                                      list(shapes.of[x][0])))
            relu = next(iter(conv.users)) if len(conv.users) == 1 else None
            fused = relu is not None and relu.op == "call_function" and relu.target in _RELUS \
                and len(relu.args) == 1 and not relu.kwargs
            last = relu if fused else conv
            with graph.inserting_after(last):
                packed = graph.get_attr(packed_name)
                with graph.inserting_after(packed):
                    x_cl = graph.call_method("contiguous", (x,), {"memory_format": torch.channels_last})
                    with graph.inserting_after(x_cl):
                        out = graph.call_function(_POINTWISE, (x_cl, packed, bias, padding, stride, dilation, groups,
                                                               "relu" if fused else "none", [], ""))
            last.replace_all_uses_with(out)
            graph.erase_node(last)
            if fused:
                graph.erase_node(conv)
            if not weight.is_inference():  # an inference tensor has no version counter and cannot change
                weights.append((weight, weight._version))
            self.convolutions += 1
        graph.lint()
        module.recompile()
        self.weights = weights
        self.rewritten = module.forward
        return self.rewritten


def packed_unit(unit: fx.GraphModule) -> PackedUnit:
    """The unit's callable with its convolutions' weights reordered once (see the module docstring); the
    same object for the same unit, so that every plan run on it shares one reorder."""
    if unit not in _units:
        _units[unit] = PackedUnit(unit)
    return _units[unit]


def packs(unit: Any) -> bool:
    """Whether :func:`packed_unit` may rewrite ``unit``: a GraphModule with a convolution or a view, its
    weights on the CPU, where oneDNN is."""
    if _POINTWISE is None or not isinstance(unit, fx.GraphModule):
        return False
    if not any(n.op == "call_function" and n.target in (_CONV2D, _CONVOLUTION, *_VIEWS) for n in unit.graph.nodes):
        return False
    return all(t.device.type == "cpu" for t in (*unit.parameters(), *unit.buffers()))


def eager_layout(outputs: list[Any]) -> list[Any]:
    """A plan's outputs as eager gives them: a 4-D tensor that reordered convolutions left ``channels_last``
    (and not also contiguous) made contiguous."""
    return [o.contiguous() if isinstance(o, torch.Tensor) and o.dim() == 4 and not o.is_contiguous()
            and o.is_contiguous(memory_format=torch.channels_last) else o for o in outputs]


class _TensorShapes(fx.Interpreter):
    """Runs a unit and keeps each tensor value's shape and dtype in ``of`` (by node). Not torch.fx's ShapeProp:
    inside a torch.compile backend, that finds dynamo's fake mode and makes the values symbolic."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.of: dict[fx.Node, tuple[torch.Size, torch.dtype]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.of[n] = (result.shape, result.dtype)
        return result


def _convolution_options(conv: fx.Node, module: fx.GraphModule,
                         shapes: dict[fx.Node, tuple[torch.Size, torch.dtype]]) -> tuple | None:
    """The convolution's input node, weight tensor, bias node and options, where oneDNN can take it
    reordered: a 2-D, not transposed float32 convolution of a CPU input, with a weight the unit holds."""
    if conv.target is _CONVOLUTION:
        x, w, bias, stride, padding, dilation, transposed, output_padding, groups = conv.args
        if transposed or any(output_padding):
            return None
    else:
        x, w, bias, stride, padding, dilation, groups = (*conv.args, *(None, [1], [0], [1], 1)[len(conv.args) - 2:])
    if conv.kwargs or not isinstance(w, fx.Node) or w.op != "get_attr" or not isinstance(x, fx.Node):
        return None
    if bias is not None and (not isinstance(bias, fx.Node) or bias.op != "get_attr"):
        return None
    shape, dtype = shapes.get(x, ((), None))
    weight = get_attr_value(w, module)
    if (len(shape) != 4 or dtype != torch.float32 or not isinstance(weight, torch.Tensor)
            or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 4
            or any(not isinstance(v, int) for v in (*stride, *padding, *dilation, groups))):
        return None
    pair = (lambda v: list(v) * 2 if len(v) == 1 else list(v))
    return x, weight, bias, pair(padding), pair(stride), pair(dilation), groups

