"""Running a mapped plan for real: which plans can run here, and what ``opsched run`` reports for them.

A mapped plan is a stream-form Schedule whose stream d is device d (``options["stream_devices"]``). Its CPU
devices run as the CPU backend's worker threads, each with its device's intra-op threads
(``options["stream_threads"]``, applied by ``opsched.runtime.program``), values passing between them in
shared memory (a transfer between two CPU devices is free). A plan on a simulated device, or one that splits
the batch across devices, cannot run, and says so in one line.

>>> from opsched.schedule import Schedule, OpTiming
>>> s = Schedule("heft", "g", "f", [OpTiming("a", 0, 0, 1), OpTiming("b", 1, 0, 1)], 1.0,
...              options={"mapping": True, "stream_devices": ["c0", "c1"], "stream_kinds": ["cpu", "cpu"]})
>>> check_runnable(s)
{'c0': 1, 'c1': 1}
"""

from __future__ import annotations

from opsched.mapping import MappingError
from opsched.schedule import Schedule


def is_mapping(schedule: Schedule) -> bool:
    return bool(schedule.options.get("mapping"))


def check_runnable(schedule: Schedule) -> dict[str, int]:
    """Units per device of a mapped plan that can run here; raises :class:`MappingError` (one line) when it
    cannot: a simulated device, a batch split across devices, or a CUDA device (not run by this version)."""
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
    cuda = [names[k] for k in used if str(kinds[k]).startswith("cuda:")]
    if cuda:
        raise MappingError(f"the plan maps units onto CUDA device(s) {', '.join(cuda)}; running mapped plans on "
                           "CUDA devices is not implemented yet (CPU devices only)")
    return counts
