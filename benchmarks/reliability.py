"""Reliability under load, faults and bad input (issue 14): the long runs behind docs/reliability.md.

    python benchmarks/reliability.py                # every suite at the documented size
    python benchmarks/reliability.py --quick        # a smaller size of each (about a minute)
    python benchmarks/reliability.py --only load soak

Suites: ``load`` (threads calling one OptimizedModule at once, every output compared with eager on the
same input), ``soak`` (thousands of calls: resident memory, threads, file descriptors), ``faults`` (a unit
failing mid-run, then the next call), ``interrupt`` (Ctrl-C at random moments of ``opsched optimize``),
``fuzz-models`` / ``fuzz-plans`` / ``fuzz-dags`` (hypothesis). For ``opsched map`` and mapped plans:
``fuzz-platforms`` / ``fuzz-mapping-dags`` / ``fuzz-mapped-plans`` (hypothesis), ``interrupt-map`` (Ctrl-C during
a MILP solve), ``time-limit-map`` (how far each method runs past ``--time-limit``), ``load-map`` / ``soak-map``
(``load`` and ``soak`` on a plan mapped onto ``cpu2``). For the Ray engine (``opsched run --engine ray``, a plan
mapped onto two nodes): ``soak-ray`` (the driver's and the actors' memory, the actors ending, Ray's processes),
``load-ray`` (threads calling one RayModule), ``interrupt-ray`` (Ctrl-C at random moments of a run on a local Ray),
``faults-ray`` (a unit failing in an actor). Each prints one JSON line of figures.

The fast tests in tests/test_reliability*.py import the helpers below and run them at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import io
import itertools
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.runtime.cpu import UnitFailed
from opsched.runtime.kernels import unit_operator
from opsched.evaluation import output_error
from opsched.runtime.module import OptimizedModule
from opsched.schedule import ScheduleError, from_dict, validate
from opsched.schedulers import SCHEDULERS, make_schedule

METHOD_OPTIONS = {"sequential": {}, "greedy": {}, "lios": {"streams": 3}, "nimble": {"streams": 3},
                  "ios": {"max_block_size": 8}, "exact": {"time_limit": 2.0}, "hivemind": {"streams": 3}}
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 6e-2}
HANG_SECONDS = 60.0


# -- small models built from a recipe --------------------------------------------------------------------------

OPS = ("conv3", "conv1", "relu", "add", "mul", "cat_conv", "inplace", "view", "pool", "sigmoid_gate")


class RecipeModel(torch.nn.Module):
    """A model of ``steps`` over ``inputs`` tensors of shape (1, C, S, S): each step applies an op to one or
    two earlier values (inputs count as values); ``outputs`` are the values returned, as a tuple, or as a
    dict when ``as_dict``. Every op keeps the shape, so any recipe is a valid model."""

    def __init__(self, steps: Sequence[tuple[str, int, int]], inputs: int, outputs: Sequence[int],
                 channels: int = 4, as_dict: bool = False):
        super().__init__()
        self.steps, self.inputs, self.outputs, self.as_dict = list(steps), inputs, list(outputs), as_dict
        self.layers = torch.nn.ModuleDict()
        for k, (op, _, _) in enumerate(self.steps):
            if op == "conv3":
                self.layers[str(k)] = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1),
                                                          torch.nn.BatchNorm2d(channels))
            elif op in ("conv1", "inplace"):
                self.layers[str(k)] = torch.nn.Conv2d(channels, channels, 1)
            elif op == "cat_conv":
                self.layers[str(k)] = torch.nn.Conv2d(2 * channels, channels, 1)
            elif op == "sigmoid_gate":
                self.layers[str(k)] = torch.nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, *xs: torch.Tensor) -> Any:
        values = list(xs)
        for k, (op, a, b) in enumerate(self.steps):
            x, y = values[a], values[b]
            if op in ("conv3", "conv1"):
                out = self.layers[str(k)](x)
            elif op == "relu":
                out = torch.relu(x)
            elif op == "add":
                out = x + y
            elif op == "mul":
                out = x * y
            elif op == "cat_conv":
                out = self.layers[str(k)](torch.cat([x, y], 1))
            elif op == "inplace":  # writes into a tensor it made itself, as ReLU(inplace=True) after a conv
                out = self.layers[str(k)](x)
                out.add_(y).relu_()
            elif op == "view":  # a view of a view, read through
                out = x.transpose(2, 3).flatten(2).view_as(x) * 0.5
            elif op == "pool":
                out = torch.nn.functional.max_pool2d(x, 3, stride=1, padding=1)
            else:  # a gate: the branch scales the other by sigmoid(conv(x))
                out = y * torch.sigmoid(self.layers[str(k)](x))
            values.append(out)
        picked = [values[i] for i in self.outputs]
        if self.as_dict:
            return {f"out{i}": v for i, v in enumerate(picked)}
        return picked[0] if len(picked) == 1 else tuple(picked)


@st.composite
def recipes(draw: st.DrawFn, max_steps: int = 9) -> dict[str, Any]:
    """A random recipe: 1-2 inputs (shared by several steps), branches, 1-3 outputs, a dtype."""
    inputs = draw(st.integers(1, 2))
    steps = []
    for k in range(draw(st.integers(1, max_steps))):
        available = inputs + k
        steps.append((draw(st.sampled_from(OPS)), draw(st.integers(0, available - 1)),
                      draw(st.integers(0, available - 1))))
    count = inputs + len(steps)
    outputs = sorted(set(draw(st.lists(st.integers(inputs, count - 1), min_size=0, max_size=2))) | {count - 1})
    return {"steps": steps, "inputs": inputs, "outputs": outputs, "as_dict": draw(st.booleans()),
            "dtype": draw(st.sampled_from(["float32", "float64", "bfloat16"])), "seed": draw(st.integers(0, 2**16))}


def build(recipe: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(recipe["seed"])
    dtype = getattr(torch, recipe["dtype"])
    model = RecipeModel(recipe["steps"], recipe["inputs"], recipe["outputs"], as_dict=recipe["as_dict"]).eval()
    model = model.to(dtype)
    inputs = tuple(torch.randn(1, 4, 6, 6, dtype=dtype) for _ in range(recipe["inputs"]))
    return model, inputs


def schedule_all(graph: Graph, seed: int = 0) -> dict[str, Any]:
    """Every scheduler's schedule of ``graph`` under random table latencies."""
    rng = random.Random(seed)
    for n in graph.nodes:
        n.latency = float(rng.randint(1, 9))
    cost = TableCost(graph, capacity=2)
    return {m: make_schedule(m, graph, cost, **METHOD_OPTIONS[m]) for m in SCHEDULERS}


def check_recipe(recipe: dict[str, Any]) -> int:
    """Capture, schedule with every scheduler, run and compare with eager; return the schedules run.
    Raises AssertionError on a wrong output; any other exception is a finding too."""
    model, inputs = build(recipe)
    with torch.inference_mode():
        want = model(*inputs)
    graph = capture(model, inputs)
    tolerance = TOLERANCE[inputs[0].dtype]
    runs = 0
    for method, plan in schedule_all(graph, recipe["seed"]).items():
        module = OptimizedModule(graph, plan, cores=2)
        try:
            with torch.inference_mode():
                got = call_with_deadline(module, inputs)
            error, _ = output_error(got, want)
            assert error <= tolerance, f"{method}: outputs differ by {error} on {recipe}"
        finally:
            module.close()
        runs += 1
    return runs


