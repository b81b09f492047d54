"""The table cost model: per-unit latencies from the graph (DAG JSON), and a formula for stages.

A concurrent stage whose groups are G1..Gk takes ``max(max_i sum(G_i), sum(stage) / C) + sync * (k - 1)``,
with C the capacity (how many units' worth of work the device does at once; 0 = unlimited) and sync the
cost of each extra group's synchronisation. A staged schedule takes the sum of its stages.

>>> from opsched.graph.ir import Graph, Node
>>> g = Graph([Node("a", latency=4.0), Node("b", latency=2.0), Node("c", latency=3.0)])
>>> TableCost(g).stage_latency([[0], [1], [2]])
4.0
>>> TableCost(g, capacity=2, sync_overhead=0.5).stage_latency([[0], [1], [2]])
5.5
"""

from __future__ import annotations

from collections.abc import Sequence

from opsched.errors import OpschedError
from opsched.graph.ir import Graph


class TableCost:
    name = "table"

    def __init__(self, graph: Graph, capacity: float = 0.0, sync_overhead: float = 0.0):
        if capacity != 0 and capacity < 1:
            raise OpschedError(f"capacity must be 0 (unlimited) or at least 1, got {capacity}")
        if sync_overhead < 0:
            raise OpschedError(f"sync overhead must not be negative, got {sync_overhead}")
        missing = [n.name for n in graph.nodes if n.latency is None]
        if missing:
            raise OpschedError(f"the table cost model needs a latency for every unit; {missing[0]!r} has none")
        self.graph = graph
        self.capacity = float(capacity)
        self.sync_overhead = float(sync_overhead)
        self.latencies = [float(n.latency) for n in graph.nodes]
        self.regions: dict[tuple[int, ...], float] = {}  # stays empty: see region_latencies

    def op_latency(self, unit: int) -> float:
        return self.latencies[unit]

    def stage_latency(self, groups: Sequence[Sequence[int]]) -> float:
        lat = self.latencies
        sums = [sum(lat[u] for u in g) for g in groups]
        longest = max(sums)
        if self.capacity:
            longest = max(longest, sum(sums) / self.capacity)
        return longest + self.sync_overhead * (len(groups) - 1)

    def stage_threads(self, groups: Sequence[Sequence[int]]) -> None:
        return None

    def merge_latency(self, units: Sequence[int]) -> float | None:
        return None  # a DAG JSON file gives no latency for merged units

    def region_latencies(self, regions: Sequence[Sequence[int]]) -> None:
        return None  # nothing here is compiled, so no region fuses anything

    def stream_latency(self, makespan: float, streams: Sequence[Sequence[int]]) -> float:
        # The timeline already holds the synchronisation; capacity bounds the whole run from below.
        if self.capacity:
            return max(makespan, sum(self.latencies[u] for s in streams for u in s) / self.capacity)
        return makespan

    def describe(self) -> dict:
        return {"name": self.name, "capacity": self.capacity, "sync_overhead": self.sync_overhead}
