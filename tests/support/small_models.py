"""Small models for the reliability tests and suites: models built from a random recipe, a model with branches,
every scheduler run on a graph, and threads calling one module at once (``hammer``)."""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from opsched.compare import compare_outputs
from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.graph.ir import Graph
from opsched.runtime.module import OptimizedModule
from opsched.schedulers import SCHEDULERS, make_schedule

METHOD_OPTIONS = {"sequential": {}, "greedy": {}, "lios": {"streams": 3}, "nimble": {"streams": 3},
                  "ios": {"max_block_size": 8}, "exact": {"time_limit": 2.0}, "hivemind": {"streams": 3}}
# tighter than the default (opsched.compare): these small random models reorder few operators; scaled to each output
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 6e-2}
HANG_SECONDS = 60.0



OPS = ("conv3", "conv1", "relu", "add", "mul", "cat_conv", "inplace", "view", "pool", "sigmoid_gate", "flatten")


# a scale of the outputs: a global the forward reads (the call fuzzer sets it, as a user may set a constant of the
# model's file); at 1.0 no op is added
OUTPUT_SCALE = 1.0


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
            elif op == "flatten":  # by the batch of the call, as classifier heads do: export bakes the batch in
                out = torch.softmax(x.reshape(x.shape[0], -1), -1).view_as(x)
            elif op == "pool":
                out = torch.nn.functional.max_pool2d(x, 3, stride=1, padding=1)
            else:  # a gate: the branch scales the other by sigmoid(conv(x))
                out = y * torch.sigmoid(self.layers[str(k)](x))
            values.append(out)
        picked = [values[i] for i in self.outputs]
        if OUTPUT_SCALE != 1.0:
            picked = [v * OUTPUT_SCALE for v in picked]
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
            verdict = compare_outputs(got, want, tolerance)
            assert verdict.ok, f"{method}: {verdict.why} on {recipe}"
        finally:
            module.close()
        runs += 1
    return runs


def check_inductor_region(recipe: dict[str, Any]) -> str:
    """The recipe's model as ``--kernels auto`` offers it to Inductor (the sequential plan, every unit on
    Inductor, run as compiled regions: one where the graph returns one value) against eager: "" where it
    answered as the model, else why Inductor refused it (opsched's one-line error, as the optimize that offered
    it drops that plan: Inductor's frozen convolutions take no float64). Raises AssertionError on a wrong
    output; any other exception is a finding too."""
    from opsched.errors import OpschedError
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import ChosenKernels
    from opsched.schedule import RunSettings

    model, inputs = build(recipe)
    with torch.inference_mode():
        want = model(*inputs)
    graph = unit_costed(model, *inputs)
    kernels = ChosenKernels({n.name: "inductor" for n in graph.nodes}, all_values(graph, list(inputs)).__getitem__,
                            asked="auto")
    plan = make_schedule("sequential", graph, TableCost(graph))
    plan.run = RunSettings("auto", regions=True)
    try:  # (compiled as the module is built)
        module = OptimizedModule(graph, plan, 2, kernels)
    except OpschedError as e:
        return str(e)
    try:
        with torch.inference_mode():
            got = call_with_deadline(module, inputs, 300.0)
    finally:
        module.close()
    verdict = compare_outputs(got, want, TOLERANCE[inputs[0].dtype])
    assert verdict.ok, f"{verdict.why} on {recipe}"
    return ""


def onnxruntime_verdict(model: torch.nn.Module, inputs: Sequence[torch.Tensor], method: str,
                        regions: bool) -> Any:
    """``model`` captured on ``inputs`` and run with every unit on ONNX Runtime under ``method``'s plan (its runs
    of units as compiled regions where ``regions``), compared with the model's own answer: the verdict
    (:func:`opsched.compare.compare_outputs`)."""
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import ChosenKernels
    from opsched.schedule import RunSettings

    graph = unit_costed(model, *inputs)
    plan = make_schedule(method, graph, TableCost(graph))
    plan.run = RunSettings("onnxruntime", regions=regions)
    kernels = ChosenKernels({n.name: "onnxruntime" for n in graph.nodes},
                            all_values(graph, list(inputs)).__getitem__, asked="onnxruntime")
    module = OptimizedModule(graph, plan, 2, kernels)
    try:
        with torch.inference_mode():
            return compare_outputs(module(*inputs), model(*inputs))
    finally:
        module.close()


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
           threads: int = 8, calls: int = 200, tolerance: float | None = None) -> dict[str, Any]:
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
                verdict = compare_outputs(got, expected[s], tolerance)
                if not verdict.ok:
                    wrong.append((s, verdict.error))
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


class ChannelSplit(torch.nn.Module):
    """ShuffleNet V2's block: a unit returns the list ``chunk`` makes, and units read one tensor of it."""

    def __init__(self):
        super().__init__()
        self.branch = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.ReLU())

    def forward(self, x):
        kept, changed = x.chunk(2, dim=1)
        return torch.cat([kept, self.branch(changed)], 1)


def unit_costed(model: torch.nn.Module, *inputs: Any) -> Graph:
    """``model`` captured on ``inputs``, every unit costing 1 (for schedules that only need some order)."""
    graph = capture(model, inputs)
    for n in graph.nodes:
        n.latency = 1.0
    return graph
