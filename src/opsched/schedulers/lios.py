"""LIOS (Latency-based Inter-Operator Scheduling): list scheduling onto streams.

Repeatedly take the ready unit with the largest latency (ties: the earlier unit in the graph's order) and
append it to the stream where it finishes earliest: EST = max(stream free, inputs' finish), no insertion
into gaps; ties go to the lowest stream index. O(n * (log n + K)) for n units and K streams.
"""

from __future__ import annotations

import heapq

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph, indices
from opsched.schedule import Schedule, from_streams


def lios_streams(graph: Graph, cost: CostModel, streams: int = 8) -> list[list[int]]:
    """The units of each stream, in order, as LIOS places them.

    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(2, 2)
    >>> lios_streams(g, TableCost(g), streams=3)
    [[0, 1], [2, 3], []]
    """
    if streams < 1:
        raise ValueError(f"LIOS needs at least one stream, got {streams}")
    latency = [cost.op_latency(u) for u in range(len(graph))]
    waiting = [graph.preds[u].bit_count() for u in range(len(graph))]
    ready = [(-latency[u], u) for u in range(len(graph)) if not waiting[u]]
    heapq.heapify(ready)
    free = [0.0] * streams
    finish = [0.0] * len(graph)
    placed: list[list[int]] = [[] for _ in range(streams)]
    while ready:
        _, u = heapq.heappop(ready)
        inputs_done = max((finish[j] for j in indices(graph.preds[u])), default=0.0)
        best = min(range(streams), key=lambda k: (max(free[k], inputs_done), k))
        finish[u] = free[best] = max(free[best], inputs_done) + latency[u]
        placed[best].append(u)
        for v in indices(graph.succs[u]):
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, (-latency[v], v))
    return placed


def lios(graph: Graph, cost: CostModel, streams: int = 8) -> Schedule:
    placed = lios_streams(graph, cost, streams)
    return from_streams(graph, cost, "lios", placed, options={"streams": streams})
