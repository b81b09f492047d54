"""Reliability under load, faults and bad input (issue 14): the long runs behind docs/reliability.md.

    python benchmarks/reliability.py                # every suite at the documented size
    python benchmarks/reliability.py --quick        # a smaller size of each (about a minute)
    python benchmarks/reliability.py --only load soak

Suites: ``load`` (threads calling one OptimizedModule at once, every output compared with eager on the
same input), ``soak`` (thousands of calls: resident memory, threads, file descriptors), ``faults`` (a unit
failing mid-run, then the next call), ``interrupt`` (Ctrl-C at random moments of ``opsched optimize``),
``fuzz-models`` / ``fuzz-plans`` / ``fuzz-dags`` (hypothesis). Each prints one JSON line of figures.

The fast tests in tests/test_reliability*.py import the helpers below and run them at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
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
from collections.abc import Callable, Sequence
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
from opsched.runtime.module import OptimizedModule, output_error
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

def resident_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def stream_threads() -> int:
    return sum(t.name == "opsched-stream" for t in threading.enumerate())


def soak(make_module: Callable[[], OptimizedModule], inputs: tuple, calls: int = 2000, warmup: int = 200
         ) -> dict[str, Any]:
    """Call a fresh module ``calls`` times after ``warmup`` calls; report resident memory growth over the
    calls, worker threads and descriptors before, during and after close, and after a second module is
    dropped without close (collected)."""
    gc.collect()
    threads_before, fds_before = stream_threads(), open_descriptors()
    module = make_module()
    with torch.inference_mode():
        for _ in range(warmup):
            module(*inputs)
        gc.collect()
        rss_start = resident_mb()
        samples = []
        started = time.perf_counter()
        for k in range(calls):
            module(*inputs)
            if k % max(1, calls // 10) == 0:
                samples.append(round(resident_mb(), 1))
        seconds = time.perf_counter() - started
    gc.collect()
    rss_end = resident_mb()
    threads_running = stream_threads()
    module.close()
    threads_closed = stream_threads()
    dropped = make_module()
    with torch.inference_mode():
        dropped(*inputs)
    threads_dropped_running = stream_threads()
    del dropped
    gc.collect()
    time.sleep(0.2)  # the workers see their stop signal
    return {"calls": calls, "warmup": warmup, "seconds": round(seconds, 2),
            "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
            "rss_growth_mb": round(rss_end - rss_start, 2), "rss_samples_mb": samples,
            "workers_before": threads_before, "workers_while_running": threads_running,
            "workers_after_close": threads_closed, "workers_second_module": threads_dropped_running,
            "workers_after_collect": stream_threads(), "fds_before": fds_before, "fds_after": open_descriptors()}


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
    argv = [sys.executable, "-m", "opsched", "optimize", f"{model}:make", "--method", "ios", "--repeats", "3",
            "--out", str(workdir / f"plan-{time.monotonic_ns()}.json"), "--json"]
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


SUITES = {"load": suite_load, "soak": suite_soak, "faults": suite_faults, "interrupt": suite_interrupt,
          "fuzz-models": suite_fuzz_models, "fuzz-plans": suite_fuzz_plans, "fuzz-dags": suite_fuzz_dags}
FULL = {"threads": 8, "calls": 200, "soak_calls": 2000, "fault_calls": 30, "interrupts": 30, "models": 400,
        "plans": 5000, "dags": 3000}
QUICK = {"threads": 8, "calls": 25, "soak_calls": 300, "fault_calls": 9, "interrupts": 2, "models": 15,
         "plans": 200, "dags": 200}


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
