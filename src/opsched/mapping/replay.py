"""The event-driven simulator that times a mapping on its platform: what ``predicted`` reports.

Devices run their jobs in the mapping's order, one at a time. A job starts when its device is free and
every input it reads has arrived there: at once from a job on the same device, after the link's time from
another device (a transfer starts when the producing job finishes). Events are job finishes and transfer
arrivals, processed in time order. Links carry transfers side by side (DiviML's model, and the MILP's: a
transfer costs time, not link occupancy), so a mapping's replayed makespan is the one the MILP optimises.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> from opsched.mapping.plan import Mapping
>>> g = Graph([Node("a", latency=2.0), Node("b", args=("a",), latency=3.0), Node("c", args=("a",), latency=3.0)])
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1,
...                         "latency": 0.5}}})
>>> prob = build_problem(g, p, edge_bytes={(0, 1): 1.0, (0, 2): 1.0})
>>> t = replay(prob, Mapping.from_devices(3, [0, 0, 1], [0, 1, 2], 2))
>>> t.makespan, [(tr.value, tr.start, tr.finish) for tr in t.transfers]
(6.5, [(0, 2.0, 3.5)])
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from opsched.graph.ir import indices
from opsched.mapping import MappingError
from opsched.mapping.plan import Job, Mapping
from opsched.mapping.problem import Problem


@dataclass(frozen=True)
class Transfer:
    value: int          # the producing unit
    reader: int         # the unit that reads it
    pieces: tuple[int, ...]
    from_device: int
    to_device: int
    start: float
    finish: float


@dataclass
class Timeline:
    start: dict[Job, float] = field(default_factory=dict)
    finish: dict[Job, float] = field(default_factory=dict)
    transfers: list[Transfer] = field(default_factory=list)
    makespan: float = 0.0


def replay(problem: Problem, mapping: Mapping) -> Timeline:
    """Time ``mapping`` (see the module docstring); raises :class:`MappingError` if the device orders deadlock."""
    graph = problem.graph
    device_of: dict[tuple[int, int], int] = {}
    for job in mapping.jobs():
        for q in job.pieces:
            device_of[(job.unit, q)] = job.device
    # needed[job]: inputs (producer, reader, piece) still to arrive on the job's device
    needed = {job: sum(1 for q in job.pieces for _ in indices(graph.preds[job.unit])) for job in mapping.jobs()}
    head = [0] * problem.devices
    busy = [False] * problem.devices
    out = Timeline()
    events: list[tuple[float, int, int, object]] = []  # (time, order, kind 0 finish / 1 arrival, payload)
    counter = 0
    reader_jobs: dict[tuple[int, int], Job] = {(j.unit, q): j for j in mapping.jobs() for q in j.pieces}

    def try_start(d: int, now: float) -> None:
        nonlocal counter
        if busy[d] or head[d] >= len(mapping.order[d]):
            return
        job = mapping.order[d][head[d]]
        if needed[job]:
            return
        busy[d] = True
        out.start[job] = now
        finish = now + problem.time(job.unit, d, len(job.pieces))
        out.finish[job] = finish
        counter += 1
        heapq.heappush(events, (finish, counter, 0, job))

    for d in range(problem.devices):
        try_start(d, 0.0)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:
            job = payload
            busy[job.device] = False
            head[job.device] += 1
            for v in indices(graph.succs[job.unit]):
                for q in job.pieces:  # each piece is its own transfer, as in the MILP
                    dv = device_of[(v, q)]
                    arrive = now + problem.comm(job.unit, v, job.device, dv, 1)
                    if dv != job.device:
                        out.transfers.append(Transfer(job.unit, v, (q,), job.device, dv, now, arrive))
                    counter += 1
                    heapq.heappush(events, (arrive, counter, 1, (v, (q,))))
            try_start(job.device, now)
        else:
            v, qs = payload
            touched = set()
            for q in qs:
                reader = reader_jobs[(v, q)]
                needed[reader] -= 1
                touched.add(reader.device)
            for d in sorted(touched):
                try_start(d, now)
    if len(out.finish) != len(needed):
        stuck = next(mapping.order[d][head[d]] for d in range(problem.devices) if head[d] < len(mapping.order[d]))
        raise MappingError(f"the mapping's device orders deadlock: {problem.platform.devices[stuck.device].name!r} "
                           f"waits for {graph.nodes[stuck.unit].name!r}, whose inputs come later on other devices")
    out.makespan = max(out.finish.values(), default=0.0)
    return out
