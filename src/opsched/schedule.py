"""Schedules: what runs when, in two forms, one JSON format (``opsched.schedule/1``).

- *staged* (IOS, greedy, sequential): stages one after another; a ``concurrent`` stage runs its groups at
  the same time (the units of a group in order), a ``merge`` stage runs its units fused into one operator.
- *stream* (LIOS, Nimble, exact): each unit gets a stream; a stream runs its units in order and waits on
  an event only where a unit reads a unit of another stream.

Both carry the per-unit timeline (stream, start, finish) their cost model predicts, the fingerprint of
the graph they were made for, the device, batch and cost model, search statistics and lower bounds.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.cost.table import TableCost
>>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=2.0), Node("c", args=("a",), latency=3.0)])
>>> s = from_stages(g, TableCost(g), "example", [("concurrent", [[0]]), ("concurrent", [[1], [2]])])
>>> s.predicted_latency, [(o.name, o.stream, o.start, o.finish) for o in s.ops]
(4.0, [('a', 0, 0.0, 1.0), ('b', 0, 1.0, 3.0), ('c', 1, 1.0, 4.0)])
>>> validate(s, g)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opsched.cost.base import CostModel
from opsched.errors import OpschedError
from opsched.graph.ir import Graph, can_merge, indices
from opsched.jsonfile import read_json

FORMAT = "opsched.schedule/1"
STRATEGIES = ("concurrent", "merge")
_EPS = 1e-9


class ScheduleError(OpschedError, ValueError):
    """A schedule that is malformed, invalid for its graph, or made for another graph."""


@dataclass
class Stage:
    strategy: str
    groups: list[list[str]]
    threads: list[list[int]] | None = None  # intra-op threads per unit, when the cost model chose them


@dataclass
class OpTiming:
    name: str
    stream: int
    start: float
    finish: float


@dataclass
class Schedule:
    method: str
    graph_name: str
    fingerprint: str
    ops: list[OpTiming]
    predicted_latency: float
    stages: list[Stage] | None = None
    cost: str = "table"
    device: str = "table"
    batch: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def form(self) -> str:
        return "staged" if self.stages is not None else "stream"

    def streams(self) -> list[list[str]]:
        """Units of each stream in the order they run (by predicted start)."""
        count = 1 + max((o.stream for o in self.ops), default=-1)
        by_stream: list[list[OpTiming]] = [[] for _ in range(count)]
        for o in self.ops:
            by_stream[o.stream].append(o)
        return [[o.name for o in sorted(ops, key=lambda o: (o.start, o.finish))] for ops in by_stream]

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT, "method": self.method, "form": self.form,
            "graph": {"name": self.graph_name, "fingerprint": self.fingerprint, "units": len(self.ops)},
            "device": self.device, "batch": self.batch, "cost": self.cost,
            "predicted_latency": self.predicted_latency,
        }
        if self.stages is not None:
            doc["stages"] = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        doc["ops"] = [asdict(o) for o in self.ops]
        doc["stats"] = self.stats
        doc["bounds"] = self.bounds
        doc["options"] = self.options
        return doc

    def save(self, path: str | Path) -> None:
        """Write the plan whole or not at all (a Ctrl-C or a full disk never leaves a truncated plan); a path
        that cannot be written is a :class:`ScheduleError` (one line)."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=1) + "\n"
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            partial.write_text(text)
            os.replace(partial, path)
        except OSError as e:
            raise ScheduleError(f"cannot write the plan to {path}: {e.strerror or e}") from None
        finally:
            with contextlib.suppress(OSError):  # gone once replaced; never made where the directory is missing
                partial.unlink(missing_ok=True)


