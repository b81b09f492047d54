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
post-op), and every view that changes the shape as a reshape (a view the captured graph made of a contiguous
value may not exist of a ``channels_last`` one; a reshape is that view wherever it exists). Operators that
address memory through strides and offsets (``as_strided`` and its copy and scatter, a view as another dtype,
``view_as_complex``) read the value they address laid out as it was at capture: the value itself, or the one
it views within the unit, copied into capture's layout where it is not in it. Units without a convolution are rewritten so too where
they hold such operators; where such a value did not own its storage at capture (a view of another unit's
value), no unit of the graph is rewritten (:func:`packs_graph`). The same oneDNN convolution computes the
same sums in another order: outputs agree to float32's rounding, not bit for bit. A plan's outputs are given
the model's own strides again (:func:`eager_layout`), except outputs whose elements overlap (an ``expand``).

The reorder needs the input's shape, so the unit is rewritten at its first call, from the shapes of that
call (other shapes still compute right, reordering again inside oneDNN). Each call then checks that the
weights were not changed (their version counters, storage, type and shape; a write through ``.data`` in
place is not seen) and rewrites the unit again if they were. Where autograd records or autocast is on, the
unit runs as it is (oneDNN's reordered convolution has no backward and ignores autocast); the executors run
units in inference mode.

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

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from opsched.graph.ops import get_attr_value

_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}  # reshape takes their arguments
_VIEW_AS = torch.ops.aten.view_as.default
# operators that read their input's memory through its strides and offset, not only its values: they read the
# value they address laid out as it was at capture (see _addressed_value)
_ADDRESSING = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_copy.default,
               torch.ops.aten.as_strided_scatter.default, torch.ops.aten._reshape_alias.default,
               torch.ops.aten.view.dtype, torch.ops.aten.view_as_complex.default}
LAYOUT_BOUND = {*_RESHAPES, _VIEW_AS, *_ADDRESSING}  # what reads a value's strides, not only its values
_CONV2D = torch.ops.aten.conv2d.default
_CONVOLUTION = torch.ops.aten.convolution.default
_RELUS = {torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.relu, torch.nn.functional.relu}
_POINTWISE = torch.ops.mkldnn._convolution_pointwise.default if torch.backends.mkldnn.is_available() else None
_REORDER = torch.ops.mkldnn._reorder_convolution_weight.default if _POINTWISE is not None else None

_units: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one PackedUnit per unit: the reorder is paid once
_units_lock = threading.Lock()


