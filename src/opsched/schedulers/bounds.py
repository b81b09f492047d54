"""Lower bounds on the latency of any schedule, reported next to every schedule.

- critical path: the longest chain of dependent units (each runs at least its own latency);
- work over capacity: all the work divided by how much the device does at once (the table model's
  capacity, or the number of streams of a stream schedule).
"""

from __future__ import annotations

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph, indices


def lower_bounds(graph: Graph, cost: CostModel, streams: int = 0) -> dict[str, float | None]:
    """
    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(4, 3)
    >>> lower_bounds(g, TableCost(g, capacity=2))
    {'critical_path': 3.0, 'work_over_capacity': 6.0, 'lower_bound': 6.0}
    """
    finish = [0.0] * len(graph)
    for u in range(len(graph)):
        finish[u] = max((finish[j] for j in indices(graph.preds[u])), default=0.0) + cost.op_latency(u)
    critical = max(finish, default=0.0)
    work = sum(cost.op_latency(u) for u in range(len(graph)))
    capacities = [c for c in (cost.capacity, float(streams)) if c]
    over = work / min(capacities) if capacities else None
    return {"critical_path": critical, "work_over_capacity": over, "lower_bound": max(critical, over or 0.0)}
