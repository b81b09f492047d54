"""Faults and Ctrl-C: a unit failing mid-run, ``opsched optimize`` interrupted at random moments."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from opsched.compare import compare_outputs
from opsched.graph.ir import Graph, Node
from opsched.runtime.cpu import UnitFailed
from opsched.runtime.kernels import unit_operator
from opsched.runtime.module import OptimizedModule
from support.process_watch import stream_threads
from support.small_models import HANG_SECONDS, call_with_deadline, schedule_all


class FailingOperator:
    """``unit_operator``, except that unit ``unit`` raises on the calls numbered in ``failing``."""

    def __init__(self, unit: str, failing: set[int], error: Exception | None = None):
        self.unit, self.failing, self.calls = unit, failing, 0
        self.error = error or RuntimeError("The size of tensor a (28) must match the size of tensor b (27)")
        self.lock = threading.Lock()

    def __call__(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        fn = unit_operator(nodes, threads)
        if self.unit not in [n.name for n in nodes]:
            return fn

        def maybe_failing(*args: Any) -> Any:
            with self.lock:
                self.calls += 1
                fail = self.calls in self.failing
            if fail:
                raise self.error
            return fn(*args)

        return maybe_failing


def fault_trial(model: torch.nn.Module, graph: Graph, inputs: tuple, method: str, unit: str,
                calls: int = 20, fail_every: int = 3) -> dict[str, Any]:
    """Run ``calls`` calls of ``method``'s schedule with ``unit`` failing on every ``fail_every``-th call:
    each failing call must raise one UnitFailed naming the unit and each other call must be right."""
    plan = schedule_all(graph)[method]
    failing = set(range(fail_every, calls + 1, fail_every))
    module = OptimizedModule(graph, plan, cores=2, operator=FailingOperator(unit, failing))
    with torch.inference_mode():
        want = model(*inputs)
    named = wrong = other = 0
    try:
        for _ in range(calls):
            try:
                got = call_with_deadline(module, inputs)
            except UnitFailed as e:
                named += e.unit.split("+").count(unit) == 1 and isinstance(e.__cause__, RuntimeError)
                continue
            except Exception:  # noqa: BLE001 - counted
                other += 1
                continue
            wrong += not compare_outputs(got, want).ok
        workers_busy = stream_threads()
    finally:
        module.close()
    return {"method": method, "unit": unit, "calls": calls, "injected": len(failing), "named": named,
            "wrong": wrong, "other_errors": other, "workers_while_open": workers_busy,
            "workers_after_close": stream_threads()}



MODEL_FILE = textwrap.dedent('''
    import torch

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.b = torch.nn.Conv2d(8, 8, 1)
            self.c = torch.nn.Conv2d(8, 8, 5, padding=2)
            self.d = torch.nn.Conv2d(24, 8, 1)

        def forward(self, x):
            return self.d(torch.cat([self.a(x).relu(), self.b(x).relu(), self.c(x).relu()], 1))

    def make():
        return Branches(), (torch.randn(1, 8, 32, 32),)
''')


def cache_rows(path: Path) -> list[tuple]:
    """Every row of the cache file, read with plain sqlite (raises if it is not readable). A file with no
    table at all holds no rows: a run stopped between sqlite creating the file and its first commit."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        if not db.execute("SELECT name FROM sqlite_master").fetchall():
            return []
        return sorted(db.execute("SELECT * FROM latency").fetchall())


def cache_reopens_cleanly(path: Path) -> bool:
    """The next run takes the cache file as it is: no warning, not moved aside, kept on disk."""
    from opsched.cost.cache import LatencyCache

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reopened = LatencyCache(path)
    reopened.close()
    return not reopened.in_memory


def interrupt_trial(workdir: Path, delay: float | None, seed_rows: bool = True) -> dict[str, Any]:
    """Start ``opsched optimize`` on a small model with a fresh cache and send SIGINT after ``delay``
    seconds (None: once the first measurement is in the cache). Check: exit 130 (or 0 when it finished
    first) with one line on stderr, the cache readable, the rows that were there before unchanged."""
    model = workdir / "branches.py"
    model.write_text(MODEL_FILE)
    cache = workdir / f"cache-{time.monotonic_ns()}"
    cache.mkdir()
    path = cache / "costs.sqlite"
    before: list[tuple] = []
    if seed_rows:
        from opsched.cost.cache import LatencyCache

        seeded = LatencyCache(path)
        seeded.put("cpu:another-machine", "unit:seed", "eager", 1, "1", 1.25, 9)
        seeded.close()
        before = cache_rows(path)
    env = dict(os.environ, OPSCHED_CACHE_DIR=str(cache))
    # --quiet: the trial checks what the interrupt is reported as, not the progress lines before it
    argv = [sys.executable, "-m", "opsched", "optimize", f"{model}:make", "--method", "ios", "--repeats", "3",
            "--out", str(workdir / f"plan-{time.monotonic_ns()}.json"), "--json", "--quiet"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if delay is None:
        while proc.poll() is None and len(_rows_or_empty(path)) <= len(before):
            time.sleep(0.02)
    else:
        time.sleep(delay)
    sent_after = time.perf_counter() - started
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"delay": delay, "hung": True, "stderr": err[-500:]}
    rows = cache_rows(path) if path.exists() else []  # interrupted before the cache was made
    reopens = cache_reopens_cleanly(path)
    lines = [line for line in err.splitlines() if line.strip()]
    return {"delay": delay, "signal_after_s": round(sent_after, 2), "exit": proc.returncode,
            "stderr_lines": len(lines), "stderr": lines[:3], "hung": False, "rows_after": len(rows),
            "seeded_rows_unchanged": all(r in rows for r in before), "stdout_json": is_json(out),
            "cache_reopens_cleanly": reopens}


def _rows_or_empty(path: Path) -> list[tuple]:
    try:
        return cache_rows(path)
    except (sqlite3.Error, AssertionError):
        return []


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
