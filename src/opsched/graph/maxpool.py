"""Max pooling as the maximum of strided slices, where that is faster than PyTorch's CPU kernel.

PyTorch's max pooling for contiguous (NCHW) tensors on the CPU is a scalar loop; on this 2-core machine it
took 0.81 ms for a 2x2 pool over 16 x 16 x 32 x 32 values, while the element-wise maximum of the four
strided slices took 0.16 ms (vectorised, one pass each), and 0.05 ms taken one axis at a time: the maximum
of the window's rows first, whose slices are whole contiguous rows, then of its columns on fewer values.
The slices lose below a size: measured ratios (PyTorch's kernel / slices) were 0.95 at 8k values and 1.30
at 16k for a 2x2 window, 0.79 at 16k and 1.36 at 32k for 3x3 with padding, so a pool is rewritten only from
:data:`MIN_VALUES_PER_WINDOW_ELEMENT` values per element
of its window. The result is the same in every bit: a maximum of the same values, NaN propagating as in the
kernel, padding as minus infinity. :func:`plain_max_pools` first drops the indices that tracing adds and
nobody reads.

>>> import torch
>>> x = torch.randn(8, 16, 32, 32)
>>> torch.equal(max_pool2d_by_slices(x, [3, 3], [2, 2], [1, 1]),
...             torch.ops.aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1]))
True
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import fx

MIN_VALUES_PER_WINDOW_ELEMENT = 4096
_MAX_WINDOW = 9  # a 3x3 window: each element of the window is one more pass over the output


def max_pool2d_by_slices(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                         padding: Sequence[int] | int = 0, ceil_mode: bool = False) -> torch.Tensor:
    """``aten.max_pool2d(x, kernel_size, stride, padding, 1, ceil_mode)`` as the maximum of ``kh * kw``
    strided slices of ``x``."""
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    oh = _output_size(x.shape[-2], kh, sh, ph, ceil_mode)
    ow = _output_size(x.shape[-1], kw, sw, pw, ceil_mode)
    # minus infinity around x: the padding, and in ceil mode the part of the last window past the end
    bottom = max(0, (oh - 1) * sh + kh - x.shape[-2] - ph)
    right = max(0, (ow - 1) * sw + kw - x.shape[-1] - pw)
    if ph or pw or bottom or right:
        x = F.pad(x, (pw, right, ph, bottom), value=float("-inf"))
    # The window's maximum taken one axis at a time: first over its rows, whose slices are whole rows of x
    # (contiguous, so each pass is vectorised), then over its columns on the kh-fold smaller result.
    rows = None
    for i in range(kh):
        window = x[..., i:i + sh * (oh - 1) + 1:sh, :]
        rows = window if rows is None else torch.maximum(rows, window)
    out = None
    for j in range(kw):
        window = rows[..., j:j + sw * (ow - 1) + 1:sw]
        out = window if out is None else torch.maximum(out, window)
    # with one column the result is a slice, a view: the kernel's output is a contiguous tensor of its own
    return out.clone(memory_format=torch.contiguous_format) if kw == 1 else out


def _output_size(size: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """PyTorch's pooling output size: in ceil mode, a last window that starts in the right padding is
    dropped."""
    span = size + 2 * padding - kernel
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pair(value: Sequence[int] | int) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    value = tuple(value)
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


def plain_max_pools(graph: fx.Graph) -> None:
    """Rewrite, in place, max pooling whose indices nobody reads as plain max pooling: tracing (``make_fx``,
    vmap's batching rule) writes every max pooling with its indices, and computing them is slower."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.target is not aten.max_pool2d_with_indices.default:
            continue
        users = list(node.users)
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in users if u.users):
            continue
        with graph.inserting_before(node):
            plain = graph.call_function(aten.max_pool2d.default, node.args, node.kwargs)
        for u in users:
            if u.args[1] == 0:
                u.replace_all_uses_with(plain)
            graph.erase_node(u)
        graph.erase_node(node)


def max_pools_by_slices(graph: fx.Graph) -> int:
    """Rewrite, in place, each ``aten.max_pool2d`` of ``graph`` that pays (see the module's note) as
    :func:`max_pool2d_by_slices`; return how many were rewritten. The input's shape is read from its node's
    ``meta["val"]``, which ``make_fx`` and ``torch.export`` record."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.max_pool2d.default or not _pays(node):
            continue
        x, kernel_size, stride, padding, _dilation, ceil_mode = _max_pool_args(node)
        with graph.inserting_before(node):
            slices = graph.call_function(max_pool2d_by_slices, (x, kernel_size, stride, padding, ceil_mode))
        slices.meta = dict(node.meta)
        node.replace_all_uses_with(slices)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def max_pools_by_kernel(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters) whose :func:`max_pool2d_by_slices` are ``aten.max_pool2d``
    again: for a runtime with a fast pooling kernel of its own (ONNX Runtime's MaxPool), where the slices
    would be as many separate passes."""
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.target is max_pool2d_by_slices:
            x, kernel_size, stride, padding, ceil_mode = (list(node.args) + [0, False])[:5]
            with graph.inserting_before(node):
                pool = graph.call_function(torch.ops.aten.max_pool2d.default,
                                           (x, kernel_size, stride, padding, [1, 1], ceil_mode))
            pool.meta = dict(node.meta)
            node.replace_all_uses_with(pool)
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def _max_pool_args(node: fx.Node) -> list:
    """``x, kernel_size, stride, padding, dilation, ceil_mode`` of an ``aten.max_pool2d`` node."""
    names = ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"]
    values = {"stride": (), "padding": 0, "dilation": 1, "ceil_mode": False, **dict(zip(names, node.args)),
              **node.kwargs}
    return [values[name] for name in names]


def _pays(node: fx.Node) -> bool:
    x, kernel_size, _stride, _padding, dilation, _ceil_mode = _max_pool_args(node)
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    if set(_pair(dilation)) != {1}:
        return False
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point or value.dim() not in (3, 4):
        return False
    kh, kw = _pair(kernel_size)
    window = kh * kw
    size = value.numel()
    if not isinstance(size, int):  # a symbolic shape: the choice would depend on the input
        return False
    return 2 <= window <= _MAX_WINDOW and size >= MIN_VALUES_PER_WINDOW_ELEMENT * window