class PackedUnit:
    """A unit's callable that, from its first call, runs the unit with its convolutions' weights reordered
    (see the module docstring). ``convolutions``: how many run reordered (0 before the first call, and
    where none can)."""

    def __init__(self, unit: fx.GraphModule):
        self._unit = weakref.ref(unit)  # not the unit itself: the table of PackedUnits would keep every unit alive
        self._lock = threading.Lock()
        # the rewritten unit, what each reordered weight was then, and how many convolutions it reorders: one
        # tuple, replaced whole, so that a stream never runs one rewrite checked against another's weights
        self._state: tuple[Callable[..., Any], list[tuple], int] | None = None

    @property
    def unit(self) -> fx.GraphModule:
        return self._unit()

    @property
    def convolutions(self) -> int:
        return self._state[2] if self._state is not None else 0

    def __call__(self, *args: Any) -> Any:
        if (torch.is_grad_enabled() and (any(p.requires_grad for p in self.unit.parameters()) or any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves(args)))) \
                or torch.is_autocast_enabled("cpu"):
            return self.unit.forward(*args)  # oneDNN's reordered convolution has no backward and ignores autocast
        state = self._state
        if state is None or any(_changed(*w) for w in state[1]):
            with self._lock:
                state = self._state
                if state is None or any(_changed(*w) for w in state[1]):
                    state = self._state = self._rewrite(args)
        return state[0](*args)

    def _rewrite(self, args: tuple) -> tuple[Callable[..., Any], list[tuple], int]:
        module, weights = self._rewritten(args, convolutions=True)
        if weights:
            try:  # once, on copies: a oneDNN build that lacks a kernel for this convolution fails here, not later
                module(*_copies(args))
            except RuntimeError:
                module, weights = self._rewritten(args, convolutions=False)
        return module.forward, weights, len(weights)

    def _rewritten(self, args: tuple, convolutions: bool) -> tuple[fx.GraphModule, list[tuple]]:
        """The unit rewritten for ``channels_last`` values (views as reshapes, addressed values laid out as
        at capture) and, with ``convolutions``, its convolutions reordered for the shapes of ``args``; and
        what each reordered weight was then."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.unit.graph, {}))
        # every addressed value found on the graph as captured, before any rewrite changes what views what
        addressed = {node: _addressed_value(node) for node in graph.nodes
                     if node.op == "call_function" and node.target in _ADDRESSING}
        if None in addressed.values():
            raise ValueError("the unit addresses a value that did not own its storage at capture: see packs()")
        for value in dict.fromkeys(addressed.values()):
            with graph.inserting_after(value):
                laid = graph.call_function(laid_out, (value, capture_order(value)))
            value.replace_all_uses_with(laid, delete_user_cb=lambda user, laid=laid: user is not laid)
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in (*_RESHAPES, _VIEW_AS)]:
            if node.target is _VIEW_AS:
                node.op, node.target = "call_method", "reshape_as"
            else:
                node.target = torch.ops.aten.reshape.default
        module = fx.GraphModule(self.unit, graph, class_name="PackedUnit")
        weights: list[tuple] = []
        if not convolutions:
            module.recompile()
            return module, weights
        # run on copies: a unit may write into its inputs, and the call this rewrite is for still has to run
        shapes = _TensorShapes(module)
        shapes.run(*_copies(args))
        for conv in [n for n in graph.nodes if n.op == "call_function" and n.target in (_CONV2D, _CONVOLUTION)]:
            options = _convolution_options(conv, module, shapes.of)
            if options is None:
                continue
            x, weight, bias, padding, stride, dilation, groups = options
            packed_name = f"_packed_{len(weights)}"
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
            if bias is not None:  # oneDNN reads the bias as dense memory: a strided view of one would be misread
                with graph.inserting_after(x_cl):
                    bias = graph.call_method("contiguous", (bias,))
            with graph.inserting_after(bias if bias is not None else x_cl):
                out = graph.call_function(_POINTWISE, (x_cl, packed, bias, padding, stride, dilation, groups,
                                                       "relu" if fused else "none", [], ""))
            last.replace_all_uses_with(out)
            graph.erase_node(last)
            if fused:
                graph.erase_node(conv)
            # an inference tensor has no version counter: its storage, type and shape are checked still
            weights.append((weight, None if weight.is_inference() else weight._version, weight.data_ptr(),
                            weight.dtype, weight.shape))
        graph.lint()
        module.recompile()
        return module, weights


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _owns_storage(value: Any) -> bool:
    """Whether ``value`` (a tensor, or a node's example of one) is dense, with its storage to itself from its
    start: its memory is then fixed by its shape and the order of its strides."""
    return (isinstance(value, torch.Tensor) and all(isinstance(v, int) for v in (*value.shape, *value.stride()))
            and value.storage_offset() == 0 and _dense(value)
            and value.untyped_storage().nbytes() == value.numel() * value.element_size())


def _addressed_value(node: fx.Node) -> fx.Node | None:
    """The value whose memory the addressing operator ``node`` reads: its input, or what that input views
    within the unit, back to the first value that owned its storage at capture; None where none did. Laid
    out as at capture, that value makes every view of it, and so what ``node`` reads, what it was then."""
    value = node.args[0]
    while isinstance(value, fx.Node):
        if _owns_storage(value.meta.get("val")):
            return value
        schema = getattr(value.target, "_schema", None) if value.op == "call_function" else None
        views = value.target is operator.getitem or (
            schema is not None and bool(schema.arguments) and schema.arguments[0].alias_info is not None
            and bool(schema.returns) and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)
        if not views:
            return None
        value = value.args[0]
    return None


def capture_order(node: fx.Node) -> tuple[int, ...]:
    """The order of ``node``'s dimensions in memory as captured (outermost first): what :func:`laid_out`
    takes."""
    return _dim_order(node.meta["val"])


def laid_out(value: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``value`` dense in its own storage with its dimensions in ``order`` (outermost first), as capture laid
    it out; copied only where it is not so already."""
    if _owns_storage(value) and [d for d in _dim_order(value) if value.shape[d] != 1] == [
            d for d in order if value.shape[d] != 1]:  # dimensions of size 1 may sit anywhere
        return value
    return torch.empty_permuted(value.shape, order, dtype=value.dtype, device=value.device).copy_(value)


def _dense(value: torch.Tensor, gaps: bool = False) -> bool:
    """Whether the tensor's elements fill a block of memory once each: its strides, innermost first, are the
    products of the sizes inside them (dimensions of size 1 do not count). With ``gaps``, whether no two
    elements share memory: each stride at least that product."""
    step = 1
    for d in reversed(_dim_order(value)):
        if value.shape[d] != 1:
            if value.stride()[d] < step or (value.stride()[d] != step and not gaps):
                return False
            step = value.stride()[d] * value.shape[d]
    return True


def _dim_order(value: torch.Tensor) -> tuple[int, ...]:
    """The tensor's dimensions from outermost (largest stride) to innermost in memory."""
    stride = value.stride()
    return tuple(sorted(range(value.dim()), key=lambda d: -stride[d]))


def _changed(weight: torch.Tensor, version: int | None, data: int, dtype: torch.dtype, shape: torch.Size) -> bool:
    """Whether a reordered weight was changed since: written in place (its version counter), or given other
    storage, type or shape (``module.double()``, ``p.data = ...``). A write through ``p.data`` in place
    changes none of these, and is not seen."""
    return ((version is not None and weight._version != version) or weight.data_ptr() != data
            or weight.dtype != dtype or weight.shape != shape)


def packed_unit(unit: fx.GraphModule) -> PackedUnit:
    """The unit's callable with its convolutions' weights reordered once (see the module docstring); the
    same object for the same unit, so that every plan run on it shares one reorder."""
    with _units_lock:  # executors may be made on several threads
        if unit not in _units:
            _units[unit] = PackedUnit(unit)
        return _units[unit]


def packs(unit: Any) -> bool:
    """Whether :func:`packed_unit` may rewrite ``unit``: a GraphModule with a convolution or an operator
    bound to a layout (a view), its weights on the CPU, where oneDNN is, and every value it addresses
    (``as_strided``, a view as another dtype) one it can lay out as at capture."""
    if _POINTWISE is None or not isinstance(unit, fx.GraphModule):
        return False
    if not any(n.op == "call_function" and n.target in (_CONV2D, _CONVOLUTION, *LAYOUT_BOUND)
               for n in unit.graph.nodes):
        return False
    return _restorable(unit) and all(t.device.type == "cpu" for t in (*unit.parameters(), *unit.buffers()))


def packs_graph(graph: Any, examples: bool = True) -> bool:
    """Whether the eager units of ``graph`` (a :class:`~opsched.graph.ir.Graph`) may run through
    :func:`packed_unit` (what :func:`opsched.runtime.choice.choose_kernels` asks): some unit packs, and every unit is a GraphModule of operators the rewrite knows to
    read a ``channels_last`` value right, whose addressed values it can lay out as at capture. Values
    leave a packed unit ``channels_last``: one unit that could not read them so keeps the whole graph as
    captured. Without ``examples`` (units pickled for another process lose the example values capture
    recorded), a graph holding an operator that addresses memory is kept as captured."""
    runs = [n.run for n in graph.nodes]
    return any(packs(run) for run in runs) and all(
        isinstance(run, fx.GraphModule) and _restorable(run, examples) and all(map(_reads_any_layout, run.graph.nodes))
        for run in runs)


# Tensor methods that compute the same values whatever their input's strides (the model batch's units call them)
_ANY_LAYOUT_METHODS = frozenset({"contiguous", "reshape", "reshape_as", "flatten", "unflatten", "transpose",
                                 "permute", "unsqueeze", "squeeze", "expand", "expand_as", "repeat", "size", "relu",
                                 "relu_", "add_", "clone", "select", "narrow", "chunk", "split"})


def _reads_any_layout(node: fx.Node) -> bool:
    """Whether the rewrite knows that ``node`` computes the same from a ``channels_last`` value: ATen
    operators (the rewrite handles the views among them), Python functions other than views, the methods
    above; not modules, whose code it does not see."""
    if node.op == "call_method":
        return node.target in _ANY_LAYOUT_METHODS
    if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
        return getattr(node.target, "__name__", "") not in ("view", "view_as", "as_strided", "view_as_complex")
    return node.op in ("placeholder", "get_attr", "call_function", "output")


def _restorable(unit: fx.GraphModule, examples: bool = True) -> bool:
    return all(examples and _addressed_value(n) is not None for n in unit.graph.nodes
               if n.op == "call_function" and n.target in _ADDRESSING)


def eager_strides(graph: Any) -> list[tuple | None]:
    """For each output of ``graph`` (a :class:`~opsched.graph.ir.Graph`), the shape and strides the model gave
    it at capture, and whether that was contiguous; None where capture did not record them (or recorded them
    symbolic)."""
    strides: list[tuple | None] = []
    for name in graph.outputs:
        run = graph.nodes[graph.index[name]].run if name in graph.index else None
        value = run.graph.output_node().args[0] if isinstance(run, fx.GraphModule) else None
        example = value.meta.get("val") if isinstance(value, fx.Node) else None
        # an expanded or overlapping output cannot be copied into: it keeps the strides the plan gave it
        known = isinstance(example, torch.Tensor) and all(isinstance(v, int) for v in (*example.shape,
                                                                                      *example.stride())) \
            and _dense(example, gaps=True)
        strides.append((example.shape, example.stride(), example.is_contiguous()) if known else None)
    return strides


def eager_layout(outputs: list[Any], strides: list[tuple | None]) -> list[Any]:
    """A plan's outputs laid out as eager gives them (``strides`` from :func:`eager_strides`): values that
    ``channels_last`` convolutions left with other strides, copied into the model's own; at another shape than
    capture's, made contiguous where the model's were."""
    laid = []
    for out, eager in zip(outputs, strides):
        if eager is not None and isinstance(out, torch.Tensor) and out.stride() != eager[1]:
            if out.shape == eager[0]:
                out = torch.empty_strided(out.shape, eager[1], dtype=out.dtype, device=out.device).copy_(out)
            elif eager[2]:
                out = out.contiguous()
        laid.append(out)
    return laid


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