def call_with_deadline(fn: Callable[..., Any], args: Sequence[Any], seconds: float = HANG_SECONDS) -> Any:
    """``fn(*args)`` on another thread; a call that has not returned after ``seconds`` is a hang."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with torch.inference_mode():
                box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"hung: no return after {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- a model with branches for load, soak and faults ---------------------------------------------------------

def branchy(width: int = 3, depth: int = 2, channels: int = 8, size: int = 12
            ) -> tuple[torch.nn.Module, Graph, tuple[torch.Tensor, ...]]:
    """``width`` branches of ``depth`` convolutions on one input, concatenated: a graph with concurrent
    stages for every scheduler."""
    steps = []
    ends = []
    for _ in range(width):
        src = 0
        for _ in range(depth):
            steps.append(("conv3", src, src))
            src = len(steps)
        ends.append(src)
    acc = ends[0]
    for e in ends[1:]:
        steps.append(("cat_conv", acc, e))
        acc = len(steps)
    model = RecipeModel(steps, 1, [acc], channels=channels).eval()
    inputs = (torch.randn(2, channels, size, size),)
    return model, capture(model, inputs), inputs


def hammer(module: Callable[..., Any], reference: Callable[..., Any], make_input: Callable[[int], tuple],
           threads: int = 8, calls: int = 200, tolerance: float = 1e-4) -> dict[str, Any]:
    """Call ``module`` from ``threads`` threads at once, ``calls`` times each with a different input, and
    compare every output with ``reference`` on the same input (computed beforehand, one per input)."""
    seeds = [[t * calls + c for c in range(calls)] for t in range(threads)]
    with torch.inference_mode():
        expected = {s: reference(*make_input(s)) for row in seeds for s in row}
    wrong: list[tuple[int, float]] = []
    failures: list[str] = []
    barrier = threading.Barrier(threads)

    def worker(row: list[int]) -> None:
        barrier.wait()
        for s in row:
            try:
                with torch.inference_mode():
                    got = module(*make_input(s))
                error, _ = output_error(got, expected[s])
                if not error <= tolerance:
                    wrong.append((s, error))
            except Exception as e:  # noqa: BLE001 - counted, reported by the caller
                failures.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=worker, args=(row,), daemon=True) for row in seeds]
    started = time.perf_counter()
    for w in workers:
        w.start()
    deadline = started + HANG_SECONDS + threads * calls * 0.5
    for w in workers:
        w.join(max(0.0, deadline - time.perf_counter()))
    seconds = time.perf_counter() - started
    hung = sum(w.is_alive() for w in workers)
    return {"threads": threads, "calls_per_thread": calls, "calls": threads * calls, "wrong": len(wrong),
            "failed": len(failures), "first_failure": failures[0] if failures else None, "hung_threads": hung,
            "seconds": round(seconds, 2), "calls_per_second": round(threads * calls / seconds, 1)}


def seeded_input(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Callable[[int], tuple]:
    return lambda s: (torch.randn(*shape, generator=torch.Generator().manual_seed(s)).to(dtype),)


# -- soak: memory, threads, descriptors ------------------------------------------------------------------------

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
                wrong += not output_error(got, expected)[0] <= 1e-4
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


# -- faults ------------------------------------------------------------------------------------------------------

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
            wrong += not output_error(got, want)[0] <= 1e-4
        workers_busy = stream_threads()
    finally:
        module.close()
    return {"method": method, "unit": unit, "calls": calls, "injected": len(failing), "named": named,
            "wrong": wrong, "other_errors": other, "workers_while_open": workers_busy,
            "workers_after_close": stream_threads()}


# -- Ctrl-C during opsched optimize ------------------------------------------------------------------------------

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
    """Every row of the cache file, read with plain sqlite (raises if it is not readable)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return sorted(db.execute("SELECT * FROM latency").fetchall())


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
    lines = [line for line in err.splitlines() if line.strip()]
    return {"delay": delay, "signal_after_s": round(sent_after, 2), "exit": proc.returncode,
            "stderr_lines": len(lines), "stderr": lines[:3], "hung": False, "rows_after": len(rows),
            "seeded_rows_unchanged": all(r in rows for r in before), "stdout_json": _is_json(out)}


def _rows_or_empty(path: Path) -> list[tuple]:
    try:
        return cache_rows(path)
    except (sqlite3.Error, AssertionError):
        return []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# -- fuzzing plans and DAG JSON ----------------------------------------------------------------------------------

def simulate_program(plan: Any, graph: Graph) -> None:
    """Execute the StreamProgram of ``plan`` symbolically: raise AssertionError if a unit runs before one
    of its inputs or the streams deadlock. Independent of the validator: what it accepts must pass this."""
    from opsched.runtime.program import Record, Run, Wait, compile_program

    program = compile_program(plan, graph, cores=2)
    done: set[int] = set()
    recorded: set[int] = set()
    position = [0] * len(program.streams)
    ran = 0
    while any(p < len(s) for p, s in zip(position, program.streams)):
        progressed = False
        for k, steps in enumerate(program.streams):
            while position[k] < len(steps):
                step = steps[position[k]]
                if isinstance(step, Wait):
                    if step.event not in recorded:
                        break
                elif isinstance(step, Record):
                    recorded.add(step.event)
                elif isinstance(step, Run):
                    for u in step.units:
                        for a in graph.nodes[u].args:
                            if a in graph.index and graph.index[a] not in done and graph.index[a] not in step.units:
                                raise AssertionError(f"unit {graph.nodes[u].name} runs before its input {a}")
                    done.update(step.units)
                    ran += len(step.units)
                position[k] += 1
                progressed = True
        if not progressed:
            raise AssertionError("the program deadlocks")
    assert ran == len(graph) and done == set(range(len(graph))), "a unit runs twice or never"


MUTATIONS = ("drop_op", "duplicate_op", "rename_op", "swap_stages", "merge_stage", "move_unit", "stream",
             "time", "format", "truncate", "drop_key", "retype", "threads")


def mutate(doc: dict[str, Any], rng: random.Random, kind: str) -> str:
    """Edit a plan's JSON by hand as a user might (or break it); return the text to load."""
    doc = json.loads(json.dumps(doc))
    ops, stages = doc["ops"], doc.get("stages")
    if kind == "drop_op" and ops:
        ops.pop(rng.randrange(len(ops)))
    elif kind == "duplicate_op" and ops:
        ops.append(dict(rng.choice(ops)))
    elif kind == "rename_op" and ops:
        rng.choice(ops)["name"] = rng.choice(["nope", ops[0]["name"], ""])
    elif kind == "swap_stages" and stages and len(stages) > 1:
        i, j = rng.sample(range(len(stages)), 2)
        stages[i], stages[j] = stages[j], stages[i]
    elif kind == "merge_stage" and stages:
        rng.choice(stages)["strategy"] = rng.choice(["merge", "bogus", "concurrent"])
    elif kind == "move_unit" and stages:
        src, dst = rng.choice(stages), rng.choice(stages)
        group = rng.choice(src["groups"])
        unit = group.pop(rng.randrange(len(group)))
        src.pop("threads", None)
        dst.pop("threads", None)
        rng.choice(dst["groups"]).append(unit)
        if not group and rng.random() < 0.5:  # otherwise the empty group stays, for the validator to refuse
            src["groups"].remove(group)
    elif kind == "stream" and ops:
        rng.choice(ops)["stream"] = rng.choice([-1, 0, 1, 2, 7, 10**12, "1", 1.5])
    elif kind == "time" and ops:
        op = rng.choice(ops)
        op[rng.choice(["start", "finish"])] = rng.choice([0.0, -5.0, 1e308, float("nan"), float("inf"), 1e9, "x"])
    elif kind == "format":
        doc["format"] = rng.choice(["opsched.schedule/2", "opsched.schedule/0", None, 1])
    elif kind == "drop_key":
        doc.pop(rng.choice(["ops", "graph", "method", "predicted_latency", "stages", "format"]), None)
    elif kind == "retype":
        key = rng.choice(["ops", "stages", "graph", "options", "stats", "batch"])
        doc[key] = rng.choice([None, 3, "text", [], {}, [[1]], {"a": 1}])
    elif kind == "threads" and stages:
        stage = rng.choice(stages)
        stage["threads"] = rng.choice([[[0]], [[1, 2, 3, 4]], [[-1] * len(g) for g in stage["groups"]],
                                       [[2] * len(g) for g in stage["groups"]], "x"])
    text = json.dumps(doc, indent=1)
    if kind == "truncate":
        text = text[:rng.randrange(len(text))]
    return text


def check_plan_text(text: str, graph: Graph, run: Callable[[Any], None] | None = None) -> str:
    """Load an edited plan: it is refused with a ScheduleError, or accepted and then correct (simulated
    and, with ``run``, executed). Returns "refused" or "accepted"; anything else raises."""
    from opsched.jsonfile import parse_json

    try:
        plan = from_dict(parse_json(text, "plan.json", ScheduleError), "plan.json")
        validate(plan, graph)
    except ScheduleError as e:
        assert "\n" not in str(e), f"a refusal of more than one line: {e}"
        return "refused"
    simulate_program(plan, graph)
    if run is not None:
        run(plan)
    return "accepted"