def from_dict(doc: Any, source: str = "<schedule>") -> Schedule:
    """Read a schedule from its JSON form, reporting the first problem in one line."""
    if isinstance(doc, dict) and isinstance(doc.get("format"), str) and doc["format"].startswith("opsched.schedule/") \
            and doc["format"] != FORMAT:
        raise ScheduleError(f"{source}: plan format {doc['format']} is not supported (this opsched reads {FORMAT})")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ScheduleError(f"{source}: not an opsched schedule (expected \"format\": \"{FORMAT}\")")
    try:
        stages = None
        if doc.get("stages") is not None:
            stages = [Stage(str(s["strategy"]), [[str(u) for u in g] for g in s["groups"]],
                            [[int(t) for t in g] for g in s["threads"]] if s.get("threads") else None)
                      for s in doc["stages"]]
        ops = [OpTiming(str(o["name"]), int(o["stream"]), float(o["start"]), float(o["finish"])) for o in doc["ops"]]
        graph = doc["graph"]
        schedule = Schedule(method=str(doc["method"]), graph_name=str(graph["name"]),
                            fingerprint=str(graph["fingerprint"]), ops=ops,
                            predicted_latency=float(doc["predicted_latency"]), stages=stages,
                            cost=str(doc.get("cost", "table")), device=str(doc.get("device", "table")),
                            batch=doc.get("batch"), stats=dict(doc.get("stats", {})),
                            bounds=dict(doc.get("bounds", {})), options=dict(doc.get("options", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ScheduleError(f"{source}: malformed schedule ({type(e).__name__}: {e})") from None
    if schedule.batch is not None and (not isinstance(schedule.batch, int) or isinstance(schedule.batch, bool)
                                       or schedule.batch < 1):
        raise ScheduleError(f"{source}: batch must be a positive integer or null, got {json.dumps(schedule.batch)}")
    # Streams are numbered as validate() allows: one per unit at most, or per device of a mapping. A larger
    # number (a hand edit) made every stream up to it, empty: opsched show ran out of memory on stream 10**12.
    devices = schedule.options.get("stream_devices")
    streams = max(len(ops), len(devices) if isinstance(devices, list) else 0)
    for o in ops:
        if not 0 <= o.stream < streams:
            raise ScheduleError(f"{source}: unit {o.name!r} has a bad timeline entry (stream {o.stream}, "
                                f"{o.start}..{o.finish})")
    if schedule.options.get("mapping"):
        from opsched.mapping.execute import check_mapped_plan  # the mapping package builds on this module

        check_mapped_plan(schedule, source)
    return schedule


def load(path: str | Path, graph: Graph | None = None) -> Schedule:
    """Load a schedule file; with ``graph``, also check that it was made for that graph and is valid."""
    schedule = from_dict(read_json(path, ScheduleError), str(path))
    if graph is not None:
        validate(schedule, graph)
    return schedule


def validate(schedule: Schedule, graph: Graph) -> None:
    """Raise :class:`ScheduleError` unless the schedule fits ``graph``: made for it, every unit exactly
    once, every dependency respected, merge stages mergeable, and a consistent timeline."""
    if schedule.fingerprint != graph.fingerprint:
        raise ScheduleError(f"this plan was made for another graph ({schedule.graph_name}, fingerprint "
                            f"{schedule.fingerprint}); {graph.name} has fingerprint {graph.fingerprint}")
    names = [o.name for o in schedule.ops]
    _check_each_unit_once(names, graph, "the timeline")
    timing = {o.name: o for o in schedule.ops}
    # one stream per unit at most, or per device of a mapping: a larger number (a hand edit) would make
    # every stream up to it, empty
    devices = schedule.options.get("stream_devices")
    streams = max(len(graph), len(devices) if isinstance(devices, list) else 0)
    for o in schedule.ops:
        if (not 0 <= o.stream < streams or not math.isfinite(o.start) or not math.isfinite(o.finish)
                or o.finish < o.start - _EPS):
            raise ScheduleError(f"unit {o.name!r} has a bad timeline entry (stream {o.stream}, {o.start}..{o.finish})")
    for i, node in enumerate(graph.nodes):
        for j in indices(graph.preds[i]):
            pred = graph.nodes[j].name
            if timing[node.name].start < timing[pred].finish - _EPS and not _same_merge(schedule, pred, node.name):
                raise ScheduleError(f"unit {node.name!r} starts before its input {pred!r} finishes")
    for stream, units in enumerate(schedule.streams()):
        for a, b in itertools.pairwise(units):
            if timing[b].start < timing[a].finish - _EPS and not _same_merge(schedule, a, b):
                raise ScheduleError(f"units {a!r} and {b!r} overlap on stream {stream}")
    if schedule.stages is not None:
        _validate_stages(schedule.stages, graph)


def _same_merge(schedule: Schedule, a: str, b: str) -> bool:
    return schedule.stages is not None and any(
        s.strategy == "merge" and {a, b} <= {u for g in s.groups for u in g} for s in schedule.stages)


def _check_each_unit_once(names: Sequence[str], graph: Graph, where: str) -> None:
    seen: set[str] = set()
    for n in names:
        if n not in graph.index:
            raise ScheduleError(f"{where} names unit {n!r}, which the graph does not have")
        if n in seen:
            raise ScheduleError(f"{where} places unit {n!r} more than once")
        seen.add(n)
    missing = [n.name for n in graph.nodes if n.name not in seen]
    if missing:
        raise ScheduleError(f"{where} leaves out {len(missing)} unit(s), first {missing[0]!r}")


def _validate_stages(stages: Sequence[Stage], graph: Graph) -> None:
    _check_each_unit_once([u for s in stages for g in s.groups for u in g], graph, "the stages")
    done: set[str] = set()
    for k, stage in enumerate(stages):
        if stage.strategy not in STRATEGIES:
            raise ScheduleError(f"stage {k} has unknown strategy {stage.strategy!r}")
        if not stage.groups or any(not g for g in stage.groups):
            raise ScheduleError(f"stage {k} has an empty group")
        if stage.threads is not None and ([len(t) for t in stage.threads] != [len(g) for g in stage.groups]
                                          or any(t < 1 for ts in stage.threads for t in ts)):
            raise ScheduleError(f"stage {k}: threads must give a positive count for every unit of every group")
        group_of = {u: gi for gi, g in enumerate(stage.groups) for u in g}
        for gi, group in enumerate(stage.groups):
            before: set[str] = set()
            for u in group:
                for a in graph.nodes[graph.index[u]].args:
                    if a not in graph.index or a in done:
                        continue
                    if a not in group_of:
                        raise ScheduleError(f"stage {k}: unit {u!r} reads {a!r}, which runs in a later stage")
                    if stage.strategy == "merge" or group_of[a] != gi:
                        raise ScheduleError(f"stage {k}: unit {u!r} reads {a!r}, which runs at the same time")
                    if a not in before:
                        raise ScheduleError(f"stage {k}: unit {u!r} runs before its input {a!r} in its group")
                before.add(u)
        if stage.strategy == "merge":
            units = [graph.nodes[graph.index[u]] for g in stage.groups for u in g]
            if not can_merge(units):
                raise ScheduleError(f"stage {k} merges units that cannot be merged: {', '.join(n.name for n in units)}")
        done.update(group_of)


def from_stages(graph: Graph, cost: CostModel, method: str, stages: Sequence[tuple[str, Sequence[Sequence[int]]]],
                **extra: Any) -> Schedule:
    """A staged schedule from ``(strategy, groups of unit indices)`` pairs, with its predicted timeline.

    Stages run back to back. Group ``i`` of a concurrent stage runs on stream ``i``, its units one after
    another, their latencies stretched to the stage's latency when the cost model says running the groups
    together slows them (contention, capacity). A merge stage runs on stream 0. With ``options["regions"]``
    the runtime fuses each run of one-group stages into a compiled region, and a one-group stage is priced
    as the region of its units where the cost model can (``region_latencies``; IOS joins each run into one
    stage).
    """
    ops: list[OpTiming] = []
    out_stages: list[Stage] = []
    clock = 0.0
    regions = bool(extra.get("options", {}).get("regions"))
    if regions:  # asked together, so that a measured cost model profiles the runs it has not seen in one go
        cost.region_latencies([groups[0] for strategy, groups in stages if strategy == "concurrent" and len(groups) == 1])
    for strategy, groups in stages:
        groups = [list(g) for g in groups]
        if strategy == "merge":
            latency = cost.merge_latency([u for g in groups for u in g])
            if latency is None:
                raise ScheduleError(f"cost model {cost.name} cannot cost merging {groups}")
            ops.extend(OpTiming(graph.nodes[u].name, 0, clock, clock + latency) for g in groups for u in g)
        else:
            priced = cost.region_latencies(groups) if regions and len(groups) == 1 else None
            latency = priced[0] if priced else cost.stage_latency(groups)
            sums = [sum(cost.op_latency(u) for u in g) for g in groups]
            stretch = latency / max(sums) if max(sums) > 0 else 1.0
            for stream, group in enumerate(groups):
                t = clock
                for u in group:
                    d = cost.op_latency(u) * stretch
                    ops.append(OpTiming(graph.nodes[u].name, stream, t, t + d))
                    t += d
        chosen = cost.stage_threads(groups) if strategy == "concurrent" else None
        out_stages.append(Stage(strategy, [[graph.nodes[u].name for u in g] for g in groups], chosen))
        clock += latency
    ops.sort(key=lambda o: graph.index[o.name])
    return Schedule(method=method, graph_name=graph.name, fingerprint=graph.fingerprint, ops=ops,
                    predicted_latency=clock, stages=out_stages, cost=cost.name, **extra)


def joined_runs(stages: Sequence[tuple[str, Sequence[Sequence[int]]]]) -> list[tuple[str, list[list[int]]]]:
    """``stages`` with each run of consecutive one-group stages joined into one stage: what a plan with
    compiled regions runs as one region (see :mod:`opsched.runtime.regions`), so that :func:`from_stages` prices
    it as one.

    >>> joined_runs([("concurrent", [[0]]), ("concurrent", [[1, 2]]), ("concurrent", [[3], [4]]), ("concurrent", [[5]])])
    [('concurrent', [[0, 1, 2]]), ('concurrent', [[3], [4]]), ('concurrent', [[5]])]
    """
    joined: list[tuple[str, list[list[int]]]] = []
    for strategy, groups in stages:
        if strategy == "concurrent" and len(groups) == 1 and joined and joined[-1][0] == "concurrent" \
                and len(joined[-1][1]) == 1:
            joined[-1] = ("concurrent", [joined[-1][1][0] + list(groups[0])])
        else:
            joined.append((strategy, [list(g) for g in groups]))
    return joined


def from_streams(graph: Graph, cost: CostModel, method: str, streams: Sequence[Sequence[int]],
                 **extra: Any) -> Schedule:
    """A stream schedule from the units of each stream in order, timed as soon as possible: a unit
    starts when its stream is free and its inputs are done, the cost model's ``sync_overhead`` later
    for an input made on another stream (the event wait)."""
    stream_of = {}
    for k, units in enumerate(streams):
        for u in units:
            if u in stream_of:
                raise ScheduleError(f"unit {graph.nodes[u].name!r} is on two streams")
            stream_of[u] = k
    if len(stream_of) != len(graph):
        raise ScheduleError("a stream schedule must place every unit")
    finish: dict[int, float] = {}
    free = [0.0] * len(streams)
    position = [0] * len(streams)
    ops: list[OpTiming] = []
    remaining = len(graph)
    while remaining:
        progressed = False
        for k, units in enumerate(streams):
            while position[k] < len(units):
                u = units[position[k]]
                preds = list(indices(graph.preds[u]))
                if any(j not in finish for j in preds):
                    break
                ready = max((finish[j] + (cost.sync_overhead if stream_of[j] != k else 0.0) for j in preds), default=0.0)
                start = max(free[k], ready)
                finish[u] = free[k] = start + cost.op_latency(u)
                ops.append(OpTiming(graph.nodes[u].name, k, start, finish[u]))
                position[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("the stream order deadlocks: some stream waits on a unit placed later on another")
    ops.sort(key=lambda o: graph.index[o.name])
    makespan = max(finish.values(), default=0.0)
    latency = cost.stream_latency(makespan, [list(units) for units in streams])
    return Schedule(method=method, graph_name=graph.name, fingerprint=graph.fingerprint, ops=ops,
                    predicted_latency=latency, stages=None, cost=cost.name, **extra)
