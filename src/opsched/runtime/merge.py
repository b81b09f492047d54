"""Operator merge (IOS): convolutions that read the same input run as one convolution.

Each unit's batch norm is folded into its convolution first; the kernels are zero-padded and centred to the
largest, stacked along the output channels with their biases, and the merged convolution pads by what the
largest kernel needs. The shared leading operators (say a ReLU) run once, the common activation runs on
the stacked output, and the output is split back into one tensor per unit: the same values as the units
run one by one, up to floating-point rounding of the folded batch norm.

The merged weights are computed from the model's parameters when the operator is built.

>>> import torch
>>> from opsched.graph.capture import capture
>>> class TwoBranches(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b = torch.nn.Conv2d(4, 3, 1), torch.nn.Conv2d(4, 5, 3, padding=1)
...     def forward(self, x):
...         return self.a(x).relu(), self.b(x).relu()
>>> x = torch.randn(1, 4, 8, 8)
>>> g = capture(TwoBranches().eval(), (x,))
>>> merged = merged_operator([g.nodes[0], g.nodes[1]])
>>> a, b = merged(x)
>>> torch.allclose(a, g.nodes[0].run(x), atol=1e-6), torch.allclose(b, g.nodes[1].run(x), atol=1e-6)
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from opsched.errors import OpschedError
from opsched.graph.fold import folded_conv, inference_batch_norm
from opsched.graph.ir import Node, can_merge
from opsched.graph.ops import get_attr_value
from opsched.runtime.packed import LAYOUT_BOUND, capture_order, laid_out, packed_unit

_BATCH_NORMS = {"batch_norm", "_native_batch_norm_legit_no_training"}


class MergeError(OpschedError):
    """Units that cannot be merged into one operator."""


@dataclass
class _Conv:
    """One unit taken apart: what feeds its convolution, the folded weight and bias, and what follows."""

    prefix: fx.GraphModule     # the unit's inputs -> the convolution's input
    weight: torch.Tensor
    bias: torch.Tensor
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    tail: list[fx.Node]        # element-wise operators after the (folded) batch norm, in order


def merged_operator(nodes: Sequence[Node]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One callable running the convolution units ``nodes`` as a single convolution; called with the
    inputs of the first unit (all read the same), it returns one output per unit, in order."""
    if not can_merge(nodes):
        raise MergeError(f"units {', '.join(n.name for n in nodes)} cannot be merged")
    parts = [_take_apart(n) for n in nodes]
    dims = len(parts[0].weight.shape) - 2
    largest = [max(p.weight.shape[2 + d] for p in parts) for d in range(dims)]
    weights = []
    for p in parts:
        pad: list[int] = []
        for d in reversed(range(dims)):  # F.pad takes the last dimension first
            extra = largest[d] - p.weight.shape[2 + d]
            pad += [extra // 2, extra // 2]
        weights.append(F.pad(p.weight, pad))
    first = parts[0]
    weight = torch.cat(weights).contiguous()
    bias = torch.cat([p.bias for p in parts])
    padding = tuple(first.padding[d] + (largest[d] - first.weight.shape[2 + d]) // 2 for d in range(dims))
    sizes = [p.weight.shape[0] for p in parts]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    tail, stride = first.tail, first.stride
    # Values may reach the merge channels_last (the reordered convolutions leave them so: opsched.runtime.packed):
    # the shared leading operators run as a unit the packed rewrite made layout-proof, and an operator after
    # the convolution that depends on its input's strides reads it laid out as it was at capture.
    # (a PackedUnit holds its unit weakly: run holds the prefix itself)
    prefix_unit = first.prefix
    prefix = packed_unit(prefix_unit) if any(
        n.op == "call_function" and n.target in LAYOUT_BOUND for n in prefix_unit.graph.nodes) else prefix_unit
    layouts = [capture_order(op.args[0]) if op.target in LAYOUT_BOUND else None for op in tail]

    def run(*inputs: Any, _unit: fx.GraphModule = prefix_unit) -> tuple[torch.Tensor, ...]:
        y = conv(prefix(*inputs), weight, bias, stride, padding)
        for op, order in zip(tail, layouts):
            y = op.target(laid_out(y, order) if order is not None else y, *op.args[1:], **op.kwargs)
        return torch.split(y, sizes, dim=1)

    return run


def _take_apart(node: Node) -> _Conv:
    gm = node.run
    if not isinstance(gm, fx.GraphModule):
        raise MergeError(f"unit {node.name!r} has no FX graph to merge")
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and _name(n) in ("conv2d", "conv1d", "conv3d",
                                                                                    "convolution")]
    if len(convs) != 1:
        raise MergeError(f"unit {node.name!r} does not hold exactly one convolution")
    conv = convs[0]
    x, weight, bias, stride, padding = _conv_args(conv, gm)
    weight = weight.detach()
    # on the weight's device: it meets the batch norm's statistics (on the model's device) when folded
    bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device) if bias is None else bias.detach()
    current = conv
    tail: list[fx.Node] = []
    while True:
        users = list(current.users)
        if len(users) != 1 or users[0].op == "output":
            break
        user = users[0]
        name = _name(user)
        if name in _BATCH_NORMS and not tail:
            weight, bias = _fold(weight, bias, user, gm)
        elif name == "getitem" and user.args[1] == 0 and not tail:
            pass  # the output of _native_batch_norm_legit_no_training
        elif name in ("dropout", "identity", "clone"):
            pass
        elif user.args and user.args[0] is current and not any(isinstance(a, fx.Node) for a in user.args[1:]):
            tail.append(user)
        else:
            raise MergeError(f"unit {node.name!r}: cannot merge through {user.format_node()}")
        current = user
    prefix_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n is conv:
            break
        env[n] = prefix_graph.node_copy(n, lambda a: env[a])
    prefix_graph.output(env[x] if isinstance(x, fx.Node) else x)
    prefix_graph.eliminate_dead_code()
    prefix = fx.GraphModule(gm, prefix_graph)
    return _Conv(prefix, weight, bias, stride, padding, tail)


def _conv_args(conv: fx.Node, gm: fx.GraphModule) -> tuple[Any, torch.Tensor, torch.Tensor | None, tuple, tuple]:
    args = list(conv.args)
    names = ["input", "weight", "bias", "stride", "padding", "dilation"]
    values = dict(zip(names, args))
    values.update({k: v for k, v in conv.kwargs.items() if k in names})
    weight = get_attr_value(values["weight"], gm)
    bias = values.get("bias")
    bias = get_attr_value(bias, gm) if isinstance(bias, fx.Node) else None
    dims = weight.dim() - 2
    stride = _expand(values.get("stride", 1), dims)
    padding = _expand(values.get("padding", 0), dims)
    return values["input"], weight, bias, stride, padding


def _expand(value: Any, dims: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dims
    value = tuple(value)
    return value * dims if len(value) == 1 else value


def _fold(weight: torch.Tensor, bias: torch.Tensor, node: fx.Node, gm: fx.GraphModule):
    """Fold an inference batch norm into the convolution before it."""
    bn = inference_batch_norm(node)
    if bn is None:
        raise MergeError("cannot fold a batch norm in training mode")

    def value(n: Any) -> torch.Tensor | None:
        return get_attr_value(n, gm).detach() if isinstance(n, fx.Node) else None

    return folded_conv(weight, bias, value(bn.weight), value(bn.bias), value(bn.mean), value(bn.var), bn.eps)


def _name(node: fx.Node) -> str:
    target = node.target
    if hasattr(target, "_opname"):
        return target._opname
    return getattr(target, "__name__", str(target))