@st.composite
def dag_documents(draw: st.DrawFn) -> Any:
    """DAG JSON documents: mostly well formed, with one random defect in some, or any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                             max_size=4),
                                 max_leaves=12))
    n = draw(st.integers(0, 12))
    names = [f"v{i}" for i in range(n)]
    nodes: list[Any] = [{"name": name, "latency": draw(st.floats(0, 100))} for name in names]
    edges: list[Any] = [[names[i], names[j]] for i in range(n) for j in range(i + 1, n) if draw(st.booleans())]
    defect = draw(st.sampled_from(["none", "none", "none", "latency", "duplicate", "unknown_edge", "cycle",
                                   "self_loop", "edge_shape", "node_type", "missing_name", "kind", "extra"]))
    if defect == "latency" and nodes:
        draw(st.sampled_from(nodes))["latency"] = draw(st.sampled_from([-1, "fast", None, float("nan"), [], 1e400]))
    elif defect == "duplicate" and nodes:
        nodes.append(dict(draw(st.sampled_from(nodes))))
    elif defect == "unknown_edge" and nodes:
        edges.append([names[0], "ghost"])
    elif defect == "cycle" and len(edges) > 0:
        a, b = draw(st.sampled_from(edges))
        edges.append([b, a])
    elif defect == "self_loop" and nodes:
        edges.append([names[0], names[0]])
    elif defect == "edge_shape":
        edges.append(draw(st.sampled_from([["v0"], "v0->v1", ["v0", "v1", "v2"], [1, 2], None])))
    elif defect == "node_type":
        nodes.append(draw(st.sampled_from(["v9", 3, None, ["v9"]])))
    elif defect == "missing_name" and nodes:
        del draw(st.sampled_from(nodes))["name"]
    elif defect == "kind" and nodes:
        draw(st.sampled_from(nodes))["kind"] = draw(st.sampled_from([3, None, "conv", ""]))
    elif defect == "extra" and nodes:
        draw(st.sampled_from(nodes))["flops"] = draw(st.sampled_from(["many", -3, 1e30]))
    return {"nodes": nodes, "edges": edges}


def check_dag_document(doc: Any, method: str, directory: Path) -> str:
    """Run ``opsched schedule`` on the document: exit 0 with a JSON result, or exit 2 with one line on
    stderr; never a traceback. Returns "scheduled" or "refused"."""
    from opsched.cli import main

    path = directory / "dag.json"
    text = json.dumps(doc) if not isinstance(doc, str) else doc
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["schedule", str(path), "--method", method, "--json"] +
                    (["--time-limit", "2"] if method == "exact" else []))
    if code == 0:
        result = json.loads(out.getvalue())
        assert math.isfinite(result["predicted_latency"]), result
        return "scheduled"
    assert code == 2 and err.getvalue().count("\n") == 1 and err.getvalue().startswith("opsched: error: "), \
        (code, err.getvalue())
    return "refused"


# -- opsched map: platforms, mapping DAGs, mapped plans, Ctrl-C and time limits of the solvers -------------------

MAP_METHODS = ("best-device", "met", "greedy", "heft", "sa", "ea", "milp", "milp-split")


def cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """``opsched ARGV`` in this process (the command line's own ``main``): exit status, stdout, stderr."""
    from opsched.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse refusing an option exits; nothing else should
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_refused(code: int, out: str, err: str, what: Any = "") -> None:
    """Bad input: exit 2, nothing on stdout, exactly one line on stderr, no traceback."""
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("opsched: error: ") \
        and "Traceback" not in err, (what, code, out[:200], err[-2000:])


def mapping_problem(dag: Path, platform: Path, objective: str = "latency", batch: int = 1) -> Any:
    """The problem ``opsched map DAG --platform PLATFORM`` solves, built as the command builds it."""
    from opsched.mapping import graphfile
    from opsched.mapping.platform import load_platform
    from opsched.mapping.problem import build_problem

    graph, latencies, edge_bytes = graphfile.read(str(dag))
    return build_problem(graph, load_platform(str(platform)), objective, batch, latencies or None, edge_bytes or None)


def rounding(problem: Any) -> float:
    """How far a proven-optimal MILP may be above the true optimum: CP-SAT works on times rounded to steps of
    about 1e-6 of the longest possible schedule, one rounding per job and transfer."""
    horizon = sum(max(t for row in problem.times[u] for t in row if math.isfinite(t)) for u in range(problem.n))
    horizon += sum(max((problem.comm(a, b, x, y, 1) for x in range(problem.devices) for y in range(problem.devices)),
                       default=0.0) for a, b in problem.graph.edges)
    return 1e-9 + 1e-6 * horizon * (problem.n * problem.pieces + len(problem.graph.edges))


def check_mapped(result: dict[str, Any], problem: Any) -> None:
    """What ``opsched map --json`` printed is a valid mapping of ``problem``: every piece of every unit placed
    once (``mapping.plan.check``), on each device one job at a time, each job after its inputs have arrived
    (transfer times included, from the printed times, independent of the simulator), and ``predicted`` and
    every printed time equal to the replay of that mapping; the lower bound is below its makespan."""
    from opsched.mapping.plan import Job, Mapping, check
    from opsched.mapping.replay import replay

    graph, names = problem.graph, problem.platform.names
    per_piece = problem.batch // problem.pieces
    pieces: dict[tuple[int, int, float, float], list[int]] = {}
    for p in result["placements"]:
        first, count = p["inputs"]
        key = (graph.index[p["name"]], names.index(p["device"]), p["start"], p["finish"])
        pieces.setdefault(key, []).extend(range(first // per_piece, (first + count) // per_piece))
    times = {Job(u, d, tuple(sorted(qs))): (s, f) for (u, d, s, f), qs in pieces.items()}
    order: list[list[Job]] = [[] for _ in names]
    for job in sorted(times, key=lambda j: (times[j], j.unit)):
        order[job.device].append(job)
    mapping = Mapping(order)
    check(problem, mapping)
    timeline = replay(problem, mapping)
    tolerance = 1e-9 * max(1.0, timeline.makespan)
    for job, (s, f) in times.items():
        assert abs(timeline.start[job] - s) <= tolerance and abs(timeline.finish[job] - f) <= tolerance, job
    assert abs(result["makespan"] - timeline.makespan) <= tolerance, (result["makespan"], timeline.makespan)
    assert result["predicted"] == problem.objective_value(timeline.makespan), result["predicted"]
    job_of = {(j.unit, q): j for j in times for q in j.pieces}
    for a, b in graph.edges:
        for q in range(problem.pieces):
            ja, jb = job_of[(a, q)], job_of[(b, q)]
            arrives = times[ja][1] + problem.comm(a, b, ja.device, jb.device, 1)
            assert times[jb][0] >= arrives - tolerance, (graph.nodes[a].name, graph.nodes[b].name, q)
    for jobs in order:
        for x, y in itertools.pairwise(jobs):
            assert times[y][0] >= times[x][1] - tolerance, (x, y)
    assert result["lower_bound"] <= timeline.makespan + tolerance, (result["lower_bound"], timeline.makespan)


# A small DAG for the platform documents: plain latencies (times each device's scale), edge bytes, and 100 bytes
# of memory per unit, so that memory budgets, bandwidths and link latencies all matter.
PLATFORM_DAG = {"nodes": [{"name": "a", "latency": 2.0, "bytes": 100}, {"name": "b", "latency": 3.0, "bytes": 100},
                          {"name": "c", "latency": 1.5, "bytes": 100}, {"name": "d", "latency": 2.5, "bytes": 100}],
                "edges": [["a", "b", 40], ["a", "c", 10], ["b", "d", 25], ["c", "d"]]}
PLATFORM_DEFECTS = ("none", "none", "none", "none", "missing_name", "duplicate_name", "bad_name", "kind", "memory",
                    "bandwidth", "latency", "threads", "batch_sizes", "scale", "unknown_link", "disconnected",
                    "links_type", "link_value", "devices_type", "device_type", "top_level", "truncate", "extra")
ODD_NUMBERS = (-1, 0, -0.5, "2", "fast", None, True, [], {}, float("nan"), float("inf"), float("-inf"), 1e-300)


def platform_document(seed: int) -> tuple[str, str]:
    """PLATFORM.json text and the defect put in: mostly well formed (1-4 devices; kinds, memory, threads, batch
    sizes, scales, nodes, links by pair, by node class and by default), some with one defect, some any JSON.
    Every choice comes from ``seed`` (hypothesis draws the seeds: each defect and odd value equally often)."""
    rng = random.Random(seed)
    if rng.random() < 0.05:
        return json.dumps(_any_json(rng, 3)), "any"
    count = rng.randint(1, 4)
    devices: list[Any] = []
    for i in range(count):
        device: dict[str, Any] = {"name": f"d{i}"}
        for key, values in (("kind", ["cpu", "sim:a100", "sim:t4", "sim:xeon"]), ("memory", [1e3, 1e6, "inf", 400]),
                            ("threads", [1, 2, 4]), ("batch_sizes", [[1], [1, 2, 4]]), ("scale", [0.5, 1, 3]),
                            ("node", ["n0", "n1"])):
            if rng.random() < 0.5:
                device[key] = rng.choice(values)
        devices.append(device)
    link = {"bandwidth": rng.choice([1, 10, 1e9, "inf"]), "latency": rng.choice([0, 0.5, 2])}
    links: dict[str, Any] = {}
    style = rng.choice(["default", "pairs", "classes"])
    if style == "default":
        links["default"] = link
    elif style == "classes":
        links.update({"intra-node": link, "inter-node": {**link, "latency": 1}})
    else:
        links.update({f"d{i}-d{j}": link for i in range(count) for j in range(i + 1, count)})
    doc: Any = {"name": "fuzz", "devices": devices, "links": links}
    defect = rng.choice(PLATFORM_DEFECTS)
    target = rng.choice(devices)
    if defect == "missing_name":
        del target["name"]
    elif defect == "duplicate_name":
        target["name"] = devices[0]["name"]
    elif defect == "bad_name":
        target["name"] = rng.choice(["", 3, None, ["d0"]])
    elif defect == "kind":
        target["kind"] = rng.choice(["gpu", "sim:nope", "cuda:x", "cuda:", "CPU", "", 3, None, ["cpu"]])
    elif defect in ("memory", "threads", "scale"):
        target[defect] = rng.choice([*ODD_NUMBERS, 1.5, 10**30])
    elif defect == "batch_sizes":
        target[defect] = rng.choice([[], [0], [-4], "4", [1.5], [True], [2], 4, None])
    elif defect in ("bandwidth", "latency"):
        key = rng.choice(sorted(links) or ["default"])  # one device by pairs has no link
        links[key] = {**links.get(key, link), defect: rng.choice(ODD_NUMBERS)}
        if rng.random() < 0.2:
            del links[key][defect]
    elif defect == "unknown_link":
        links[rng.choice(["d0-ghost", "ghost-d0", "d0d1", "d0-d0", "-", "", "d0-d1-d2"])] = link
    elif defect == "disconnected":
        links.clear()
        if rng.random() < 0.5:
            links["d0-d1"] = link
    elif defect == "links_type":
        doc["links"] = rng.choice([[], "default", 3, None, [link]])
    elif defect == "link_value":
        links[rng.choice(sorted(links) or ["default"])] = rng.choice([3, {}, {"latency": 1}, [], None, "fast"])
    elif defect == "devices_type":
        doc["devices"] = rng.choice([[], {}, "d0", None, 3])
    elif defect == "device_type":
        devices[rng.randrange(count)] = rng.choice(["d0", 3, None, [], True])
    elif defect == "top_level":
        doc = rng.choice([[doc], "platform", 3, None, True])
    elif defect == "extra":
        target[rng.choice(["colour", "speed"])] = rng.choice([1, "x", None])
    text = json.dumps(doc)
    if defect == "truncate":
        text = text[:rng.randrange(len(text))]
    return text, defect


def _any_json(rng: random.Random, depth: int) -> Any:
    """Any JSON value, at most ``depth`` deep; objects' keys mostly a platform's or a plan's."""
    kind = rng.randrange(7 if depth > 0 else 5)
    if kind < 5:
        return [None, rng.random() < 0.5, rng.randint(-3, 10**6), rng.uniform(-1e6, 1e6), "d0"][kind]
    if kind == 5:
        return [_any_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["devices", "links", "name", "default", "x"]): _any_json(rng, depth - 1)
            for _ in range(rng.randint(0, 3))}


def check_platform_document(text: str, directory: Path, method: str = "heft", subprocess_too: bool = False) -> str:
    """Map :data:`PLATFORM_DAG` onto the platform ``text`` through the command line: exit 0 with a valid mapping
    (:func:`check_mapped`), or exit 2 with one line; never a traceback. Returns "mapped" or "refused"."""
    dag, platform = directory / "platform-dag.json", directory / "platform.json"
    dag.write_text(json.dumps(PLATFORM_DAG))
    platform.write_text(text)
    argv = ["map", str(dag), "--platform", str(platform), "--method", method, "--time-limit", "1", "--json"]
    code, out, err = cli(argv)
    if subprocess_too:  # the real executable agrees with the in-process entry
        done = subprocess.run([sys.executable, "-m", "opsched", *argv], capture_output=True, text=True,
                              timeout=HANG_SECONDS, check=False)
        assert (done.returncode, done.stderr) == (code, err), (done.returncode, done.stderr, code, err)
    if code != 0:
        assert_refused(code, out, err, text)
        return "refused"
    check_mapped(json.loads(out), mapping_problem(dag, platform))
    return "mapped"


MAPPING_DAG_DEFECTS = ("none", "none", "none", "none", "none", "missing_device", "unknown_device", "empty_latency",
                       "latency_value", "latency_type", "bytes_value", "cycle", "self_loop", "edge_shape",
                       "unknown_edge", "node_bytes")


def mapping_case(seed: int, max_units: int = 7) -> dict[str, Any]:
    """A DAG JSON for mapping (latency objects per device, or a plain latency; edge bytes on some edges), its
    platform (2-3 devices), an objective and batch, and at most one defect, recorded in ``defect`` (only when
    it was put in: a defect that needs something the graph lacks is left out). Every choice comes from ``seed``."""
    rng = random.Random(seed)
    devices = ["x", "y", "z"][:rng.randint(2, 3)]
    platform = {"devices": [{"name": d} for d in devices],
                "links": {"default": {"bandwidth": rng.choice([1, 2, 4]), "latency": rng.choice([0, 0.5, 1])}}}
    names = [f"v{i}" for i in range(rng.randint(1, max_units))]
    nodes: list[Any] = []
    for name in names:
        if rng.random() < 0.2:
            nodes.append({"name": name, "latency": rng.randint(0, 48) / 4})
        else:
            nodes.append({"name": name, "latency": {d: rng.randint(0, 48) / 4 for d in devices}})
    edges: list[Any] = []
    for j, b in enumerate(names):
        for a in names[:j]:
            if rng.random() < 0.35:
                edges.append([a, b] + ([rng.randint(0, 10)] if rng.random() < 0.5 else []))
    objective, batch = rng.choice([("latency", 1)] * 3 + [("throughput", 4), ("throughput", 8)])
    defect = rng.choice(MAPPING_DAG_DEFECTS)
    per_device = [n for n in nodes if isinstance(n["latency"], dict)]
    applied = defect
    if defect == "missing_device" and per_device:
        del rng.choice(per_device)["latency"][rng.choice(devices)]
    elif defect == "unknown_device" and per_device:
        rng.choice(per_device)["latency"]["w"] = 1.0
    elif defect == "empty_latency":
        rng.choice(nodes)["latency"] = {}
    elif defect == "latency_value" and per_device:
        rng.choice(per_device)["latency"][rng.choice(devices)] = rng.choice(
            [-1, "fast", None, True, [], float("nan"), float("inf")])
    elif defect == "latency_type":
        rng.choice(nodes)["latency"] = rng.choice([[1, 2], "fast", None, -3, float("nan")])
    elif defect == "bytes_value" and edges:
        rng.choice(edges)[2:] = [rng.choice([-1, "many", None, True, [], float("nan"), float("inf")])]
    elif defect == "cycle" and edges:
        a, b = rng.choice(edges)[:2]
        edges.append([b, a] + ([3] if rng.random() < 0.5 else []))
    elif defect == "self_loop":
        edges.append([names[0], names[0], 1])
    elif defect == "edge_shape":
        edges.append(rng.choice([[names[0]], [names[0], names[-1], 1, 2], f"{names[0]}->{names[-1]}", [1, 2, 3],
                                 None]))
    elif defect == "unknown_edge":
        edges.append([names[0], "ghost", 3])
    elif defect == "node_bytes":
        rng.choice(nodes)["bytes"] = rng.choice([-5, "lots", None, float("nan"), float("inf")])
    else:
        applied = "none"
    return {"dag": {"nodes": nodes, "edges": edges}, "platform": platform, "objective": objective, "batch": batch,
            "defect": applied}


def check_mapping_case(case: dict[str, Any], directory: Path, methods: Sequence[str] = MAP_METHODS,
                       time_limit: float = 0.5) -> dict[str, Any]:
    """A defective case is refused in one line; a well-formed one maps with every method in ``methods``, and the
    answers hold: each mapping valid with ``predicted`` its replay (:func:`check_mapped`), every lower bound
    below every method's makespan, no method below one proven optimal, ``optimal`` claimed only by the MILPs
    (the MILP's only when CP-SAT's status is OPTIMAL). Returns what happened, for the counts."""
    dag, platform = directory / "map-dag.json", directory / "map-platform.json"
    dag.write_text(json.dumps(case["dag"]))
    platform.write_text(json.dumps(case["platform"]))
    argv = ["map", str(dag), "--platform", str(platform), "--objective", case["objective"], "--batch",
            str(case["batch"]), "--time-limit", str(time_limit), "--json", "--method"]
    if case["defect"] != "none":
        assert_refused(*cli([*argv, methods[0]]), case)
        return {"refused": 1}
    problem = mapping_problem(dag, platform, case["objective"], case["batch"])
    results = {}
    for method in methods:
        code, out, err = cli([*argv, method])
        assert code == 0, (method, case, code, err)
        results[method] = json.loads(out)
        check_mapped(results[method], problem)
    best = min(r["makespan"] for r in results.values())
    slack = rounding(problem)
    proven = 0
    for method, r in results.items():
        assert r["lower_bound"] <= best + slack, (method, r["lower_bound"], best)
        if r["optimal"]:
            proven += 1
            assert method in ("milp", "milp-split") and r["makespan"] <= best + slack, (method, r["makespan"], best)
            assert method != "milp" or r["stats"]["status"] == "OPTIMAL", r["stats"]
    return {"mapped": 1, "proven_optimal": proven, "answers": len(results)}


# Hand edits of a mapped plan (``opsched map MODEL --out plan.json``), as for plans above but for what a mapped plan
# adds in its devices section: the platform's devices (stream k runs on device k), their kinds and threads, the
# transfers, the jobs of a split batch and the figures.
MAPPED_MUTATIONS = ("drop_op", "duplicate_op", "stream", "move_op", "device_name", "platform_devices", "device_kind",
                    "device_threads", "time", "format", "truncate", "split_batch", "section", "options",
                    "transfers", "figures", "batch", "fingerprint")


def mutate_mapped(doc: dict[str, Any], rng: random.Random, kind: str) -> str:
    """Edit a mapped plan's JSON by hand as a user might (or break it); return the text to load."""
    doc = json.loads(json.dumps(doc))
    ops, section = doc["ops"], doc["devices"]
    listed = section["platform"]["devices"]
    names = [d["name"] for d in listed]
    if kind == "drop_op":
        ops.pop(rng.randrange(len(ops)))
    elif kind == "duplicate_op":
        ops.append(dict(rng.choice(ops)))
    elif kind == "stream":
        rng.choice(ops)["stream"] = rng.choice([-1, len(listed), len(listed) + 1, len(ops) - 1, len(ops), 10**12,
                                                "1", 1.5, None])
    elif kind == "move_op":  # onto another device, its times kept
        rng.choice(ops)["stream"] = rng.randrange(len(listed))
    elif kind == "device_name":
        new = rng.choice(["gpu9", names[0], names[-1], "", 3, None])
        if rng.random() < 0.5 or not section["transfers"]:
            rng.choice(listed)["name"] = new
        else:
            rng.choice(section["transfers"])[rng.choice(["from_device", "to_device"])] = new
    elif kind == "platform_devices":
        section["platform"]["devices"] = rng.choice([listed[:-1], [], None, listed[0], listed + [dict(listed[0])],
                                                     [1, 2], listed[::-1]])
    elif kind == "device_kind":
        rng.choice(listed)["kind"] = rng.choice(["sim:a100", "sim:t4", "cuda:0", None, "tpu", 3, "cpu"])
    elif kind == "device_threads":
        rng.choice(listed)["threads"] = rng.choice([0, -1, "x", 10**9, 1.5, 2, True, None, {"cpu0": 1}])
    elif kind == "time":
        op = rng.choice(ops)
        op[rng.choice(["start", "finish"])] = rng.choice([-5.0, 0.0, float("nan"), float("inf"), 1e308, "x", None])
    elif kind == "format":
        doc["format"] = rng.choice(["opsched.schedule/2", "opsched.schedule/0", None, 1])
    elif kind == "split_batch":
        op = rng.choice(ops)
        job = {"name": op["name"], "device": names[0], "start": op["start"], "finish": op["finish"], "pieces": [0]}
        section["jobs"] = rng.choice([None, "x", [{}], [3], [job], [dict(job, pieces=[9])], [dict(job, device="x")]])
    elif kind == "section":
        doc["devices"] = rng.choice([None, False, "yes", 0, [], {}])
    elif kind == "options":
        doc["options"] = rng.choice([None, [], "x", 3, {}, {"mapping": True}])
    elif kind == "transfers":
        if rng.random() < 0.5 or not section["transfers"]:
            section["transfers"] = rng.choice([None, "x", [{}], [3]])
        else:
            rng.choice(section["transfers"])[rng.choice(["start", "finish", "value", "inputs"])] = rng.choice(
                ["x", None, -1, [], "nope"])
        if rng.random() < 0.3:
            section["platform"] = rng.choice([None, "cpu2", {}, [], {"name": 3}])
    elif kind == "figures":
        where, key = rng.choice([(section, "optimal"), (section, "objective"), (section, "time_unit"),
                                 (section, "pieces"), (doc["bounds"], "lower_bound"), (doc, "predicted_latency")])
        where[key] = rng.choice([None, "x", [], -1.0, float("nan"), {}])
    elif kind == "batch":
        doc["batch"] = rng.choice([2, 0, -1, "x", None, 1.5, []])
    elif kind == "fingerprint":
        doc["graph"]["fingerprint"] = rng.choice(["0" * 16, None, 3])
    text = json.dumps(doc, indent=1)
    if kind == "truncate":
        text = text[:rng.randrange(len(text))]
    return text


def mapped_plans(directory: Path, spec: str) -> dict[str, dict[str, Any]]:
    """Mapped plans of the model ``spec`` written by ``opsched map --out``: HEFT and the MILP on ``cpu2`` (two real
    CPU devices), the MILP for throughput (batch 4, which may split it), HEFT on the simulated ``diviml``."""
    plans = {}
    for name, extra in (("heft", ["--method", "heft"]), ("milp", ["--method", "milp", "--time-limit", "1"]),
                        ("throughput", ["--method", "milp", "--time-limit", "1", "--objective", "throughput",
                                        "--batch", "4"]),
                        ("simulated", ["--method", "heft", "--platform", "diviml"])):
        path = directory / f"mapped-{name}.json"
        platform = [] if "--platform" in extra else ["--platform", "cpu2"]
        code, _, err = cli(["map", spec, *platform, *extra, "--out", str(path), "--force", "--json"])
        assert code == 0, err
        plans[name] = json.loads(path.read_text())
    return plans


def check_mapped_plan_text(text: str, directory: Path, spec: str, gantt: bool = False) -> dict[str, str]:
    """Give an edited mapped plan to ``opsched show`` (JSON and table; ``--trace``, and ``--gantt`` when asked) and
    to ``opsched run MODEL --plan``: each refuses it in one line (exit 2) or accepts it, show then printing its
    summary and run verifying it against eager (exit 0). Returns each command's verdict."""
    plan = directory / "edited.json"
    plan.write_text(text)
    trace, png = directory / "trace.json", directory / "gantt.png"
    verdict = {}
    show = ["show", str(plan), "--trace", str(trace), "--force"] + (["--gantt", str(png)] if gantt else [])
    code, out, err = cli([*show, "--json"])
    if code == 0:
        json.loads(out)
        code, out, err = cli(show)  # the table too
        assert code == 0 and out, (code, err[-2000:])
        verdict["show"] = "accepted"
    else:
        assert_refused(code, out, err, text[:300])
        verdict["show"] = "refused"
    code, out, err = cli(["run", spec, "--plan", str(plan), "--repeats", "1", "--json"])
    if code == 0:
        result = json.loads(out)
        assert result["max_abs_error"] <= 1e-3, result
        verdict["run"] = "accepted"
    else:
        assert_refused(code, out, err, text[:300])
        verdict["run"] = "refused"
    return verdict


def big_mapping_problem(directory: Path, units: int = 150, seed: int = 1) -> tuple[Path, Path]:
    """A DAG JSON of ``units`` units, each reading some of the six before it, with integer costs on three devices
    and edge bytes, and its platform: CP-SAT proves nothing about it within many seconds."""
    rng = random.Random(seed)
    devices = ("a", "b", "c")
    nodes = [{"name": f"v{i}", "latency": {d: rng.randint(1, 20) for d in devices}} for i in range(units)]
    edges = [[f"v{j}", f"v{i}", rng.randint(0, 10)] for i in range(units) for j in range(max(0, i - 6), i)
             if rng.random() < 0.3]
    dag, platform = directory / f"big-{units}.json", directory / "big-platform.json"
    dag.write_text(json.dumps({"nodes": nodes, "edges": edges}))
    platform.write_text(json.dumps({"devices": [{"name": d} for d in devices],
                                    "links": {"default": {"bandwidth": 1, "latency": 1}}}))
    return dag, platform


def chained_mapping_problem(directory: Path, modules: int = 2, width: int = 22, seed: int = 1) -> tuple[Path, Path]:
    """``modules`` modules of ``width`` sparsely linked units, each module read from the one unit that ends the
    module before: MILP-SPLIT's exact path (cut units), each module's MILP for each pair of devices a second or
    more of CP-SAT (cut units are found at once, where a graph without them spends seconds in its decomposition)."""
    rng = random.Random(seed)
    devices = ("a", "b", "c")
    nodes: list[dict[str, Any]] = [{"name": "in", "latency": {d: 1 for d in devices}}]
    edges: list[list[Any]] = []
    cut = "in"
    for m in range(modules):
        names = [f"m{m}u{i}" for i in range(width)]
        for i, name in enumerate(names):
            nodes.append({"name": name, "latency": {d: rng.randint(1, 20) for d in devices}})
            preds = [names[j] for j in range(max(0, i - 4), i) if rng.random() < 0.08] or [cut]
            edges += [[p, name, rng.randint(0, 10)] for p in preds]
        cut = f"m{m}out"
        nodes.append({"name": cut, "latency": {d: 1 for d in devices}})
        edges += [[name, cut, rng.randint(0, 10)] for name in names]
    dag, platform = directory / f"chained-{modules}x{width}.json", directory / "big-platform.json"
    dag.write_text(json.dumps({"nodes": nodes, "edges": edges}))
    platform.write_text(json.dumps({"devices": [{"name": d} for d in devices],
                                    "links": {"default": {"bandwidth": 1, "latency": 1}}}))
    return dag, platform


def no_process_left(group: int) -> bool:
    """Whether the session ``group`` (a command started in a session of its own) has no process left, those that
    made process groups of their own (as Ray's workers do) included."""
    return not session_processes(group)


def map_interrupt_trial(directory: Path, method: str, delay: float, time_limit: float = 30.0,
                        units: int = 150) -> dict[str, Any]:
    """Start ``opsched map`` with ``method`` on :func:`big_mapping_problem` (MILP-SPLIT: on
    :func:`chained_mapping_problem`, so that the signal finds it solving) and send SIGINT after ``delay`` seconds.
    Check: exit 130 with the one line ``opsched: interrupted`` (or 0 with its JSON when it finished first), no
    traceback, ``--out`` absent or a complete plan, no process of its session left, and how soon it stopped."""
    dag, platform = chained_mapping_problem(directory) if method == "milp-split" else big_mapping_problem(directory, units)
    out = directory / f"plan-{time.monotonic_ns()}.json"
    # --quiet: the trial checks what the interrupt is reported as, not MILP-SPLIT's progress lines before it
    argv = [sys.executable, "-m", "opsched", "map", str(dag), "--platform", str(platform), "--method", method,
            "--time-limit", str(time_limit), "--out", str(out), "--json", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(delay)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(signal.SIGINT)
    signalled = time.perf_counter()
    try:
        stdout, stderr = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"method": method, "delay": delay, "hung": True, "stderr": stderr[-500:]}
    stopped_after = time.perf_counter() - signalled
    plan = "absent"
    if out.exists():
        try:
            from opsched.schedule import load

            load(out)
            plan = "complete"
        except ScheduleError:
            plan = "truncated"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {"method": method, "delay": round(delay, 2), "signalled": sent, "exit": proc.returncode,
            "stderr": lines[:3], "stderr_lines": len(lines), "hung": False, "stopped_after_s": round(stopped_after, 2),
            "plan": plan, "stdout_json": _is_json(stdout), "no_process_left": no_process_left(proc.pid)}


def time_limit_trial(directory: Path, method: str, time_limit: float, units: int = 150) -> dict[str, Any]:
    """``opsched map`` with ``method`` and ``--time-limit`` on :func:`big_mapping_problem`: the wall time of the
    whole command and the solve time it reports."""
    dag, platform = big_mapping_problem(directory, units)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "opsched", "map", str(dag), "--platform", str(platform), "--method",
                           method, "--time-limit", str(time_limit), "--json"], capture_output=True, text=True,
                          timeout=HANG_SECONDS + 10 * time_limit, check=False)
    wall = time.perf_counter() - started
    result = json.loads(done.stdout) if done.returncode == 0 else {}
    return {"method": method, "time_limit": time_limit, "exit": done.returncode, "stderr": done.stderr[-300:],
            "wall_s": round(wall, 2), "solve_s": round(result.get("solve_seconds", math.nan), 2),
            "solve_over_limit_s": round(result.get("solve_seconds", math.nan) - time_limit, 2),
            "predicted": result.get("predicted"), "lower_bound": result.get("lower_bound")}


