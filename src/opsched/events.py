"""The one event simulator behind every prediction of a stream-form plan: streams (CPU threads, CUDA streams,
the devices of a mapping) run their jobs in order, one at a time; a job starts when its stream is free and
every input has arrived, ``delay`` after the job that made it finished (an event wait between streams, a
transfer between devices). Nothing else is shared, so a job's start is the later of its stream's free time
and its inputs' arrivals, whatever order the events are processed in.

:func:`opsched.schedule.from_streams` times a stream schedule with it (the delay is the cost model's
``sync_overhead`` across streams) and :func:`opsched.mapping.replay.replay` a mapping (the delay is the
link's time for the value).

>>> times = simulate([["a", "b"], ["c"]], {"a": 1.0, "b": 2.0, "c": 3.0}.__getitem__,
...                  lambda job: [("a", 0.5)] if job == "c" else [])
>>> times.start["c"], times.finish["b"], times.makespan
(1.5, 3.0, 4.5)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

Key = Hashable  # a job: any hashable name (a unit index, a mapping.plan.Job)


class Deadlock(Exception):
    """The streams' orders wait on each other: ``stream`` cannot start ``job``, whose inputs come later on other
    streams."""

    def __init__(self, stream: int, job: Key):
        super().__init__(f"stream {stream} waits for {job!r}")
        self.stream = stream
        self.job = job


@dataclass
class Times:
    start: dict[Key, float] = field(default_factory=dict)
    finish: dict[Key, float] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.finish.values(), default=0.0)


def simulate(orders: Sequence[Sequence[Key]], duration: Callable[[Key], float],
             inputs: Callable[[Key], Iterable[tuple[Key, float]]]) -> Times:
    """Time jobs run in ``orders`` (the jobs of each stream, in order): ``duration(job)`` and ``inputs(job)``,
    the ``(producer, delay)`` pairs it waits for. Raises :class:`Deadlock` when the orders cannot all run."""
    stream_of = {job: k for k, jobs in enumerate(orders) for job in jobs}
    waiting: dict[Key, int] = {}
    ready_at: dict[Key, float] = {}
    readers: dict[Key, list[tuple[Key, float]]] = {}
    for jobs in orders:
        for job in jobs:
            count = 0
            for producer, delay in inputs(job):
                readers.setdefault(producer, []).append((job, delay))
                count += 1
            waiting[job], ready_at[job] = count, 0.0
    head, free = [0] * len(orders), [0.0] * len(orders)
    times = Times()
    todo = list(range(len(orders)))
    while todo:
        k = todo.pop()
        jobs = orders[k]
        while head[k] < len(jobs) and not waiting[jobs[head[k]]]:
            job = jobs[head[k]]
            start = max(ready_at[job], free[k])
            free[k] = finish = start + duration(job)
            times.start[job], times.finish[job] = start, finish
            head[k] += 1
            for reader, delay in readers.get(job, ()):
                waiting[reader] -= 1
                ready_at[reader] = max(ready_at[reader], finish + delay)
                if not waiting[reader]:
                    j = stream_of[reader]
                    if j != k and orders[j][head[j]] == reader:
                        todo.append(j)
    if len(times.finish) != len(waiting):
        stuck = next(k for k, jobs in enumerate(orders) if head[k] < len(jobs))
        raise Deadlock(stuck, orders[stuck][head[stuck]])
    return times
