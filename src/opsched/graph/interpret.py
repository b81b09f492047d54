"""Run a captured graph unit by unit, in its topological order: the reference every schedule is checked
against, and the simplest executor (the Interpreter pattern of torch.fx, one level up).

Example:

>>> import torch
>>> from opsched.graph.capture import capture
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
>>> x = torch.randn(1, 3, 8, 8)
>>> torch.equal(run_graph(capture(model, (x,)), x), model(x))
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.utils._pytree as pytree

from opsched.errors import GraphError
from opsched.graph.ir import Graph


def run_graph(graph: Graph, *inputs: Any) -> Any:
    """Run every unit of ``graph`` in order on ``inputs`` and return the model's outputs.

    Each intermediate value is dropped as soon as its last reader has run.
    """
    flat = pytree.tree_leaves(inputs)
    if len(flat) != len(graph.inputs):
        raise GraphError(f"{graph.name} takes {len(graph.inputs)} input tensors, got {len(flat)}")
    env: dict[str, Any] = dict(zip(graph.inputs, flat))
    remaining = {name: 0 for name in env}
    for node in graph.nodes:
        remaining[node.name] = 0
    for node in graph.nodes:
        for a in set(node.args):
            remaining[a] += 1
    for o in graph.outputs:
        remaining[o] += 1
    for node in graph.nodes:
        if node.run is None:
            raise GraphError(f"unit {node.name!r} has no operator to run (graphs from DAG JSON cannot run)")
        env[node.name] = node.run(*(env[a] for a in node.args))
        for a in set(node.args):
            remaining[a] -= 1
            if remaining[a] == 0:
                del env[a]
    result = [env[o] for o in graph.outputs]
    if graph.out_spec is not None:
        return pytree.tree_unflatten(result, graph.out_spec)
    return result[0] if len(result) == 1 else tuple(result)


def all_values(graph: Graph, inputs: Sequence[Any]) -> dict[str, Any]:
    """Every graph input and unit output by name, on the flat ``inputs``: what units are profiled and
    compiled with. Holds every intermediate value at once, unlike :func:`run_graph`."""
    import torch

    values: dict[str, Any] = dict(zip(graph.inputs, inputs))
    with torch.inference_mode():
        for node in graph.nodes:
            values[node.name] = node.run(*(values[a] for a in node.args))
    return values