def mapped_module_plan(graph: Graph, method: str = "heft", seed: int = 0, platform: str | dict[str, Any] = "cpu2"
                       ) -> Any:
    """A mapped plan of ``graph`` on ``platform`` (a built-in's name, by default ``cpu2``: two CPU devices of one
    thread each; or a PLATFORM.json document), from seeded random unit costs (the units' table latencies where they
    have them; what the costs are does not matter to whether the outputs are right)."""
    from opsched.mapping.plan import to_schedule
    from opsched.mapping.platform import load_platform, platform_from_dict
    from opsched.mapping.problem import build_problem
    from opsched.mapping.solve import solve

    rng = random.Random(seed)
    costs = [float(rng.randint(1, 9)) for _ in graph.nodes]
    devices = load_platform(platform) if isinstance(platform, str) else platform_from_dict(platform)
    problem = build_problem(graph, devices, measure=lambda device, threads: costs)
    solved = solve(problem, method, time_limit=2)
    return to_schedule(problem, solved.mapping, solved.timeline, method, solved.lower_bound, solved.optimal,
                       solved.stats)


# -- the Ray engine (opsched run --engine ray): soak, load, Ctrl-C, faults -----------------------------------------

# two 1-thread CPU devices on two nodes, as docs/ray.md runs GoogLeNet; ray_cluster declares both on this machine
TWO_NODES = {"devices": [{"name": "cpu0", "kind": "cpu", "node": "n0", "threads": 1},
                         {"name": "cpu1", "kind": "cpu", "node": "n1", "threads": 1}],
             "links": {"default": {"bandwidth": "inf", "latency": 0}}}
