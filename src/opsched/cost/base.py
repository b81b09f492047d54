"""The interface every cost model implements. Schedulers only ever call these methods: a scheduler never
measures, and a cost model never schedules.

A *stage* is a list of groups, each a list of unit indices in topological order; the groups run at the
same time, the units of one group one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class CostModel(Protocol):
    name: str
    """What the figures are: ``table`` (from the graph file), ``measured``, or ``sim:DEVICE`` (simulated)."""

    capacity: float
    """How many units' worth of work the device does at once (0: no limit known); bounds every schedule."""

    sync_overhead: float
    """What a unit pays to wait on an event from another stream."""

    def op_latency(self, unit: int) -> float:
        """Latency of one unit run alone."""

    def stage_latency(self, groups: Sequence[Sequence[int]]) -> float:
        """Latency of a concurrent stage: ``groups`` run side by side."""

    def stage_threads(self, groups: Sequence[Sequence[int]]) -> list[list[int]] | None:
        """The intra-op threads each unit of a concurrent stage should run with, when this model chose
        them (the measured model picks, per unit of a one-group stage, the faster thread count it
        profiled); None leaves the runtime's rule (all cores shared evenly by the groups)."""

    def merge_latency(self, units: Sequence[int]) -> float | None:
        """Latency of the units merged into one operator, or None if this model cannot cost a merge."""

    def region_latencies(self, regions: Sequence[Sequence[int]]) -> list[float] | None:
        """Latency of each run of units (in topological order) compiled as one region and run back to back,
        where a compiler fuses across the units; None when the units run on kernels that do not fuse
        (eager, a table, a simulated device). A model that gives them lists them in ``regions``;
        :func:`opsched.schedule.from_stages` prices the one-group stages of a plan with regions by them."""

    regions: dict[tuple[int, ...], float]
    """The runs priced as compiled regions so far (see ``region_latencies``)."""

    def stream_latency(self, makespan: float, streams: Sequence[Sequence[int]]) -> float:
        """Latency of a stream schedule (each stream's units in order) whose timeline, built from
        ``op_latency`` and ``sync_overhead``, ends at ``makespan``; models that know more (streams sharing
        a device) return a better figure."""
