"""A mapping: which device runs each unit (each piece of the batch, for throughput) and in what order.

A :class:`Job` is a unit run on one device for some of the batch's pieces at once (for the latency
objective, the one piece: the whole batch). A :class:`Mapping` lists each device's jobs in the order it runs
them; the simulator (``replay.py``) gives the times. :func:`to_schedule` makes the plan a stream-form
:class:`~opsched.schedule.Schedule`, one stream per device, the mapping's own data in its ``devices`` section.

>>> m = Mapping.from_devices(3, [0, 1, 0], [0, 1, 2], devices=2)
>>> [[j.unit for j in jobs] for jobs in m.order]
[[0, 2], [1]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opsched.mapping import MappingError
from opsched.mapping.problem import Problem
from opsched.schedule import DevicesSection, MappedJob, OpTiming, Schedule, Transfer


@dataclass(frozen=True)
class Job:
    unit: int
    device: int
    pieces: tuple[int, ...] = (0,)


@dataclass
class Mapping:
    order: list[list[Job]]

    @classmethod
    def from_devices(cls, n: int, device_of: Sequence[int], order: Sequence[int], devices: int) -> Mapping:
        """Each unit whole on ``device_of[u]``, every device running its units in the global ``order``."""
        jobs: list[list[Job]] = [[] for _ in range(devices)]
        for u in order:
            jobs[device_of[u]].append(Job(u, device_of[u]))
        if sum(map(len, jobs)) != n:
            raise MappingError("the order must hold every unit once")
        return cls(jobs)

    @classmethod
    def from_pieces(cls, problem: Problem, device_of: Sequence[Sequence[int]], order: Sequence[int]) -> Mapping:
        """``device_of[u][q]`` runs piece ``q`` of unit ``u``; the pieces of a unit on one device are one job;
        every device runs its jobs in the units' ``order``."""
        jobs: list[list[Job]] = [[] for _ in range(problem.devices)]
        for u in order:
            on: dict[int, list[int]] = {}
            for q, d in enumerate(device_of[u]):
                on.setdefault(d, []).append(q)
            for d in sorted(on):
                jobs[d].append(Job(u, d, tuple(on[d])))
        return cls(jobs)

    def jobs(self) -> list[Job]:
        return [j for jobs in self.order for j in jobs]

    def device_of(self) -> list[dict[int, int]]:
        """For each unit, piece -> device (indexed by unit)."""
        n = 1 + max((j.unit for j in self.jobs()), default=-1)
        out: list[dict[int, int]] = [{} for _ in range(n)]
        for j in self.jobs():
            for q in j.pieces:
                out[j.unit][q] = j.device
        return out


def check(problem: Problem, mapping: Mapping) -> None:
    """Raise :class:`MappingError` unless every piece of every unit runs once, on a device that accepts its
    batch, within every device's memory."""
    seen: dict[tuple[int, int], Job] = {}
    used = [0.0] * problem.devices
    for d, jobs in enumerate(mapping.order):
        for job in jobs:
            name = problem.graph.nodes[job.unit].name
            if job.device != d:
                raise MappingError(f"unit {name!r} is listed on device {d} but placed on {job.device}")
            if not job.pieces or math.isinf(problem.time(job.unit, d, len(job.pieces))):
                raise MappingError(f"device {problem.platform.devices[d].name!r} cannot run unit {name!r} "
                                   f"for {len(job.pieces)} of {problem.pieces} pieces of the batch")
            for q in job.pieces:
                if (job.unit, q) in seen or not 0 <= q < problem.pieces:
                    raise MappingError(f"piece {q} of unit {name!r} is placed twice or does not exist")
                seen[(job.unit, q)] = job
            used[d] += problem.memory(job.unit, len(job.pieces))
    if len(seen) != problem.n * problem.pieces:
        missing = next(u for u in range(problem.n) for q in range(problem.pieces) if (u, q) not in seen)
        raise MappingError(f"unit {problem.graph.nodes[missing].name!r} is not placed")
    for d, device in enumerate(problem.platform.devices):
        if used[d] > device.memory * (1 + 1e-9):
            raise MappingError(f"the mapping puts {used[d]:.4g} bytes on {device.name!r}, more than its "
                               f"memory ({device.memory:.4g})")


def transfers(problem: Problem, timeline: Any) -> list[Transfer]:
    """Each value moved between devices (once per target device and pieces)."""
    per_piece = problem.batch // problem.pieces if problem.pieces > 1 else problem.batch
    names = problem.platform.names
    seen = set()
    out = []
    for t in sorted(timeline.transfers, key=lambda t: (t.start, t.value, t.to_device)):
        key = (t.value, t.to_device, t.pieces, t.start, t.finish)
        if key in seen:
            continue
        seen.add(key)
        out.append(Transfer(problem.graph.nodes[t.value].name, names[t.from_device], names[t.to_device], t.start,
                            t.finish, (t.pieces[0] * per_piece, len(t.pieces) * per_piece)))
    return out


def to_schedule(problem: Problem, mapping: Mapping, timeline: Any, method: str, lower_bound: float,
                optimal: bool, stats: dict[str, Any]) -> Schedule:
    """The mapping as a stream-form Schedule: stream ``d`` is device ``d``; each unit's op is its job with
    the most pieces (all of them unless the batch is split), the other jobs of a split batch and the
    transfers in its ``devices`` section."""
    by_unit: dict[int, Job] = {}
    for job in timeline.start:
        if job.unit not in by_unit or len(job.pieces) > len(by_unit[job.unit].pieces):
            by_unit[job.unit] = job
    graph = problem.graph
    ops = [OpTiming(graph.nodes[u].name, by_unit[u].device, timeline.start[by_unit[u]], timeline.finish[by_unit[u]])
           for u in range(problem.n)]
    names = problem.platform.names
    others = [MappedJob(graph.nodes[j.unit].name, names[j.device], timeline.start[j], timeline.finish[j], j.pieces)
              for j in sorted(timeline.start, key=lambda j: (timeline.start[j], j.device, j.unit))
              if by_unit[j.unit] is not j]
    section = DevicesSection(
        problem.platform.to_dict(), problem.objective, problem.pieces, optimal, problem.time_unit,
        transfers(problem, timeline), others,
        {graph.nodes[u].name: job.pieces for u, job in by_unit.items() if others and len(job.pieces) < problem.pieces})
    return Schedule(method=method, graph_name=graph.name, fingerprint=graph.fingerprint, ops=ops,
                    predicted_latency=timeline.makespan, stages=None,
                    cost="sim:" + problem.platform.name if problem.simulated else "measured",
                    device=f"{'sim:' if problem.simulated else ''}platform:{problem.platform.name}",
                    batch=problem.batch, stats=stats, bounds={"lower_bound": lower_bound}, devices=section)
