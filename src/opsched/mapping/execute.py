"""Running a mapped plan for real: which plans can run here, what ``opsched run`` reports for them, and the
backend that runs a plan with CUDA devices.

A mapped plan is a stream-form Schedule whose stream d is device d (``options["stream_devices"]``). A plan on CPU
devices only runs on the CPU backend: each device a worker thread with its device's intra-op threads
(``options["stream_threads"]``, applied by ``opsched.runtime.program``), values passing between them in
shared memory (a transfer between two CPU devices is free). A plan with ``cuda:N`` devices runs on
:class:`opsched.runtime.cuda.DevicesExecutor` (:func:`mapped_executor`): each CUDA device a stream of that GPU
holding its units' weights, each CPU device a worker thread, every value crossing devices copied with the
events that order it (see "Several devices" in :mod:`opsched.runtime.cuda`); it takes the inputs on the host
and returns the outputs there, as the model it stands for does. A plan on a simulated device, one that splits
the batch across devices, or one naming a CUDA device this machine does not have, cannot run, and says so in
one line. :func:`check_mapped_plan` checks, when a plan is read, the fields a mapped plan adds (hand edits of
them are refused in one line).

>>> from opsched.schedule import Schedule, OpTiming
>>> s = Schedule("heft", "g", "f", [OpTiming("a", 0, 0, 1), OpTiming("b", 1, 0, 1)], 1.0,
...              options={"mapping": True, "stream_devices": ["c0", "c1"], "stream_kinds": ["cpu", "cpu"]})
>>> check_runnable(s)
{'c0': 1, 'c1': 1}
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opsched.graph.ir import Graph
from opsched.mapping import MappingError
from opsched.mapping.platform import check_kind
from opsched.schedule import Schedule

if TYPE_CHECKING:
    from opsched.runtime.kernels import Operator
    from opsched.runtime.program import StreamProgram


def is_mapping(schedule: Schedule) -> bool:
    return bool(schedule.options.get("mapping"))


def cuda_index(kind: Any) -> int | None:
    """N for a device of kind ``cuda:N``; None for any other kind."""
    return int(kind[5:]) if isinstance(kind, str) and kind.startswith("cuda:") else None


def cuda_devices(schedule: Schedule) -> list[tuple[str, str]]:
    """The CUDA devices a mapped plan puts units on: (name, ``cuda:N``)."""
    names = schedule.options.get("stream_devices") or []
    kinds = schedule.options.get("stream_kinds") or [None] * len(names)
    used = sorted({op.stream for op in schedule.ops if 0 <= op.stream < len(names)})
    return [(names[d], kinds[d]) for d in used if cuda_index(kinds[d]) is not None]


def check_cuda_devices(devices: Sequence[tuple[str, str]], what: str) -> None:
    """Raise :class:`MappingError` (one line) unless this machine has every CUDA device of ``devices`` (name,
    ``cuda:N``), which ``what`` uses."""
    from opsched.runtime import cuda

    named = ", ".join(f"{name} ({kind})" for name, kind in devices)
    if not cuda.available():
        raise MappingError(f"{what} CUDA device(s) {named}; PyTorch sees no CUDA device here")
    count = cuda.current_api().device_count()
    missing = [(name, kind) for name, kind in devices if cuda_index(kind) >= count]
    if missing:
        raise MappingError(f"{what} {missing[0][0]} ({missing[0][1]}); PyTorch sees {count} CUDA device(s) here")


def check_runnable(schedule: Schedule) -> dict[str, int]:
    """Units per device of a mapped plan that can run here; raises :class:`MappingError` (one line) when it
    cannot: a simulated device, a batch split across devices, or a CUDA device this machine does not have."""
    names = schedule.options.get("stream_devices") or []
    kinds = schedule.options.get("stream_kinds") or [None] * len(names)
    counts = {name: 0 for name in names}
    for op in schedule.ops:
        if not 0 <= op.stream < len(names):
            raise MappingError(f"the mapped plan puts {op.name!r} on stream {op.stream}, which names no device")
        counts[names[op.stream]] += 1
    used = [k for k, name in enumerate(names) if counts[name]]
    simulated = [names[k] for k in used if kinds[k] is None or str(kinds[k]).startswith("sim:")]
    if simulated:
        raise MappingError(f"the plan maps units onto simulated device(s) {', '.join(simulated)}: it can be shown "
                           "(opsched show) but not run")
    if schedule.options.get("split_batch"):
        raise MappingError("the plan splits the batch across devices, which runs only in simulation; map with "
                           "--objective latency (or a batch that is not split) to run it")
    cuda = cuda_devices(schedule)
    if cuda:
        check_cuda_devices(cuda, "the plan maps units onto")
    return counts


def mapped_executor(program: StreamProgram, schedule: Schedule, operator: Operator,
                    cuda_graph: bool = False) -> Any:
    """The backend running ``program``, compiled from ``schedule``, when that is a mapped plan with units on CUDA
    devices: a :class:`~opsched.runtime.cuda.DevicesExecutor` (program stream k is the k-th device with units);
    None for every other plan, which the CPU backend runs."""
    if not is_mapping(schedule):
        return None
    kinds = schedule.options.get("stream_kinds") or []
    devices = [cuda_index(kinds[d]) for d in sorted({op.stream for op in schedule.ops})]
    if all(d is None for d in devices):
        return None
    if cuda_graph:
        raise MappingError("a plan mapped onto several devices runs on their streams, not as one CUDA graph")
    from opsched.runtime.cuda import DevicesExecutor

    return DevicesExecutor(program, operator, devices)


@contextlib.contextmanager
def on_cuda_device(graph: Graph, inputs: Sequence[torch.Tensor], device: int) -> Iterator[tuple[Graph, list]]:
    """``graph`` with its units' weights, and ``inputs``, copied to CUDA device ``device``, inside which a stream
    of that device is current: what runs, is timed or synchronised in the block does so on that GPU."""
    from opsched.runtime import cuda

    api = cuda.current_api()
    with api.use_stream(api.new_stream(device)):
        nodes = [dataclasses.replace(n, run=api.place(n.run, device)) if isinstance(n.run, torch.nn.Module) else n
                 for n in graph.nodes]
        yield (Graph(nodes, graph.inputs, graph.outputs, graph.name, graph.out_spec),
               [api.to(x, device) for x in inputs])


MAX_THREADS = 1024  # more than any machine's cores; a billion made PyTorch's thread pool abort the process


def check_mapped_plan(schedule: Schedule, source: str) -> None:
    """Raise :class:`MappingError` (one line) unless the fields a mapped plan adds are as ``opsched map`` writes
    them: a distinct name, a kind and a thread count for the device of each stream, every unit on one of those
    streams, numbers for the figures, and placements and transfers on those devices. ``opsched show`` and
    ``opsched run`` read them all; a thread count beyond what any machine has is refused, as PyTorch's thread
    pool would try to start them all (a billion aborted the process)."""
    options = schedule.options
    names = options.get("stream_devices")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names):
        raise MappingError(f"{source}: stream_devices must list a distinct name for the device of each stream")
    kinds, threads = options.get("stream_kinds"), options.get("stream_threads")
    if not isinstance(kinds, list) or len(kinds) != len(names):
        raise MappingError(f"{source}: stream_kinds must give a kind (or null) for each of the {len(names)} devices")
    for name, kind in zip(names, kinds, strict=True):
        if kind is not None:
            check_kind(kind, f"{source}: device {name!r}")
    # not this machine's cores: with --engine ray a device runs on its node, which may have more
    if not isinstance(threads, list) or len(threads) != len(names) or not all(
            _whole(t) and 1 <= t <= MAX_THREADS for t in threads):
        raise MappingError(f"{source}: stream_threads must give each of the {len(names)} devices a thread count from "
                           f"1 to {MAX_THREADS}")
    for op in schedule.ops:
        if not 0 <= op.stream < len(names):
            raise MappingError(f"{source}: the mapped plan puts {op.name!r} on stream {op.stream}, which names no "
                               "device")
    if not isinstance(options.get("split_batch", False), bool) or not isinstance(options.get("optimal"), bool) \
            or options.get("objective") not in ("latency", "throughput") \
            or not isinstance(options.get("time_unit", ""), str) \
            or not all(_number(options.get(key)) for key in ("predicted", "lower_bound")) \
            or not isinstance(options.get("platform"), dict) or not isinstance(options["platform"].get("name"), str):
        raise MappingError(f"{source}: a mapped plan's split_batch, optimal, objective, time_unit, predicted, "
                           "lower_bound and platform must be as opsched map writes them")
    placed = options.get("placements")
    moved = options.get("transfers")
    if not isinstance(placed, list) or not isinstance(moved, list) \
            or not all(_entry(p, {"name": str, "device": names}) and isinstance(p.get("inputs"), list)
                       and len(p["inputs"]) == 2 and all(_whole(x) for x in p["inputs"]) for p in placed) \
            or not all(_entry(t, {"value": str, "from_device": names, "to_device": names}) for t in moved):
        raise MappingError(f"{source}: a mapped plan's placements and transfers must each name a unit and devices "
                           f"of the plan ({', '.join(names)}) with a start and a finish")


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _entry(item: Any, fields: dict[str, Any]) -> bool:
    """A placement or transfer: each field a string (``str``) or one of a list of names, and finite times, the
    finish no earlier than the start."""
    if not isinstance(item, dict):
        return False
    for key, want in fields.items():
        if not (isinstance(item.get(key), str) and (want is str or item[key] in want)):
            return False
    start, finish = item.get("start"), item.get("finish")
    return _number(start) and _number(finish) and math.isfinite(start) and math.isfinite(finish) and finish >= start
