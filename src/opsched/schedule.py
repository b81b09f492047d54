"""Schedules: what runs when, in two forms, one JSON format (``opsched.schedule/1``).

- *staged* (IOS, greedy, sequential): stages one after another; a ``concurrent`` stage runs its groups at
  the same time (the units of a group in order), a ``merge`` stage runs its units fused into one operator.
- *stream* (LIOS, Nimble, exact, every mapping): each unit gets a stream; a stream runs its units in order and
  waits on an event only where a unit reads a unit of another stream.

Both carry the per-unit timeline (stream, start, finish) their cost model predicts, the fingerprint of
the graph they were made for, the device, batch and cost model, search statistics and lower bounds.

A plan says what else it is in typed, optional sections, parsed and validated here alone:

- ``devices`` (:class:`DevicesSection`, a plan of ``opsched map``): stream k runs on the platform's device k;
  the platform, the objective, how the batch was cut into pieces, the transfers between devices, and, when
  the batch is split across devices, the jobs beyond the one per unit the timeline holds;
- ``models`` (:class:`ModelsSection`, a plan of ``opsched multi``): the model batch the graph fuses, the
  rewrites that made it and how the command line loaded it.

Plans written before the sections existed kept them in ``options`` (``mapping``, ``multi``); they are read
into the sections, and written back as sections.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.cost.table import TableCost
>>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=2.0), Node("c", args=("a",), latency=3.0)])
>>> s = from_stages(g, TableCost(g), "example", [("concurrent", [[0]]), ("concurrent", [[1], [2]])])
>>> s.predicted_latency, [(o.name, o.stream, o.start, o.finish) for o in s.ops]
(4.0, [('a', 0, 0.0, 1.0), ('b', 0, 1.0, 3.0), ('c', 1, 1.0, 4.0)])
>>> validate(s, g)
>>> s.kind
'schedule'
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
from opsched.cost.devices import is_simulated
from opsched.errors import OpschedError
from opsched.events import Deadlock, simulate
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


UNIT_KERNELS = ("eager", "packed", "inductor", "onnxruntime")  # what a unit runs on (opsched.runtime.choice)
MAX_THREADS = 1024  # more than any machine's cores; a billion made PyTorch's thread pool abort the process
OBJECTIVES = ("latency", "throughput")
LOAD_OPTIONS = ("models", "copies", "preprocess", "batch", "input_shape", "image_size")


@dataclass(frozen=True)
class PlanDevice:
    """The device a stream of a mapped plan runs on: ``kind`` is ``cpu``, ``cuda:N``, ``sim:NAME``, or None
    (a DAG JSON platform's device, which only has latencies); ``threads`` are a CPU device's intra-op threads."""

    name: str
    kind: str | None
    node: str
    threads: int

    @property
    def simulated(self) -> bool:
        return self.kind is None or is_simulated(self.kind)

    @property
    def cuda_index(self) -> int | None:
        """N for ``cuda:N``; None for any other kind."""
        return int(self.kind[5:]) if self.kind is not None and self.kind.startswith("cuda:") else None


@dataclass(frozen=True)
class MappedJob:
    """A unit run on one device for some pieces of the batch."""

    name: str
    device: str
    start: float
    finish: float
    pieces: tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """A value moved between devices for the inputs ``[first, count]`` of the batch."""

    value: str
    from_device: str
    to_device: str
    start: float
    finish: float
    inputs: tuple[int, int]


@dataclass
class DevicesSection:
    """What makes a plan a mapping (``opsched map``): stream k runs on ``platform``'s device k. ``pieces``: how
    many pieces the batch is cut into (throughput); the timeline holds one job per unit, the one with most
    pieces (``timeline_pieces`` names the pieces of those that do not run the whole batch), and ``jobs`` the
    others (both empty unless the batch is split across devices)."""

    platform: dict[str, Any]
    objective: str = "latency"
    pieces: int = 1
    optimal: bool = False
    time_unit: str = ""
    transfers: list[Transfer] = field(default_factory=list)
    jobs: list[MappedJob] = field(default_factory=list)
    timeline_pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def devices(self) -> list[PlanDevice]:
        return [PlanDevice(d["name"], d.get("kind"), str(d.get("node", "n0")), int(d.get("threads", 1)))
                for d in self.platform["devices"]]

    @property
    def split_batch(self) -> bool:
        return bool(self.jobs)

    def objective_value(self, makespan: float, batch: int | None) -> float:
        """What the objective reports for a makespan: the latency, or inputs per time unit."""
        if self.objective == "throughput":
            return (batch or 1) / makespan if makespan > 0 else math.inf
        return makespan

    def placements(self, ops: Sequence[OpTiming], batch: int | None) -> list[dict[str, Any]]:
        """Every job with the inputs of the batch it runs, ``[first, count]`` (a job of pieces that are not
        consecutive is one entry per run of consecutive pieces), in the order the jobs start: ``opsched map``'s
        ``placements``."""
        names = [d.name for d in self.devices]
        every = tuple(range(self.pieces))
        jobs = [MappedJob(o.name, names[o.stream], o.start, o.finish, self.timeline_pieces.get(o.name, every))
                for o in ops] + list(self.jobs)
        per_piece = (batch or 1) // self.pieces if self.pieces > 1 else (batch or 1)
        order = {n: k for k, n in enumerate(names)}
        out = []
        for job in sorted(jobs, key=lambda j: (j.start, order[j.device])):
            out += [{"name": job.name, "device": job.device, "start": job.start, "finish": job.finish,
                     "inputs": [first * per_piece, count * per_piece]} for first, count in piece_runs(job.pieces)]
        return out

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"platform": self.platform, "objective": self.objective, "pieces": self.pieces,
                               "optimal": self.optimal, "time_unit": self.time_unit,
                               "transfers": [{**asdict(t), "inputs": list(t.inputs)} for t in self.transfers]}
        if self.jobs:
            doc["jobs"] = [{**asdict(j), "pieces": list(j.pieces)} for j in self.jobs]
            doc["timeline_pieces"] = {name: list(p) for name, p in self.timeline_pieces.items()}
        return doc


def piece_runs(pieces: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of ``pieces`` as (first, count).

    >>> piece_runs([3, 0, 1])
    [(0, 2), (3, 1)]
    """
    runs: list[tuple[int, int]] = []
    for q in sorted(pieces):
        if runs and runs[-1][0] + runs[-1][1] == q:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((q, 1))
    return runs


@dataclass
class ModelsSection:
    """What makes a plan a model batch's (``opsched multi``): how many models, what the rewrites computed once
    or batched (``fused``), what rebuilds the fused graph (the ``rewrites`` asked for and the ``batched`` units
    made) and how the command line loaded the batch (``load``: its MODELs and the options in
    :data:`LOAD_OPTIONS`), which ``opsched run`` rebuilds it from."""

    models: int
    fused: dict[str, int]
    rewrites: list[str]
    batched: list[str]
    load: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunSettings:
    """How a plan runs, as asked: the kernels (``--kernels``: ``eager``, ``inductor`` or ``onnxruntime``),
    whether its back-to-back units run as compiled regions (:mod:`opsched.runtime.regions`), and whether its
    program replays as one CUDA graph. In a plan's JSON, the ``kernels``, ``regions`` and ``cuda_graph`` of its
    ``options``."""

    kernels: str = "eager"
    regions: bool = False
    cuda_graph: bool = False

    def to_options(self) -> dict[str, Any]:
        return {"kernels": self.kernels, **({"regions": True} if self.regions else {}),
                **({"cuda_graph": True} if self.cuda_graph else {})}


@dataclass(frozen=True)
class Measurement:
    """What the runner measured and chose when it made a plan: the configuration whose schedule this is
    (``measured_as``), what was chosen overall (``chosen``: its ``name``, ``kind`` and ``threads``; possibly a
    peer), every verified configuration's median milliseconds, those beaten by none above the run's noise
    (``tie``, the first chosen) and how far one program timed twice differed (``same_program_spread``). In a
    plan's JSON, these fields of its ``options``."""

    measured_as: str
    chosen: dict[str, Any]
    measured_ms: dict[str, float]
    tie: list[str] = field(default_factory=list)
    same_program_spread: float | None = None

    def to_options(self) -> dict[str, Any]:
        out = {"measured_as": self.measured_as, "chosen": dict(self.chosen), "measured_ms": dict(self.measured_ms),
               "tie": list(self.tie)}
        if self.same_program_spread is not None:
            out["same_program_spread"] = self.same_program_spread
        return out


RUN_KERNELS = ("auto", "eager", "inductor", "onnxruntime")  # what --kernels asks for


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
    options: dict[str, Any] = field(default_factory=dict)  # the scheduler's own settings (streams, limits, ...)
    run: RunSettings = field(default_factory=RunSettings)  # how it runs, as asked
    measured: Measurement | None = None  # what the runner measured and chose (None: not measured)
    devices: DevicesSection | None = None
    models: ModelsSection | None = None
    # the call a plan of opsched.optimize was made for (one entry per flat input), how more plans are made,
    # and the plans of the other call signatures it serves (see opsched.deploy)
    inputs: list[dict[str, Any]] | None = None
    input_structure: str | None = None  # how the inputs nest (torch's pytree spec, as treespec_dumps writes it)
    build: dict[str, Any] | None = None
    signatures: list[dict[str, Any]] = field(default_factory=list)
    # the kernel each unit runs on, chosen once (opsched.runtime.choice): what it was measured and verified with
    unit_kernels: dict[str, str] | None = None

    @property
    def form(self) -> str:
        return "staged" if self.stages is not None else "stream"

    @property
    def kind(self) -> str:
        """``mapping`` (opsched map), ``model batch`` (opsched multi) or ``schedule`` (one model or graph)."""
        return "mapping" if self.devices is not None else "model batch" if self.models is not None else "schedule"

    @property
    def costed(self) -> bool:
        """Whether ``predicted_latency`` predicts this plan: not for the whole graph compiled by Inductor as one
        region (``--kernels auto``, see :func:`opsched.pipeline.whole_graph_on_inductor`), which is measured, not
        costed, and holds its units' prediction on the cost model's kernels."""
        return "inductor_whole_graph" not in self.stats

    @property
    def simulated(self) -> bool:
        """Whether the plan's figures are simulated, the label every reader of a plan gives them: its cost names
        a simulated device (``sim:NAME``) or, for a mapping, a platform whose figures are simulated
        (``sim:PLATFORM``, by :func:`opsched.mapping.platform.figures_simulated`); a mapping onto a simulated
        device is simulated whatever its cost says, so that a hand-edited "measured" cannot lie."""
        if is_simulated(self.cost):
            return True
        if self.devices is None:
            return False
        from opsched.mapping.platform import figures_simulated

        return figures_simulated(self.devices.devices, given_latencies=False)

    def streams(self) -> list[list[str]]:
        """Units of each stream in the order they run (by predicted start); a mapped plan has a stream per
        device of its platform, empty ones too."""
        count = 1 + max((o.stream for o in self.ops), default=-1)
        if self.devices is not None:
            count = max(count, len(self.devices.platform["devices"]))
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
        # one JSON object, as plans have always been written: the scheduler's settings, how the plan runs and
        # what was measured
        doc["options"] = {**self.options, **self.run.to_options(),
                          **(self.measured.to_options() if self.measured is not None else {})}
        if self.devices is not None:
            doc["devices"] = self.devices.to_dict()
        if self.models is not None:
            doc["models"] = self.models.to_dict()
        for key in ("unit_kernels", "inputs", "input_structure", "build", "signatures"):
            if getattr(self, key):
                doc[key] = getattr(self, key)
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
                            bounds=dict(doc.get("bounds", {})), options=dict(doc.get("options", {})),
                            inputs=doc.get("inputs"), input_structure=doc.get("input_structure"),
                            build=doc.get("build"),
                            signatures=list(doc.get("signatures", [])))
    except (KeyError, TypeError, ValueError) as e:
        raise ScheduleError(f"{source}: malformed schedule ({type(e).__name__}: {e})") from None
    if doc.get("unit_kernels") is not None:
        schedule.unit_kernels = unit_kernels(doc["unit_kernels"], source)
    schedule.run, schedule.measured = _run_and_measurement(schedule.options, source)
    if schedule.batch is not None and (not isinstance(schedule.batch, int) or isinstance(schedule.batch, bool)
                                       or schedule.batch < 1):
        raise ScheduleError(f"{source}: batch must be a positive integer or null, got {json.dumps(schedule.batch)}")
    devices, models = doc.get("devices"), doc.get("models")
    if schedule.options.get("mapping"):  # written before the sections: the mapping's fields in options
        devices = _devices_from_options(schedule, source)
    if "multi" in schedule.options:
        models = schedule.options.pop("multi")
    if devices is not None:
        schedule.devices = _devices_section(devices, schedule, source)
    if models is not None:
        schedule.models = _models_section(models, source)
    if schedule.devices is not None and schedule.models is not None:
        raise ScheduleError(f"{source}: a plan is a mapping or a model batch's, not both")
    # Streams are numbered as validate() allows: one per unit at most, or per device of a mapping. A larger
    # number (a hand edit) made every stream up to it, empty: opsched show ran out of memory on stream 10**12.
    streams = len(ops) if schedule.devices is None else len(schedule.devices.platform["devices"])
    for o in ops:
        if not (0 <= o.stream < max(streams, 1) and math.isfinite(o.start) and math.isfinite(o.finish)):
            raise ScheduleError(f"{source}: unit {o.name!r} has a bad timeline entry (stream {o.stream}, "
                                f"{o.start}..{o.finish})" + (" that names no device of the plan"
                                                             if schedule.devices is not None else ""))
    return schedule


