"""What two units of a model batch have in common: the same code and parameter layout (they can be batched
into one kernel), or the very same parameters as well (one of them is redundant). Names are not compared:
the modules of two copies of a network may be called anything.

A captured unit runs a GraphModule whose weights are attributes of its own (see
:mod:`opsched.graph.capture`); the attributes of two models that share a module are the same storage.
"""

from __future__ import annotations

from typing import Any

import torch

from opsched.graph.ir import Node


def tensors_of(unit: Node | Any) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a unit (or of the module it runs) by attribute name (what
    ``functional_call`` replaces)."""
    run = unit.run if isinstance(unit, Node) else unit
    if not isinstance(run, torch.nn.Module):
        return {}
    return {**dict(run.named_parameters()), **dict(run.named_buffers())}


def layout_key(node: Node) -> Any:
    """Units with equal keys compute the same function of their inputs and weights: the same code up to the
    names in it, and weights of the same shapes and dtypes in the same positions (see :func:`weight_names`),
    so a unit of a model whose modules were renamed, or of another library's copy of an architecture, matches.
    None for a unit that cannot be compared (no FX code)."""
    run = node.run
    if not isinstance(run, torch.fx.GraphModule):
        return None
    tensors = tensors_of(run)
    code = canonical_code(run)
    if code is None:  # a module called inside: the code with its names, as written, and what each module is
        code = (run.code, tuple(tensors), tuple(repr(m) for m in run.modules()))
    return (code, node.shape, node.dtype, tuple((tuple(tensors[n].shape), tensors[n].dtype) for n in weight_names(run)))


def identity_key(node: Node) -> Any:
    """Units with equal keys (and equal inputs) compute the same values: equal layouts and weights that are
    the same memory (a shared module), not merely equal numbers."""
    layout = layout_key(node)
    if layout is None:
        return None
    tensors = tensors_of(node)
    return (layout, tuple((_memory_of(t), t.storage_offset(), tuple(t.stride()))
                          for t in (tensors[n] for n in weight_names(node.run))))


def weight_names(run: torch.fx.GraphModule) -> list[str]:
    """A unit's parameter and buffer names in the order its code first reads them (then any it does not read):
    the positions by which the weights of units with equal :func:`layout_key` correspond."""
    tensors = tensors_of(run)
    read = [n.target for n in run.graph.nodes if n.op == "get_attr" and n.target in tensors]
    return list(dict.fromkeys([*read, *tensors]))


def canonical_code(run: torch.fx.GraphModule) -> tuple | None:
    """The unit's code with every name replaced by a position: a value by the operator that made it, a weight
    by the order in which the code reads it. Two units with equal canonical code compute the same function of
    their inputs and (positional) weights, whatever their modules were called. None where the code calls a
    module or reads an attribute that is not one of its parameters or buffers (a submodule of torch.export's,
    say): what those do is not in the code.

    >>> import torch
    >>> def unit(name):
    ...     m = torch.nn.Module()
    ...     m.register_buffer(name, torch.ones(2))
    ...     g = torch.fx.Graph()
    ...     g.output(g.call_function(torch.mul, (g.placeholder("x"), g.get_attr(name))))
    ...     return torch.fx.GraphModule(m, g)
    >>> canonical_code(unit("layer1_conv_weight")) == canonical_code(unit("backbone_layer1_conv_weight"))
    True
    """
    weights: dict[str, int] = {}
    position: dict[torch.fx.Node, int] = {}
    lines = []

    def value(a: Any) -> Any:
        return _Position(position[a]) if isinstance(a, torch.fx.Node) else a

    tensors = tensors_of(run)
    for node in run.graph.nodes:
        if node.op == "call_module" or (node.op == "get_attr" and node.target not in tensors):
            return None
        position[node] = len(position)
        if node.op == "get_attr":
            target: Any = weights.setdefault(node.target, len(weights))
        else:  # the function or method called (by identity); a placeholder is known by its position alone
            target = node.target if node.op != "placeholder" else None
        lines.append((node.op, target, repr(torch.fx.node.map_aggregate(node.args, value)),
                      repr(torch.fx.node.map_aggregate(dict(node.kwargs), value))))
    return tuple(lines)


class _Position(int):
    """A value read by an operator, written as the position of the operator that made it."""

    def __repr__(self) -> str:
        return f"%{int(self)}"


def _memory_of(t: torch.Tensor) -> int:
    # a meta tensor has no memory (every data pointer is 0): only the same tensor object is the same weight
    return id(t) if t.device.type == "meta" else t.untyped_storage().data_ptr()


def local_name(name: str) -> str:
    """A unit's name inside its own model: ``m3/layer1.conv`` -> ``layer1.conv``."""
    return name.split("/", 1)[1] if "/" in name else name


def model_of(name: str) -> int | None:
    """The model a unit's name says it belongs to: ``m3/layer1.conv`` -> 3."""
    head = name.split("/", 1)[0]
    return int(head[1:]) if "/" in name and head[:1] == "m" and head[1:].isdigit() else None
