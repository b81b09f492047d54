"""A bias added after a convolution, moved into the convolution.

vmap's batching rule for a convolution with a bias (:mod:`opsched.multi.stack`) convolves without it, then
reshapes the output to the members' stacked layout and adds the members' biases stacked: a second pass over
the whole output, which on 16 small CNNs at batch 1 cost as much as 40-75% of the convolution (measured
here: a 3-to-256-channel convolution 269 us with its bias, 474 us with the add after it; the 16-group
convolution of the next layer 480 against 601 us). When the added tensor gives each output channel of the
convolution one value, the same sum is the convolution's own bias: :func:`conv_biases_folded` finds such
adds behind views and permutes of a convolution's output, works out that per-channel bias from the example
values, checks that it reproduces the added tensor exactly, and passes it to the convolution instead.

>>> import torch
>>> from torch import fx
>>> class Stacked(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
...         self.b = torch.nn.Parameter(torch.randn(2, 2))
...     def forward(self, x):
...         y = torch.ops.aten.convolution.default(x, self.w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
...         y = torch.ops.aten.permute.default(torch.ops.aten.view.default(y, [1, 2, 2, 8, 8]), [1, 0, 2, 3, 4])
...         return torch.ops.aten.add.Tensor(y, torch.ops.aten.view.default(self.b, [2, 1, 2, 1, 1]))
>>> gm = fx.symbolic_trace(Stacked())
>>> x = torch.randn(1, 3, 8, 8)
>>> expected = gm(x)
>>> conv_biases_folded(gm, [x])
1
>>> torch.allclose(gm(x), expected, atol=1e-6), any(n.target is torch.ops.aten.add.Tensor for n in gm.graph.nodes)
(True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from opsched.graph.constfold import attributes_read, forget_unread, free_name

_CONVOLUTION = torch.ops.aten.convolution.default
_ADD = torch.ops.aten.add.Tensor
_LAYOUT = {torch.ops.aten.view.default, torch.ops.aten.permute.default, torch.ops.aten._unsafe_view.default}
# What may lie between a module's own tensor and the add for the added value to count as constant: views only
# (an operator that draws random numbers or writes to its input would be baked in at its example value).
_VIEWS = _LAYOUT | {torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.expand.default,
                    torch.ops.aten.reshape.default}


def conv_biases_folded(gm: fx.GraphModule, examples: Sequence[Any]) -> int:
    """Rewrite ``gm`` in place, as the module docstring says; ``examples`` are its inputs. Returns how many
    adds were moved into their convolutions."""
    values = _values(gm, examples)
    attributes = attributes_read(gm)
    folded = 0
    for add in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ADD
                and n.kwargs.get("alpha", 1) == 1]:
        for side, other in ((0, 1), (1, 0)):
            chain = _layout_chain(add.args[side])
            if chain is None or not _constant(add.args[other]):
                continue
            bias = _channel_bias(values, chain, values[add.args[other]], values[add])
            if bias is None:
                continue
            convolution = chain[0]
            name = free_name(gm, "conv_bias_")
            gm.register_buffer(name, bias)
            with gm.graph.inserting_before(convolution):
                convolution.update_arg(2, gm.graph.get_attr(name))
            add.replace_all_uses_with(add.args[side])
            gm.graph.erase_node(add)
            folded += 1
            break
    if folded:
        gm.graph.eliminate_dead_code()
        forget_unread(gm, attributes)  # the stacked biases the adds read
        gm.recompile()
    return folded


def _values(gm: fx.GraphModule, examples: Sequence[Any]) -> dict[fx.Node, Any]:
    interpreter = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interpreter.run(*examples)
    return interpreter.env


def _layout_chain(node: Any) -> list[fx.Node] | None:
    """[convolution without a bias, view/permute, ...] ending at ``node``, each read by the next alone."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LAYOUT:
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is _CONVOLUTION and node.args[2] is None):
        return None
    chain.append(node)
    chain.reverse()
    if any(len(n.users) != 1 for n in chain):
        return None
    return chain


def _constant(node: Any) -> bool:
    """Computed from the module's own tensors alone (weights, buffers), not from its inputs."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and node.target in _VIEWS and _constant(node.args[0])


def _channel_bias(values: dict[fx.Node, Any], chain: list[fx.Node], added: torch.Tensor,
                  total: torch.Tensor) -> torch.Tensor | None:
    """The per-output-channel bias whose add before the chain's views equals adding ``added`` after them,
    or None when ``added`` does not give each channel one value (or would change the result's shape or
    type)."""
    output = values[chain[0]]
    tail = values[chain[-1]]
    if output.dim() < 2 or total.shape != tail.shape or total.dtype != tail.dtype:
        return None
    if output.device.type == "meta":  # no values to check that the add is a bias: left as it is
        return None
    channels = output.shape[1]
    # Each output position's channel, laid out as the output is, so that the chain's views apply as they do
    index = torch.empty_strided(output.shape, output.stride(), dtype=torch.long, device=output.device)
    index.copy_(torch.arange(channels, device=output.device).view(1, channels, *[1] * (output.dim() - 2)))
    try:
        for node in chain[1:]:
            index = node.target(index, *node.args[1:])
        spread = added.to(device=output.device, dtype=tail.dtype).expand(tail.shape)
    except RuntimeError:  # a view the index cannot take, a value that does not broadcast: left as it is
        return None
    bias = torch.zeros(channels, dtype=tail.dtype, device=output.device)
    bias[index.reshape(-1)] = spread.reshape(-1)
    if not torch.equal(bias[index], spread):
        return None
    return bias