FORMS = {"compiled-graph": True, "remote-calls": False}  # RayModule(compiled=...)


def ray_case(directory: Path, name: str = "branches") -> tuple[torch.nn.Module, Graph, tuple, Any, list[str]]:
    """A model as ``opsched run`` loads it, GoogLeNet at 64x64 or :data:`MODEL_FILE`'s CNN of three branches
    (written to ``directory``), with a HEFT plan of it on :data:`TWO_NODES` saved there: the model, its graph, its
    inputs, the plan, and what ``opsched run`` is given to run that plan."""
    from opsched.commands.common import load_and_capture

    if name == "googlenet":
        spec, image = "torchvision:googlenet", 64
    else:
        (directory / "branches.py").write_text(MODEL_FILE)
        spec, image = f"{directory / 'branches.py'}:make", None
    loaded, graph, _, _ = load_and_capture(argparse.Namespace(batch=None, input_shape=None, image_size=image), spec,
                                           "cpu")
    plan = mapped_module_plan(graph, "heft", platform=TWO_NODES)
    plan.save(directory / "ray-plan.json")
    argv = [spec, *(["--image-size", str(image)] if image else []), "--plan", str(directory / "ray-plan.json")]
    return loaded.model, graph, tuple(loaded.inputs), plan, argv


def actor_pids(module: Any) -> list[int]:
    """The process ids of a RayModule's actors, as each says."""
    import ray

    return [ray.get(actor.status.remote())[0] for actor in module.actors]


