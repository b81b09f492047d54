"""What a process holds while it runs: resident memory, threads, file descriptors, child processes (``soak``)."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from opsched.compare import compare_outputs


def resident_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def stream_threads() -> int:
    return sum(t.name == "opsched-stream" for t in threading.enumerate())


def soak(make_module: Callable[[], Any], inputs: tuple, calls: int = 2000, warmup: int = 200,
         reference: Callable[..., Any] | None = None, processes: Callable[[Any], list[int]] | None = None
         ) -> dict[str, Any]:
    """Call a fresh module ``calls`` times after ``warmup`` calls; report resident memory growth over the
    calls, worker threads and descriptors before, during and after close, and after a second module is
    dropped without close (collected). With ``reference`` (the model), every output is compared with its output
    on ``inputs``; with ``processes`` (a module's worker processes, by process id: a RayModule's actors), their
    resident memory is followed too, and whether they end on close and when the second module is collected."""
    gc.collect()
    threads_before, fds_before = stream_threads(), open_descriptors()
    with torch.inference_mode():
        expected = reference(*inputs) if reference is not None else None
    module = make_module()
    pids = processes(module) if processes is not None else []
    wrong = 0
    with torch.inference_mode():
        for _ in range(warmup):
            module(*inputs)
        gc.collect()
        rss_start, pids_start = resident_mb(), [resident_mb(p) for p in pids]
        samples = []
        started = time.perf_counter()
        for k in range(calls):
            got = module(*inputs)
            if expected is not None:
                wrong += not compare_outputs(got, expected).ok
            if k % max(1, calls // 10) == 0:
                samples.append(round(resident_mb(), 1))
        seconds = time.perf_counter() - started
    gc.collect()
    rss_end, pids_end = resident_mb(), [resident_mb(p) for p in pids]
    threads_running = stream_threads()
    module.close()
    threads_closed = stream_threads()
    pids_after_close = still_alive(pids)
    dropped = make_module()
    dropped_pids = processes(dropped) if processes is not None else []
    with torch.inference_mode():
        dropped(*inputs)
    threads_dropped_running = stream_threads()
    del dropped
    gc.collect()
    time.sleep(0.2)  # the workers see their stop signal
    result = {"calls": calls, "warmup": warmup, "seconds": round(seconds, 2),
              "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
              "rss_growth_mb": round(rss_end - rss_start, 2), "rss_samples_mb": samples,
              "workers_before": threads_before, "workers_while_running": threads_running,
              "workers_after_close": threads_closed, "workers_second_module": threads_dropped_running,
              "workers_after_collect": stream_threads(), "fds_before": fds_before, "fds_after": open_descriptors()}
    if reference is not None:
        result["wrong"] = wrong
    if processes is not None:
        result.update({"processes": len(pids), "processes_rss_start_mb": [round(m, 1) for m in pids_start],
                       "processes_rss_growth_mb": [round(b - a, 2) for a, b in zip(pids_start, pids_end)],
                       "processes_after_close": len(pids_after_close),
                       "processes_after_collect": len(still_alive(dropped_pids))})
    return result


def process_table() -> dict[int, tuple[str, int, int]]:
    """Every live process (zombies left out): process id -> (name, parent's id, session id), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:].rsplit(")", 1)
        state, parent, _, session = rest.split()[:4]
        if state != "Z":
            table[int(entry)] = (name, int(parent), int(session))
    return table


def descendants(pid: int) -> dict[int, str]:
    """The live processes under ``pid`` (children, theirs, ...), by process id, with their names."""
    table = process_table()
    found: dict[int, str] = {}
    parents = [pid]
    while parents:
        parent = parents.pop()
        for p, (name, ppid, _) in table.items():
            if ppid == parent and p not in found:
                found[p] = name
                parents.append(p)
    return found


def session_processes(session: int) -> dict[int, str]:
    """The live processes of the session ``session``, by process id, with their names."""
    return {p: name for p, (name, _, s) in process_table().items() if s == session}


def still_alive(pids: Iterable[int], seconds: float = 10.0) -> list[int]:
    """Which of ``pids`` are still alive after up to ``seconds`` (ending takes a process a moment)."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in pids if p in process_table()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
