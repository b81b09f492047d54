"""A device's lowered run steps cut into segments, one remote call each (see :mod:`opsched.runtime.ray`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from opsched.errors import OpschedError
from opsched.runtime.lowered import LoweredProgram, lower
from opsched.runtime.program import StreamProgram


@dataclass(frozen=True)
class Segment:
    """A run of one device's steps made by one remote call: ``steps`` index the device's run steps (its
    :meth:`~opsched.runtime.lowered.LoweredProgram.calls`), ``position`` orders the device's segments;
    ``imports`` are the slots it receives (in argument order), ``exports`` the slots it returns."""

    device: int
    position: int
    steps: tuple[int, ...]
    imports: tuple[int, ...]
    exports: tuple[int, ...]


def cut_segments(program: LoweredProgram | StreamProgram, per_unit: bool = False) -> list[Segment]:
    """Each stream's run steps cut into segments (one per step with ``per_unit``, which the benchmark
    compares), in an order in which every import is exported by an earlier segment (graph inputs come from
    the caller)."""
    if isinstance(program, StreamProgram):  # only the slots matter here: no callables are made
        program = lower(program, lambda nodes, threads: None)
    runs = [program.calls(k) for k in range(len(program.streams))]
    producer = {slot: k for k, steps in enumerate(runs) for s in steps for slot in s.writes}
    readers: dict[int, set[int]] = {}  # slot -> streams that read it
    for k, steps in enumerate(runs):
        for s in steps:
            for slot in s.reads:
                readers.setdefault(slot, set()).add(k)
    returned = set(program.outputs)
    segments: list[Segment] = []
    for k, steps in enumerate(runs):
        mine: list[Segment] = []
        received: set[int] = set()
        current: list[int] = []
        imports: list[int] = []
        for i, s in enumerate(steps):
            arriving = [slot for slot in dict.fromkeys(s.reads) if producer.get(slot) != k and slot not in received]
            if arriving and current:
                mine.append(Segment(k, len(mine), tuple(current), tuple(imports), ()))
                current, imports = [], []
            current.append(i)
            imports.extend(arriving)
            received.update(arriving)
            exports = [slot for slot in s.writes if slot in returned or readers.get(slot, set()) - {k}]
            if exports or per_unit or i == len(steps) - 1:
                mine.append(Segment(k, len(mine), tuple(current), tuple(imports), tuple(exports)))
                current, imports = [], []
        segments += mine
    return _submission_order(segments)


def _submission_order(segments: list[Segment]) -> list[Segment]:
    """The segments in an order where each comes after the segments exporting its imports and after its
    device's earlier segments; ties go to the lower position on its device, so that devices advance together."""
    exporter = {slot: j for j, s in enumerate(segments) for slot in s.exports}
    index = {(s.device, s.position): j for j, s in enumerate(segments)}
    users: dict[int, list[int]] = {}
    waiting = []
    for j, s in enumerate(segments):
        deps = {exporter[slot] for slot in s.imports if slot in exporter}
        if s.position:
            deps.add(index[(s.device, s.position - 1)])
        for d in deps:
            users.setdefault(d, []).append(j)
        waiting.append(len(deps))
    ready = [(segments[j].position, j) for j, w in enumerate(waiting) if not w]
    heapq.heapify(ready)
    order = []
    while ready:
        _, j = heapq.heappop(ready)
        order.append(segments[j])
        for u in users.get(j, ()):
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (segments[u].position, u))
    if len(order) != len(segments):
        raise OpschedError("the mapped plan's device orders deadlock: a device waits for a unit placed after it")
    return order
