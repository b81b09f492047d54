"""IOS's greedy baseline: each stage runs every unit whose inputs are ready, each on its own stream.

With ``max_streams`` K, a stage takes at most K ready units (the first in the graph's order).
"""

from __future__ import annotations

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph, indices
from opsched.schedule import Schedule, from_stages


def greedy(graph: Graph, cost: CostModel, max_streams: int = 0) -> Schedule:
    """
    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(3, 2)
    >>> s = greedy(g, TableCost(g))
    >>> s.predicted_latency, [len(st.groups) for st in s.stages]
    (2.0, [3, 3])
    >>> [len(st.groups) for st in greedy(g, TableCost(g), max_streams=2).stages]
    [2, 2, 1, 1]
    """
    done = 0
    stages = []
    while done != graph.all_mask:
        ready = [u for u in indices(graph.all_mask & ~done) if graph.preds[u] & ~done == 0]
        if max_streams:
            ready = ready[:max_streams]
        stages.append(("concurrent", [[u] for u in ready]))
        for u in ready:
            done |= 1 << u
    return from_stages(graph, cost, "greedy", stages, options={"max_streams": max_streams})