def ray_soak(model: torch.nn.Module, graph: Graph, inputs: tuple, plan: Any, calls: int, warmup: int,
             modules: int = 0) -> dict[str, Any]:
    """:func:`soak` of a RayModule in each form, outputs compared with ``model``'s and the actors followed, then
    ``modules`` more modules made, called once and closed, with this process's descriptors before and after; all on
    a local Ray started here by ``ray_cluster``, and then whether any process of that Ray is left once it is shut
    down."""
    from opsched.runtime.ray import RayModule, ray_cluster

    results: dict[str, Any] = {}
    with ray_cluster(["n0", "n1"], cpus=4):
        for form, compiled in FORMS.items():
            make = functools.partial(RayModule, graph, plan, compiled=compiled)
            results[form] = soak(make, inputs, calls=calls, warmup=warmup, reference=model, processes=actor_pids)
            fds_before = open_descriptors()
            for _ in range(modules):
                with make() as module, torch.inference_mode():
                    module(*inputs)
            gc.collect()
            results[form]["modules_made_and_closed"] = {"modules": modules, "fds_before": fds_before,
                                                        "fds_after": open_descriptors()}
        ray_processes = descendants(os.getpid())
    results["ray_processes"] = sorted(set(ray_processes.values()))
    results["ray_processes_left"] = sorted(ray_processes[p] for p in still_alive(ray_processes))
    return results