def _run_and_measurement(options: dict[str, Any], source: str) -> tuple[RunSettings, Measurement | None]:
    """A plan's run settings and measurement, taken out of its JSON ``options`` (which keeps the scheduler's own
    settings), checked."""
    kernels = options.pop("kernels", "eager")
    if kernels not in RUN_KERNELS:
        raise ScheduleError(f"{source}: options.kernels must be one of {', '.join(RUN_KERNELS)}, got "
                            f"{json.dumps(kernels)}")
    run = RunSettings(kernels, bool(options.pop("regions", False)), bool(options.pop("cuda_graph", False)))
    if "measured_as" not in options:
        return run, None
    fields = {k: options.pop(k) for k in ("measured_as", "chosen", "measured_ms", "tie", "same_program_spread")
              if k in options}
    chosen, ms = fields.get("chosen", {"name": fields["measured_as"], "kind": "schedule"}), fields.get("measured_ms", {})
    spread = fields.get("same_program_spread")
    if not (isinstance(fields["measured_as"], str) and isinstance(chosen, dict) and isinstance(chosen.get("name"), str)
            and isinstance(ms, dict) and all(isinstance(v, (int, float)) for v in ms.values())
            and isinstance(fields.get("tie", []), list) and (spread is None or isinstance(spread, (int, float)))):
        raise ScheduleError(f"{source}: the measurement in options (measured_as, chosen, measured_ms, tie, "
                            "same_program_spread) is malformed")
    return run, Measurement(fields["measured_as"], chosen, {str(k): float(v) for k, v in ms.items()},
                            [str(t) for t in fields.get("tie", [])], spread)


