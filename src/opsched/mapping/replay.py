"""A mapping timed on its platform by the one event simulator (:mod:`opsched.events`): what ``predicted``
reports.

Devices run their jobs in the mapping's order, one at a time. A job starts when its device is free and
every input it reads has arrived there: at once from a job on the same device, after the link's time from
another device (a transfer starts when the producing job finishes). Links carry transfers side by side (DiviML's model, and the MILP's: a
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

from dataclasses import dataclass, field

from opsched.events import Deadlock, simulate
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
    """Time ``mapping`` (see the module docstring) with the one event simulator, :func:`opsched.events.simulate`;
    raises :class:`MappingError` if the device orders deadlock."""
    graph = problem.graph
    device_of: dict[tuple[int, int], int] = {}
    job_of: dict[tuple[int, int], Job] = {}
    for job in mapping.jobs():
        for q in job.pieces:
            device_of[(job.unit, q)] = job.device
            job_of[(job.unit, q)] = job

    def inputs(job: Job) -> list[tuple[Job, float]]:  # each piece is its own transfer, as in the MILP
        return [(job_of[(u, q)], problem.comm(u, job.unit, device_of[(u, q)], job.device, 1))
                for q in job.pieces for u in indices(graph.preds[job.unit])]

    try:
        times = simulate(mapping.order, lambda job: problem.time(job.unit, job.device, len(job.pieces)), inputs)
    except Deadlock as e:
        raise MappingError(f"the mapping's device orders deadlock: {problem.platform.devices[e.stream].name!r} "
                           f"waits for {graph.nodes[e.job.unit].name!r}, whose inputs come later on other "
                           "devices") from None
    out = Timeline(times.start, times.finish, makespan=times.makespan)
    for job in mapping.jobs():
        now = times.finish[job]
        for v in indices(graph.succs[job.unit]):
            for q in job.pieces:
                dv = device_of[(v, q)]
                if dv != job.device:
                    out.transfers.append(Transfer(job.unit, v, (q,), job.device, dv, now,
                                                  now + problem.comm(job.unit, v, job.device, dv, 1)))
    return out
