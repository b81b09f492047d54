"""Compile a Schedule into a StreamProgram: for each stream, the steps it runs in order.

A step runs units (one unit, or the units of a merge stage as one operator), records an event, or waits for
one; executors run the program lowered (:mod:`opsched.runtime.lowered`). Values live in slots: the graph's
inputs first, then one slot per unit. A run step also says which slots it releases once it is done, so that a
backend frees every intermediate tensor as soon as its last reader has run; a slot read on several streams is
released by whichever reader finishes last.

- A staged schedule puts group ``i`` of each stage on stream ``i`` and joins the streams between stages
  through stream 0: each other stream records an event at the end of its group and stream 0 waits for
  all of them; before the next stage, stream 0 records an event the other streams wait for.
- A stream schedule runs each stream's units in order and synchronises only where an edge crosses
  streams and the order is not already implied: a stream that waited for unit ``q`` of another stream
  knows that everything ``q``'s stream had done or waited for before ``q`` is done too (a vector clock per
  stream), so ``a -> b -> c`` and ``a -> c`` on three streams wait once for ``a``'s stream, not twice. The
  producer's stream records one event, each reading stream waits at most once.

The program says how many intra-op threads each run step uses, which the CPU backend applies inside each
worker thread: in a staged schedule ``cores`` are shared by the groups of a stage; in a stream schedule by the
streams whose predicted timelines overlap the unit's (a unit that runs alone gets every core), or, for a
schedule mapped onto devices, the threads of the unit's device (its ``devices`` section).

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.cost.table import TableCost
>>> from opsched.schedule import from_stages
>>> g = Graph([Node("a", args=("x",), latency=1.0), Node("b", args=("a",), latency=2.0),
...            Node("c", args=("a",), latency=3.0)], inputs=["x"])
>>> p = compile_program(from_stages(g, TableCost(g), "demo", [("concurrent", [[0]]), ("concurrent", [[1], [2]])]),
...                     g, cores=2)
>>> for k, steps in enumerate(p.describe()): print(k, steps)
0 ['run a (2 threads)', 'record 0', 'run b (1 threads)', 'wait 1']
1 ['wait 0', 'run c (1 threads)', 'record 1']
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from opsched.graph.ir import Graph, indices
from opsched.schedule import Schedule, ScheduleError, validate


@dataclass(frozen=True)
class Run:
    units: tuple[int, ...]   # one unit, or the units of a merge stage
    threads: int
    release: tuple[int, ...] = ()  # slots this step is the (or a) last reader of

    def describe(self, graph: Graph) -> str:
        names = "+".join(graph.nodes[u].name for u in self.units)
        return f"{'merge' if len(self.units) > 1 else 'run'} {names} ({self.threads} threads)"


@dataclass(frozen=True)
class Record:
    event: int

    def describe(self, graph: Graph) -> str:
        return f"record {self.event}"


@dataclass(frozen=True)
class Wait:
    event: int

    def describe(self, graph: Graph) -> str:
        return f"wait {self.event}"


Step = Run | Record | Wait


@dataclass
class StreamProgram:
    graph: Graph
    streams: list[list[Step]]
    events: int
    cores: int
    readers: list[int] = field(default_factory=list)  # per slot: how many run steps release it
    outputs: tuple[int, ...] = ()                    # slots the program returns

    def slot(self, name: str) -> int:
        """The slot holding the value ``name`` (a graph input or a unit)."""
        if name in self.graph.index:
            return len(self.graph.inputs) + self.graph.index[name]
        return self.graph.inputs.index(name)

    def runs(self) -> list[Run]:
        return [s for steps in self.streams for s in steps if isinstance(s, Run)]

    def describe(self) -> list[list[str]]:
        """Each stream's steps as text."""
        return [[s.describe(self.graph) for s in steps] for steps in self.streams]


def compile_program(schedule: Schedule, graph: Graph, cores: int = 1) -> StreamProgram:
    """The StreamProgram that executes ``schedule`` on ``graph`` with ``cores`` intra-op threads to share."""
    validate(schedule, graph)
    if schedule.stages is not None:
        index = graph.index
        return staged_program(graph, [(st.strategy, [[index[u] for u in g] for g in st.groups])
                                      for st in schedule.stages], cores,
                              [st.threads for st in schedule.stages])
    return _finish(graph, *_streamed(schedule, graph, _check_cores(cores)), cores)