# What /proc names a process by (its first 15 characters), for the moments of a run on Ray a signal can find
RAY_MOMENTS = {"ray": "ray::RuntimeEnv", "actors": "ray::DeviceWork", "graph": "ray::DAGDriverP"}


def ray_interrupt_trial(directory: Path, run_args: Sequence[str], at: float | str | None, repeats: int = 5
                        ) -> dict[str, Any]:
    """Start ``opsched run RUN_ARGS --engine ray`` (a local Ray started for the run) in a session of its own and
    send SIGINT ``at`` seconds after the start, or once a process of the kind :data:`RAY_MOMENTS` names for ``at``
    appears (``ray``: the local Ray is starting, the raylet's agents up; ``actors``: a device's actor; ``graph``: the
    compiled graph is built, the measured runs follow), or never (None). Check: exit 130 with the one line
    ``opsched: interrupted`` (or 0 with its JSON when it finished first), no traceback, no hang, and no process of
    its session left (Ray's daemons, agents and workers; pgrep's raylet and gcs_server of the session too)."""
    argv = [sys.executable, "-m", "opsched", "run", *run_args, "--engine", "ray", "--repeats", str(repeats), "--json"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: set[str] = set()
    signalled = None
    while proc.poll() is None and signalled is None:
        seen.update(session_processes(proc.pid).values())
        elapsed = time.perf_counter() - started
        if (isinstance(at, float) and elapsed >= at) or (isinstance(at, str) and RAY_MOMENTS[at] in seen):
            proc.send_signal(signal.SIGINT)
            signalled = elapsed
        time.sleep(0.02)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"at": at, "hung": True, "stderr": stderr[-500:]}
    seconds = time.perf_counter() - started
    left = session_processes(proc.pid)
    later = still_alive(left, seconds=10.0)
    moment = next((m for m in ("graph", "actors", "ray") if RAY_MOMENTS[m] in seen), "before ray")
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {"at": at, "signal_after_s": None if signalled is None else round(signalled, 2), "moment": moment,
            "exit": proc.returncode, "seconds": round(seconds, 2), "stderr": lines[:3], "stderr_lines": len(lines),
            "traceback": "Traceback" in stderr, "hung": False, "stdout_json": _is_json(stdout),
            "left_at_exit": sorted(left.values()), "left_after_10s": sorted(left[p] for p in later),
            "ray_daemons_left": _ray_daemons(proc.pid)}


def _ray_daemons(session: int) -> list[int]:
    """The process ids of the raylets and gcs_servers alive in the session ``session`` (pgrep; zombies left out:
    they have ended, their parent has yet to collect them)."""
    done = subprocess.run(["pgrep", "-s", str(session), "-f", "raylet|gcs_server"], capture_output=True, text=True,
                          check=False)
    return sorted({int(p) for p in done.stdout.split()} & set(process_table()))


