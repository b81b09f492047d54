"""Every unit in its own stage, in the graph's topological order: what PyTorch eager does."""

from __future__ import annotations

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph
from opsched.schedule import Schedule, from_stages


def sequential(graph: Graph, cost: CostModel) -> Schedule:
    """
    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(2, 3)
    >>> sequential(g, TableCost(g)).predicted_latency
    6.0
    """
    return from_stages(graph, cost, "sequential", [("concurrent", [[u]]) for u in range(len(graph))])
