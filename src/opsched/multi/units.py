"""What two units of a model batch have in common: the same code and parameter layout (they can be batched
into one kernel), or the very same parameters as well (one of them is redundant).

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
    """Units with equal keys compute the same function of their inputs and weights: the same code, and
    weights of the same names, shapes and dtypes. None for a unit that cannot be compared (no FX code)."""
    run = node.run
    if not isinstance(run, torch.fx.GraphModule):
        return None
    return (run.code, node.shape, node.dtype,
            tuple((name, tuple(t.shape), t.dtype) for name, t in tensors_of(node).items()))


def identity_key(node: Node) -> Any:
    """Units with equal keys (and equal inputs) compute the same values: equal layouts and weights that are
    the same memory (a shared module), not merely equal numbers."""
    layout = layout_key(node)
    if layout is None:
        return None
    return (layout, tuple((_memory_of(t), t.storage_offset(), tuple(t.stride())) for t in tensors_of(node).values()))


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