def failing_unit(run: Callable[..., Any], on_call: int) -> Callable[..., Any]:
    """A unit's callable ``run``, raising on its ``on_call``-th call. A closure, which Ray pickles by value: shipped
    to an actor, where this script cannot be imported, it counts the calls made there."""
    calls = [0]

    def unit(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == on_call:
            raise RuntimeError("The size of tensor a (28) must match the size of tensor b (27)")
        return run(*args)

    return unit


def ray_fault_trial(model: torch.nn.Module, graph: Graph, inputs: tuple, plan: Any, unit: str, compiled: bool,
                    on_call: int = 3) -> dict[str, Any]:
    """A RayModule (on the connected Ray) whose unit ``unit`` raises on its ``on_call``-th call: the calls before
    must equal eager, that one raise one DeviceFailed naming the unit's device and the unit, a later call raise it
    again at once, the actors end, and a new RayModule of the plan then give eager's outputs."""
    from opsched.runtime.ray import DeviceFailed, RayModule, plan_devices

    k = graph.index[unit]
    faulty = copy.copy(graph)
    faulty.nodes = tuple(dataclasses.replace(n, run=failing_unit(n.run, on_call)) if i == k else n
                         for i, n in enumerate(graph.nodes))
    device = plan_devices(plan)[next(op.stream for op in plan.ops if op.name == unit)].name
    with torch.inference_mode():
        want = model(*inputs)
    module = RayModule(faulty, plan, compiled=compiled, run_seconds=20)
    pids = actor_pids(module)
    right = 0
    error: Exception | None = None
    started = time.perf_counter()
    try:
        for _ in range(on_call):
            right += output_error(call_with_deadline(module, inputs), want)[0] <= 1e-4
    except DeviceFailed as e:
        error = e
    failed_after = time.perf_counter() - started
    try:
        call_with_deadline(module, inputs)
        again = "returned"
    except DeviceFailed as e:
        again = "DeviceFailed" if str(e) == str(error) else f"DeviceFailed: {e}"
    module.close()
    with RayModule(graph, plan, compiled=compiled) as fresh:
        fresh_right = output_error(call_with_deadline(fresh, inputs), want)[0] <= 1e-4
    return {"form": "compiled-graph" if compiled else "remote-calls", "unit": unit, "device": device,
            "right_before": right, "error": None if error is None else str(error),
            "named": error is not None and error.device == device and f"unit {unit!r}" in str(error)
            and "\n" not in str(error), "seconds_to_fail": round(failed_after, 2), "later_call": again,
            "actors_left": len(still_alive(pids)), "new_module_right": fresh_right}


# -- the suites --------------------------------------------------------------------------------------------------

def suite_load(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy()
    results = {}
    for method in ("sequential", "ios", "lios"):
        plan = schedule_all(graph)[method]
        module = OptimizedModule(graph, plan, cores=2)
        results[method] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["threads"],
                                 calls=size["calls"])
        module.close()
    module, batch = fused_batch()
    results["multi"] = hammer(module, batch, seeded_input(batch.inputs[0].shape), threads=size["threads"],
                              calls=size["calls"])
    module.close()
    return results


def fused_batch(count: int = 4) -> tuple[Any, Any]:
    """Issue 10's fused multi-model module over ``count`` seeded copies of :func:`branchy`'s model (batched
    units and their selections), and the batch it must agree with model by model."""
    from opsched.multi import fuse, model_batch

    model, _, inputs = branchy()
    models = []
    for k in range(count):
        copy_k = copy.deepcopy(model)
        torch.manual_seed(k)
        for p in copy_k.parameters():
            torch.nn.init.normal_(p, std=0.2)
        models.append(copy_k.eval())
    module = fuse(models, inputs, method="lios", cost="sim:v100", cache=False)
    return module, model_batch(models, inputs)


def suite_soak(size: dict[str, int]) -> dict[str, Any]:
    _, graph, inputs = branchy()
    plan = schedule_all(graph)["lios"]
    return soak(lambda: OptimizedModule(graph, plan, cores=2), inputs, calls=size["soak_calls"])


def suite_faults(size: dict[str, int]) -> list[dict[str, Any]]:
    model, graph, inputs = branchy()
    out = []
    for method in ("sequential", "greedy", "ios", "lios", "nimble"):
        for unit in (graph.nodes[0].name, graph.nodes[len(graph) // 2].name, graph.nodes[-1].name):
            out.append(fault_trial(model, graph, inputs, method, unit, calls=size["fault_calls"]))
    return out


def suite_interrupt(size: dict[str, int]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    with tempfile.TemporaryDirectory() as d:
        trials = [interrupt_trial(Path(d), None)]
        trials += [interrupt_trial(Path(d), rng.uniform(0.1, 5.0)) for _ in range(size["interrupts"] - 1)]
    return trials


def suite_fuzz_models(size: dict[str, int]) -> dict[str, Any]:
    counts = {"models": 0, "schedules_run": 0}

    @settings(max_examples=size["models"], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(recipes())
    def run(recipe: dict[str, Any]) -> None:
        counts["schedules_run"] += check_recipe(recipe)
        counts["models"] += 1

    run()
    return counts


def suite_fuzz_plans(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy(width=3, depth=2, channels=4, size=6)
    with torch.inference_mode():
        want = model(*inputs)

    def execute(plan: Any) -> None:
        module = OptimizedModule(graph, plan, cores=2)
        try:
            assert output_error(call_with_deadline(module, inputs), want)[0] <= 1e-4
        finally:
            module.close()

    plans = {m: s.to_dict() for m, s in schedule_all(graph).items()}
    counts: dict[str, int] = {"refused": 0, "accepted": 0}

    @settings(max_examples=size["plans"], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(plans)), st.sampled_from(MUTATIONS), st.integers(0, 2**32))
    def run(method: str, kind: str, seed: int) -> None:
        counts[check_plan_text(mutate(plans[method], random.Random(seed), kind), graph, execute)] += 1

    run()
    return counts


def suite_fuzz_dags(size: dict[str, int]) -> dict[str, Any]:
    counts = {"scheduled": 0, "refused": 0}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["dags"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(dag_documents(), st.sampled_from(sorted(SCHEDULERS)))
        def run(doc: Any, method: str) -> None:
            counts[check_dag_document(doc, method, Path(d))] += 1

        run()
    return counts


def suite_fuzz_platforms(size: dict[str, int]) -> dict[str, Any]:
    counts: dict[str, Any] = {"documents": 0, "mapped": 0, "refused": 0, "subprocess_runs": 0, "defects": {}}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["platforms"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.integers(0, 2**32))
        def run(seed: int) -> None:
            text, defect = platform_document(seed)
            real = counts["documents"] % 50 == 0  # every 50th also through the real executable
            verdict = check_platform_document(text, Path(d), subprocess_too=real)
            counts["documents"] += 1
            counts["subprocess_runs"] += real
            counts[verdict] += 1
            counts["defects"].setdefault(defect, {"mapped": 0, "refused": 0})[verdict] += 1

        run()
    return counts


def suite_fuzz_mapping_dags(size: dict[str, int]) -> dict[str, Any]:
    counts = {"cases": 0, "refused": 0, "mapped": 0, "answers": 0, "proven_optimal": 0}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["mapping_dags"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.integers(0, 2**32))
        def run(seed: int) -> None:
            for key, value in check_mapping_case(mapping_case(seed), Path(d), time_limit=1.0).items():
                counts[key] += value
            counts["cases"] += 1

        run()
    return counts


def suite_fuzz_mapped_plans(size: dict[str, int]) -> dict[str, Any]:
    counts: dict[str, Any] = {"plans": 0, "show": {"accepted": 0, "refused": 0}, "run": {"accepted": 0, "refused": 0}}
    with tempfile.TemporaryDirectory() as d, _cache_in(Path(d)):
        (Path(d) / "branches.py").write_text(MODEL_FILE)
        spec = f"{Path(d) / 'branches.py'}:make"
        plans = mapped_plans(Path(d), spec)

        @settings(max_examples=size["mapped_plans"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(sorted(plans)), st.sampled_from(MAPPED_MUTATIONS), st.integers(0, 2**32))
        def run(name: str, kind: str, seed: int) -> None:
            rng = random.Random(seed)
            verdict = check_mapped_plan_text(mutate_mapped(plans[name], rng, kind), Path(d), spec,
                                             gantt=rng.random() < 0.1)
            counts["plans"] += 1
            for command, what in verdict.items():
                counts[command][what] += 1

        run()
    return counts


@contextlib.contextmanager
def _cache_in(directory: Path) -> Any:
    """Measurements go to a cache of their own under ``directory``, never the user's."""
    previous = os.environ.get("OPSCHED_CACHE_DIR")
    os.environ["OPSCHED_CACHE_DIR"] = str(directory / "cache")
    try:
        yield
    finally:
        if previous is None:
            del os.environ["OPSCHED_CACHE_DIR"]
        else:
            os.environ["OPSCHED_CACHE_DIR"] = previous


def suite_interrupt_map(size: dict[str, int]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    trials = []
    with tempfile.TemporaryDirectory() as d:
        for method in ("milp", "milp-split"):
            for _ in range(size["map_interrupts"]):
                trials.append(map_interrupt_trial(Path(d), method, rng.uniform(0.1, 7.0), time_limit=5.0))
    return trials


def suite_time_limit_map(size: dict[str, int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        return [time_limit_trial(Path(d), method, 2.0, units) for units in size["time_limit_units"]
                for method in MAP_METHODS]


def suite_load_map(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy()
    results = {}
    for method in ("heft", "milp"):
        plan = mapped_module_plan(graph, method)
        module = OptimizedModule(graph, plan, cores=2)
        results[method] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["threads"],
                                 calls=size["calls"])
        results[method]["units_per_device"] = [sum(op.stream == k for op in plan.ops) for k in range(2)]
        module.close()
    return results


def suite_soak_map(size: dict[str, int]) -> dict[str, Any]:
    _, graph, inputs = branchy()
    plan = mapped_module_plan(graph, "heft")
    return soak(lambda: OptimizedModule(graph, plan, cores=2), inputs, calls=size["soak_calls"])


def suite_soak_ray(size: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        model, graph, inputs, plan, _ = ray_case(Path(d), size["ray_model"])
    return ray_soak(model, graph, inputs, plan, size["ray_soak_calls"], size["ray_warmup"], size["ray_modules"])


def suite_load_ray(size: dict[str, Any]) -> dict[str, Any]:
    from opsched.runtime.ray import RayModule, ray_cluster

    with tempfile.TemporaryDirectory() as d:
        model, graph, inputs, plan, _ = ray_case(Path(d), size["ray_model"])
    results = {}
    with ray_cluster(["n0", "n1"], cpus=4):
        for form, compiled in FORMS.items():
            with RayModule(graph, plan, compiled=compiled) as module:
                results[form] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["ray_threads"],
                                       calls=size["ray_calls"])
                one = hammer(module, model, seeded_input(inputs[0].shape), threads=1, calls=size["ray_calls"])
                results[form]["one_thread_calls_per_second"] = one["calls_per_second"]
    return results


def suite_interrupt_ray(size: dict[str, Any]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    with tempfile.TemporaryDirectory() as d:
        *_, run_args = ray_case(Path(d), size["ray_model"])
        trials = [ray_interrupt_trial(Path(d), run_args, None)]  # not signalled: how long a run takes
        span = trials[0]["seconds"]
        trials += [ray_interrupt_trial(Path(d), run_args, rng.uniform(0.3, span)) for _ in range(size["ray_interrupts"])]
        trials += [ray_interrupt_trial(Path(d), run_args, moment) for moment in RAY_MOMENTS]
    return trials


def suite_faults_ray(size: dict[str, Any]) -> list[dict[str, Any]]:
    from opsched.runtime.ray import ray_cluster

    with tempfile.TemporaryDirectory() as d:  # every unit of the small CNN: each trial starts two modules
        model, graph, inputs, plan, _ = ray_case(Path(d), "branches")
    with ray_cluster(["n0", "n1"], cpus=4):
        return [ray_fault_trial(model, graph, inputs, plan, node.name, compiled, on_call)
                for compiled in FORMS.values() for node in graph.nodes for on_call in size["ray_fault_calls"]]


SUITES = {"load": suite_load, "soak": suite_soak, "faults": suite_faults, "interrupt": suite_interrupt,
          "fuzz-models": suite_fuzz_models, "fuzz-plans": suite_fuzz_plans, "fuzz-dags": suite_fuzz_dags,
          "fuzz-platforms": suite_fuzz_platforms, "fuzz-mapping-dags": suite_fuzz_mapping_dags,
          "fuzz-mapped-plans": suite_fuzz_mapped_plans, "interrupt-map": suite_interrupt_map,
          "time-limit-map": suite_time_limit_map, "load-map": suite_load_map, "soak-map": suite_soak_map,
          "soak-ray": suite_soak_ray, "load-ray": suite_load_ray, "interrupt-ray": suite_interrupt_ray,
          "faults-ray": suite_faults_ray}
FULL = {"threads": 8, "calls": 200, "soak_calls": 2000, "fault_calls": 30, "interrupts": 30, "models": 400,
        "plans": 5000, "dags": 3000, "platforms": 2000, "mapping_dags": 300, "mapped_plans": 1500,
        "map_interrupts": 15, "time_limit_units": [150, 300], "ray_model": "googlenet", "ray_soak_calls": 1500,
        "ray_warmup": 300, "ray_modules": 20, "ray_threads": 4, "ray_calls": 50, "ray_interrupts": 20,
        "ray_fault_calls": [1, 3]}
QUICK = {"threads": 8, "calls": 25, "soak_calls": 300, "fault_calls": 9, "interrupts": 2, "models": 15,
         "plans": 200, "dags": 200, "platforms": 200, "mapping_dags": 20, "mapped_plans": 100, "map_interrupts": 1,
         "time_limit_units": [60], "ray_model": "branches", "ray_soak_calls": 300, "ray_warmup": 20, "ray_modules": 3,
         "ray_threads": 4, "ray_calls": 25, "ray_interrupts": 2, "ray_fault_calls": [3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller size of every suite")
    parser.add_argument("--only", nargs="+", choices=sorted(SUITES), help="run these suites only")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    print(json.dumps({"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {sys.platform}",
                      "threads_torch": torch.get_num_threads(), "size": size}), flush=True)
    for name in args.only or SUITES:
        started = time.perf_counter()
        result = SUITES[name](size)
        print(json.dumps({"suite": name, "seconds": round(time.perf_counter() - started, 1), "result": result}),
              flush=True)


if __name__ == "__main__":
    main()