def staged_program(graph: Graph, stages: Sequence[tuple[str, Sequence[Sequence[int]]]],
                   cores: int = 1, threads: Sequence[Sequence[Sequence[int]] | None] | None = None) -> StreamProgram:
    """The program of stages given as ``(strategy, groups of unit indices)``, unchecked (the profiler runs
    it). ``threads[k]``, when given, holds stage k's intra-op threads per unit (capped at ``cores``);
    otherwise a stage's groups share the cores evenly."""
    _check_cores(cores)
    streams: list[list[Step]] = [[]]
    events = 0
    for position, (strategy, groups) in enumerate(stages):
        width = 1 if strategy == "merge" else len(groups)
        while len(streams) < width:
            streams.append([])
        if width > 1:  # fork: the other streams wait for stream 0 to reach this stage
            streams[0].append(Record(events))
            for k in range(1, width):
                streams[k].append(Wait(events))
            events += 1
        even = max(1, cores // width)
        chosen = threads[position] if threads is not None and threads[position] else None
        if strategy == "merge":
            streams[0].append(Run(tuple(u for g in groups for u in g), even))
        else:
            for k, group in enumerate(groups):
                streams[k].extend(Run((u,), min(cores, chosen[k][i]) if chosen else even)
                                  for i, u in enumerate(group))
        if width > 1:  # join: stream 0 waits for the others to finish this stage
            for k in range(1, width):
                streams[k].append(Record(events))
                streams[0].append(Wait(events))
                events += 1
    return _finish(graph, streams, events, cores)


def _check_cores(cores: int) -> int:
    if cores < 1:
        raise ScheduleError(f"cores must be at least 1, got {cores}")
    return cores


def _finish(graph: Graph, streams: list[list[Step]], events: int, cores: int) -> StreamProgram:
    program = StreamProgram(graph, streams, events, cores)
    program.outputs = tuple(program.slot(o) for o in graph.outputs)
    _plan_release(program)
    return program


def _streamed(schedule: Schedule, graph: Graph, cores: int) -> tuple[list[list[Step]], int]:
    every = [[graph.index[n] for n in units] for units in schedule.streams()]
    threads = _stream_threads(schedule, graph, every, cores)
    order = [units for units in every if units]
    stream_of = {u: k for k, units in enumerate(order) for u in units}
    position = {u: i for units in order for i, u in enumerate(units)}
    after: dict[int, list[int]] = {}  # unit -> per stream, the last position known done once it has run
    known = [[-1] * len(order) for _ in order]  # per stream: what it knows done so far
    waits: dict[int, list[int]] = {}  # unit -> producers its stream waits for right before it
    for u in _run_order(graph, order):
        k = stream_of[u]
        needed = []
        for p in indices(graph.preds[u]):
            j = stream_of[p]
            if j != k and known[k][j] < position[p]:
                needed.append(p)
        # the producer that knows most first: waiting for it may make the other waits unnecessary
        for p in sorted(needed, key=lambda p: -sum(after[p])):
            j = stream_of[p]
            if known[k][j] < position[p]:
                waits.setdefault(u, []).append(p)
                known[k] = [max(a, b) for a, b in zip(known[k], after[p])]
        known[k][k] = position[u]
        after[u] = list(known[k])
    event_of: dict[int, int] = {}
    for u in sorted(p for ps in waits.values() for p in ps):
        event_of.setdefault(u, len(event_of))
    streams: list[list[Step]] = []
    for k, units in enumerate(order):
        steps: list[Step] = []
        for u in units:
            steps.extend(Wait(event_of[p]) for p in waits.get(u, ()))
            steps.append(Run((u,), threads[u]))
            if u in event_of:
                steps.append(Record(event_of[u]))
        streams.append(steps)
    return streams, len(event_of)


def _run_order(graph: Graph, order: Sequence[Sequence[int]]) -> list[int]:
    """The units in an order that respects both their dependencies and each stream's order."""
    before: dict[int, set[int]] = {u: set(indices(graph.preds[u])) for units in order for u in units}
    for units in order:
        for a, b in itertools.pairwise(units):
            before[b].add(a)
    done: list[int] = []
    ready = sorted(u for u, deps in before.items() if not deps)
    waiting = {u: len(deps) for u, deps in before.items()}
    users: dict[int, list[int]] = {}
    for u, deps in before.items():
        for d in deps:
            users.setdefault(d, []).append(u)
    while ready:
        u = ready.pop()
        done.append(u)
        for v in users.get(u, ()):
            waiting[v] -= 1
            if not waiting[v]:
                ready.append(v)
    if len(done) != len(before):
        raise ScheduleError("the stream order deadlocks: some stream waits on a unit placed later on another")
    return done


def _stream_threads(schedule: Schedule, graph: Graph, order: Sequence[Sequence[int]], cores: int) -> dict[int, int]:
    """Each unit's intra-op threads: its device's, when the schedule maps streams onto devices (``order``
    has every stream, empty ones too, so that stream k is device k); otherwise ``cores`` shared by the
    streams whose predicted timelines overlap the unit's."""
    if schedule.devices is not None:
        devices = schedule.devices.devices
        return {u: devices[k].threads for k, units in enumerate(order) for u in units}
    timing = {graph.index[o.name]: o for o in schedule.ops}
    threads = {}
    for k, units in enumerate(order):
        for u in units:
            mine = timing[u]
            busy = {j for j, others in enumerate(order) if j != k and others and any(
                timing[v].start < mine.finish and mine.start < timing[v].finish for v in others)}
            threads[u] = max(1, cores // (1 + len(busy)))
    return threads


def _plan_release(program: StreamProgram) -> None:
    """Mark, on each stream, the last run step reading each slot; a slot read on several streams gets one
    release per stream, and the backend frees it when the last of them is done."""
    graph = program.graph
    keep = set(program.outputs) | set(range(len(graph.inputs)))
    readers = [0] * (len(graph.inputs) + len(graph))
    for k, steps in enumerate(program.streams):
        last: dict[int, int] = {}
        for position, step in enumerate(steps):
            if isinstance(step, Run):
                for u in step.units:
                    for a in graph.nodes[u].args:
                        slot = program.slot(a)
                        if slot not in keep:
                            last[slot] = position
        releases: dict[int, list[int]] = {}
        for slot, position in last.items():
            releases.setdefault(position, []).append(slot)
            readers[slot] += 1
        for position, slots in releases.items():
            step = steps[position]
            steps[position] = Run(step.units, step.threads, tuple(sorted(slots)))
    program.readers = readers