def unit_kernels(doc: Any, source: str) -> dict[str, str]:
    """A plan's ``unit_kernels``: unit name to the name of a kernel this opsched knows (which units: checked
    against the graph when the plan runs, by :func:`opsched.runtime.choice.check_choice`)."""
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise ScheduleError(f"{source}: unit_kernels must map each unit's name to its kernel's name")
    unknown = [(n, k) for n, k in doc.items() if k not in UNIT_KERNELS]
    if unknown:
        raise ScheduleError(f"{source} runs unit {unknown[0][0]!r} on kernel {unknown[0][1]!r}; this opsched knows "
                            f"{', '.join(UNIT_KERNELS)}")
    return dict(doc)


def _devices_from_options(schedule: Schedule, source: str) -> dict[str, Any]:
    """A mapped plan written before the sections (its fields in ``options``) as a ``devices`` section: the
    platform held each stream's device already; the bound (also in ``bounds``) and ``predicted`` (the
    objective of ``predicted_latency``) were stored twice; ``placements`` repeat the timeline but for the jobs
    of a split batch."""
    options = schedule.options
    doc = {key: options.pop(key) for key in ("platform", "objective", "pieces", "optimal", "time_unit", "transfers")
           if key in options}
    listed = doc.get("platform", {}).get("devices") if isinstance(doc.get("platform"), dict) else None
    if isinstance(listed, list) and all(isinstance(d, dict) for d in listed):
        # what the platform holds, the plan repeated per stream: a hand edit of one copy is refused
        for key, field_, default in (("stream_devices", "name", None), ("stream_kinds", "kind", None),
                                     ("stream_threads", "threads", 1)):
            if key in options and options[key] != [d.get(field_, default) for d in listed]:
                raise ScheduleError(f"{source}: the mapped plan's {key} disagree with its platform's devices")
    if "lower_bound" not in schedule.bounds and "lower_bound" in options:
        schedule.bounds["lower_bound"] = options["lower_bound"]
    for key in ("mapping", "stream_devices", "stream_kinds", "stream_threads", "split_batch", "lower_bound",
                "predicted"):
        options.pop(key, None)
    placed = options.pop("placements", [])
    pieces = doc.get("pieces", 1)
    if not (_whole(pieces) and pieces >= 1 and isinstance(placed, list)
            and all(isinstance(p, dict) and isinstance(p.get("inputs"), list) and len(p["inputs"]) == 2
                    and all(_whole(x) for x in p["inputs"]) for p in placed)):
        raise ScheduleError(f"{source}: a mapped plan's placements must each give the inputs [first, count] it runs")
    per_piece = max(1, (schedule.batch or 1) // pieces if pieces > 1 else (schedule.batch or 1))
    jobs: dict[tuple, list[int]] = {}
    for p in placed:
        first, count = p["inputs"][0] // per_piece, max(1, p["inputs"][1] // per_piece)
        jobs.setdefault((p.get("name"), p.get("device"), p.get("start"), p.get("finish")), []).extend(
            range(first, first + count))
    names = [d.get("name") for d in doc.get("platform", {}).get("devices", [])] \
        if isinstance(doc.get("platform"), dict) and isinstance(doc["platform"].get("devices"), list) else []
    on_timeline = {(o.name, names[o.stream] if 0 <= o.stream < len(names) else None, o.start, o.finish)
                   for o in schedule.ops}
    every = list(range(pieces))
    if any(sorted(qs) != every for qs in jobs.values()):  # the batch is split across devices
        doc["jobs"] = [{"name": n, "device": d, "start": s, "finish": f, "pieces": sorted(qs)}
                       for (n, d, s, f), qs in jobs.items() if (n, d, s, f) not in on_timeline]
        doc["timeline_pieces"] = {n: sorted(qs) for (n, d, s, f), qs in jobs.items()
                                  if (n, d, s, f) in on_timeline and sorted(qs) != every}
    return doc


def _devices_section(doc: Any, schedule: Schedule, source: str) -> DevicesSection:
    """The ``devices`` section, checked: a distinct name, a known kind (or none) and a thread count for the
    device of each stream, and transfers and jobs on those devices with finite times. A thread count beyond
    what any machine has is refused: PyTorch's thread pool would try to start them all (a billion aborted the
    process)."""
    from opsched.cost.devices import kind_problem

    where = f"{source}: the devices section"
    platform = doc.get("platform") if isinstance(doc, dict) else None
    listed = platform.get("devices") if isinstance(platform, dict) else None
    if not isinstance(listed, list) or not listed or not isinstance(platform.get("name"), str) \
            or not all(isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"] for d in listed):
        raise ScheduleError(f"{where} must name its platform and list a named device for each stream")
    names = [d["name"] for d in listed]
    if len(set(names)) != len(names):
        raise ScheduleError(f"{where} names a device twice")
    for d in listed:
        if d.get("kind") is not None and kind_problem(d["kind"]):
            raise ScheduleError(f"{where}: device {d['name']!r}: {kind_problem(d['kind'])}")
        # not this machine's cores: with --engine ray a device runs on its node, which may have more
        if not (_whole(d.get("threads", 1)) and 1 <= d.get("threads", 1) <= MAX_THREADS):
            raise ScheduleError(f"{where}: device {d['name']!r} must have a thread count from 1 to {MAX_THREADS}")
    if doc.get("objective", "latency") not in OBJECTIVES or not _whole(doc.get("pieces", 1)) \
            or doc.get("pieces", 1) < 1 or not isinstance(doc.get("optimal", False), bool) \
            or not isinstance(doc.get("time_unit", ""), str):
        raise ScheduleError(f"{where}: objective, pieces, optimal and time_unit must be as opsched map writes them")
    try:
        transfers = [Transfer(t["value"], t["from_device"], t["to_device"], t["start"], t["finish"],
                              tuple(t["inputs"])) for t in doc.get("transfers", [])]
        jobs = [MappedJob(j["name"], j["device"], j["start"], j["finish"], tuple(j["pieces"]))
                for j in doc.get("jobs", [])]
        timeline_pieces = {str(n): tuple(p) for n, p in doc.get("timeline_pieces", {}).items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise ScheduleError(f"{where}: a transfer or job lacks a field ({type(e).__name__}: {e})") from None
    for item in [*transfers, *jobs]:
        devices = (item.from_device, item.to_device) if isinstance(item, Transfer) else (item.device,)
        label = item.value if isinstance(item, Transfer) else item.name
        if not isinstance(label, str) or not all(d in names for d in devices) \
                or not (_number(item.start) and _number(item.finish) and item.start <= item.finish):
            raise ScheduleError(f"{where}: every transfer and job must name a unit and devices of the plan "
                                f"({', '.join(names)}) with a start and a finish")
    if not _number(schedule.bounds.get("lower_bound")):
        raise ScheduleError(f"{source}: a mapped plan's bounds must give its lower_bound, a number")
    pieces = doc.get("pieces", 1)
    if not all(_whole(q) and 0 <= q < pieces for j in jobs for q in j.pieces) \
            or not all(_whole(q) and 0 <= q < pieces for p in timeline_pieces.values() for q in p) \
            or not all(len(t.inputs) == 2 and all(_whole(x) for x in t.inputs) for t in transfers):
        raise ScheduleError(f"{where}: pieces must be numbers below {pieces}, and inputs [first, count]")
    return DevicesSection(platform, doc.get("objective", "latency"), pieces, doc.get("optimal", False),
                          doc.get("time_unit", ""), transfers, jobs, timeline_pieces)


def _models_section(doc: Any, source: str) -> ModelsSection:
    """The ``models`` section, checked."""
    where = f"{source}: the models section"
    if not isinstance(doc, dict):
        raise ScheduleError(f"{where} must be an object")
    load = doc.get("load")
    checks = [("models", _whole(doc.get("models")) and doc.get("models") >= 1),
              ("fused", isinstance(doc.get("fused"), dict) and all(_whole(v) for v in doc["fused"].values())),
              ("rewrites", _strings(doc.get("rewrites"))), ("batched", _strings(doc.get("batched"))),
              ("load", load is None or isinstance(load, dict))]
    if isinstance(load, dict):
        checks += [("load.models", _strings(load.get("models")) and len(load["models"]) > 0),
                   ("load.copies", _positive(load.get("copies"))),
                   ("load.preprocess", load.get("preprocess") is None or isinstance(load["preprocess"], str)),
                   ("load.batch", load.get("batch") is None or _positive(load["batch"])),
                   ("load.image_size", load.get("image_size") is None or _positive(load["image_size"])),
                   ("load.input_shape", load.get("input_shape") is None or _strings(load["input_shape"]))]
    for key, ok in checks:
        if not ok:
            value = doc.get(key) if "." not in key else load.get(key.split(".", 1)[1])
            raise ScheduleError(f"{where}: {key} is malformed ({value!r})")
    return ModelsSection(doc["models"], dict(doc["fused"]), list(doc["rewrites"]), list(doc["batched"]),
                         {k: load.get(k) for k in LOAD_OPTIONS} if isinstance(load, dict) else None)


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(x: Any) -> bool:
    return _whole(x) and x >= 1


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


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
    streams = len(graph) if schedule.devices is None else len(schedule.devices.platform["devices"])
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
    if schedule.devices is not None:
        section = schedule.devices
        named = [t.value for t in section.transfers] + [j.name for j in section.jobs] + list(section.timeline_pieces)
        stray = next((n for n in named if n not in graph.index), None)
        if stray is not None:
            raise ScheduleError(f"the devices section names unit {stray!r}, which the graph does not have")


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
    together slows them (contention, capacity). A merge stage runs on stream 0. With ``run.regions``
    the runtime fuses each run of one-group stages into a compiled region, and a one-group stage is priced
    as the region of its units where the cost model can (``region_latencies``; IOS joins each run into one
    stage).
    """
    ops: list[OpTiming] = []
    out_stages: list[Stage] = []
    clock = 0.0
    regions = extra.get("run", RunSettings()).regions
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
    """A stream schedule from the units of each stream in order, timed as soon as possible by the one event
    simulator (:mod:`opsched.events`): a unit starts when its stream is free and its inputs are done, the cost
    model's ``sync_overhead`` later for an input made on another stream (the event wait)."""
    stream_of = {}
    for k, units in enumerate(streams):
        for u in units:
            if u in stream_of:
                raise ScheduleError(f"unit {graph.nodes[u].name!r} is on two streams")
            stream_of[u] = k
    if len(stream_of) != len(graph):
        raise ScheduleError("a stream schedule must place every unit")
    try:
        times = simulate(streams, cost.op_latency,
                         lambda u: [(j, cost.sync_overhead if stream_of[j] != stream_of[u] else 0.0)
                                    for j in indices(graph.preds[u])])
    except Deadlock:
        raise ScheduleError("the stream order deadlocks: some stream waits on a unit placed later on another") from None
    finish = times.finish
    ops = [OpTiming(graph.nodes[u].name, stream_of[u], times.start[u], finish[u]) for u in finish]
    ops.sort(key=lambda o: graph.index[o.name])
    makespan = max(finish.values(), default=0.0)
    latency = cost.stream_latency(makespan, [list(units) for units in streams])
    return Schedule(method=method, graph_name=graph.name, fingerprint=graph.fingerprint, ops=ops,
                    predicted_latency=latency, stages=None, cost=cost.name, **extra)
