"""Lower bounds on the latency of any schedule, reported next to every schedule.

- critical path: the longest chain of dependent units (each runs at least its own latency);
- work over capacity: all the work divided by how much the device does at once (the table model's
  capacity, or the number of streams of a stream schedule).

A unit that can be merged with others may take less than its own latency: a merge stage runs its units
together, and a cost model may price the merge below its longest unit (which once made the bound exceed a
valid schedule's latency). Such a unit counts for the cheapest merge of at most three units it belongs to,
and for an even share of it in the work, so that the bound holds for schedules with merge stages too.
Likewise a run of units compiled as one region may take less than their sum: each unit of a region the
cost model priced counts for its share of the region's latency, when that is less.
"""

from __future__ import annotations

import itertools

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph, can_merge, indices

MAX_MERGE = 3  # IOS's default largest group (-r 3)


def lower_bounds(graph: Graph, cost: CostModel, streams: int = 0) -> dict[str, float | None]:
    """
    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(4, 3)
    >>> lower_bounds(g, TableCost(g, capacity=2))
    {'critical_path': 3.0, 'work_over_capacity': 6.0, 'lower_bound': 6.0}
    """
    floor, share = unit_floors(graph, cost)
    finish = [0.0] * len(graph)
    for u in range(len(graph)):
        finish[u] = max((finish[j] for j in indices(graph.preds[u])), default=0.0) + floor[u]
    critical = max(finish, default=0.0)
    work = sum(share)
    capacities = [c for c in (cost.capacity, float(streams)) if c]
    over = work / min(capacities) if capacities else None
    return {"critical_path": critical, "work_over_capacity": over, "lower_bound": max(critical, over or 0.0)}


def unit_floors(graph: Graph, cost: CostModel) -> tuple[list[float], list[float]]:
    """For each unit, the least time from its start to its output in any schedule (its own latency, the
    latency of the cheapest merge it can be part of: a merge's units finish together, or its share of a
    compiled region) and the least work it adds (its own latency, or its share of that merge or region)."""
    floor = [cost.op_latency(u) for u in range(len(graph))]
    share = list(floor)
    siblings: dict[tuple[str, ...], list[int]] = {}
    for u, node in enumerate(graph.nodes):
        if node.kind == "conv":
            siblings.setdefault(node.args, []).append(u)
    for group in siblings.values():
        for size in range(2, min(MAX_MERGE, len(group)) + 1):
            for units in itertools.combinations(group, size):
                if not can_merge([graph.nodes[u] for u in units]):
                    continue
                merged = cost.merge_latency(list(units))
                if merged is not None:
                    for u in units:
                        floor[u] = min(floor[u], merged)
                        share[u] = min(share[u], merged / size)
    for region, latency in cost.regions.items():
        alone = sum(cost.op_latency(u) for u in region)
        if 0 < latency < alone:
            for u in region:
                floor[u] = min(floor[u], cost.op_latency(u) * latency / alone)
                share[u] = min(share[u], cost.op_latency(u) * latency / alone)
    return floor, share
