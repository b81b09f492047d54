"""Constant folding: what a captured graph computes from its weights and shapes alone, computed once at capture.

A model's forward may rebuild the same tensor on every call: Swin's shifted-window attention mask
(``x.new_zeros(...)`` filled slice by slice, which export makes into a copy of the whole mask per slice) and
its relative-position bias (a gather from a weight table), a weight standardised on each call. Eager
PyTorch pays for that every call, and so would every unit that reads it. In inference the weights are
constants and a captured graph's shapes are fixed, so such a value is the same on every call: this pass
computes it once and puts it in the graph as a constant.

A node is *constant* when it is a graph attribute (weight, buffer, lifted constant), or a deterministic,
non-mutating ATen operator whose tensor inputs are all constant, or an operator that reads of its tensor
input only the dtype, device and shape (``new_zeros``, ``zeros_like``...). Each constant operator that a
non-constant node reads is replaced by an attribute holding its value, when that value is at most
:data:`MAX_FOLDED_BYTES` (a folded copy of a large weight would double its memory); the rest become dead.

>>> import torch
>>> class Masked(torch.nn.Module):
...     def forward(self, x):
...         mask = x.new_zeros(4, 4)
...         mask[:2, :2] = 1.0
...         return x + mask
>>> gm = torch.export.export(Masked(), (torch.ones(4, 4),)).run_decompositions({}).module()
>>> folded = fold_constants(gm)
>>> [n.target for n in folded.graph.nodes if n.op == "call_function"]
[<OpOverload(op='aten.add', overload='Tensor')>]
>>> folded(torch.ones(4, 4))[0].tolist()
[2.0, 2.0, 1.0, 1.0]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from opsched.graph import ops

MAX_FOLDED_BYTES = 16 << 20

_aten = torch.ops.aten
# Operators that read of their tensor argument only its dtype, device and shape (fixed in a captured graph).
VALUE_FREE = {_aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default, _aten.new_empty.default,
              _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default, _aten.empty_like.default}


def fold_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its constant values computed once (see the module docstring); changed in place and
    returned."""
    graph = gm.graph
    values: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            values[node] = ops.get_attr_value(node, gm)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in values:
            values[node] = values[node.args[0]][node.args[1]]
        elif _foldable(node) and (node.target in VALUE_FREE or all(a in values for a in node.all_input_nodes)):
            known = {a: values[a] if a in values else _stand_in(a) for a in node.all_input_nodes}
            if any(v is None for v in known.values()):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), known.__getitem__)
            with torch.no_grad():
                values[node] = node.target(*args, **kwargs)
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node not in values:
            continue
        value = values[node]
        readers = [u for u in node.users if u not in values]
        if not readers or any(u.op == "output" for u in readers) or not isinstance(value, torch.Tensor) \
                or value.numel() * value.element_size() > MAX_FOLDED_BYTES:
            continue
        name = f"_folded_constant{folded}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, value.detach().clone(), persistent=False)
        folded += 1
        with graph.inserting_before(node):
            attribute = graph.get_attr(name)
        attribute.meta = dict(node.meta)
        for reader in readers:
            reader.replace_input_with(node, attribute)
    if folded:
        graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _foldable(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags)


def _stand_in(node: fx.Node) -> torch.Tensor | None:
    """A tensor with the dtype, device, shape and strides of ``node``'s value (what a :data:`VALUE_FREE`
    operator reads of it), or None when the graph does not record them."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
