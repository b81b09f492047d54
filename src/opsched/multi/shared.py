"""Shared work computed once: a unit that runs the same code on the same weights (the same tensors, a module
two models share) and the same inputs as an earlier unit is dropped, and its readers read the earlier one.

Fine-tuned copies that keep a frozen backbone, cascades and ensembles with a common feature extractor all
compute their shared part once. The rewrite is exact: nothing is recomputed differently, only not twice.

>>> import torch
>>> from opsched.multi.combine import ModelBatch, combine
>>> backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
>>> models = [torch.nn.Sequential(backbone, torch.nn.Conv2d(8, 2, 1)) for _ in range(3)]
>>> x = torch.randn(1, 3, 8, 8)
>>> g, n = share_work(combine(ModelBatch(models, [(x,)] * 3)))
>>> n, [u.name for u in g.nodes]
(2, ['m0/0.0', 'm0/1', 'm1/1', 'm2/1'])
"""

from __future__ import annotations

import dataclasses

from opsched.graph.ir import Graph, Node
from opsched.multi.units import identity_key


def share_work(graph: Graph) -> tuple[Graph, int]:
    """``graph`` with every repeated unit removed, and how many were removed."""
    first: dict[tuple, str] = {}
    same_as: dict[str, str] = {}
    kept: list[Node] = []
    for node in graph.nodes:
        args = tuple(same_as.get(a, a) for a in node.args)
        key = identity_key(node)
        if key is not None and (key, args) in first:
            same_as[node.name] = first[(key, args)]
            continue
        if key is not None:
            first[(key, args)] = node.name
        kept.append(node if args == node.args else dataclasses.replace(node, args=args))
    if not same_as:
        return graph, 0
    return Graph(kept, graph.inputs, [same_as.get(o, o) for o in graph.outputs], graph.name,
                 graph.out_spec), len(same_as)

