"""The differential fuzzer of optimized modules (issue 36): random call sequences on random models, every answer
compared with the model's own.

A sequence is a list of actions on one :class:`~opsched.runtime.guarded.GuardedModule` over a
:class:`~support.small_models.RecipeModel` (convolutions with batch norms, branches, in-place ops, views,
flatten-by-batch): calls at other batch and spatial sizes and memory layouts (channels_last, a strided slice),
weight updates of every kind (``load_state_dict``, with ``assign=True``, in place under ``no_grad``, an
optimizer step, ``.double()`` and back), calls under autocast, in training mode and asking for gradients,
two threads calling at once, a save and load into a fresh copy of the model, and what the forward reads besides
its weights changed: a setting of the model's own, an element of its list of outputs set in place, a global
of its file, a forward hook. Plans are made by
:class:`QuickBuilder` (capture, a random scheduler under random table latencies, compile, verify: no timing),
so that hundreds of sequences run in a minute; the real builder (``opsched.optimize``) goes the same way
through the guards.
"""

from __future__ import annotations

import copy
import random
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from hypothesis import strategies as st

from opsched.compare import compare_outputs
from opsched.cost.table import TableCost
from opsched.deploy import recompile
from opsched.errors import OpschedError
from opsched.evaluation import verify
from opsched.graph.capture import capture
from opsched.graph.tracing import TRACING
from opsched.runtime.dynamic import schedule_at
from opsched.runtime.guarded import GuardedModule, Plan, PlanBuilder
from opsched.runtime.guards import Guard, call_signature
from opsched.runtime.module import OptimizedModule
from opsched.schedule import Measurement
from opsched.schedulers import make_schedule
from support import small_models
from support.small_models import METHOD_OPTIONS, RecipeModel, recipes

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 6e-2}
METHODS = ("sequential", "greedy", "lios", "ios")
ACTIONS = ("call", "call", "call", "batch", "spatial", "channels_last", "strided", "load_state_dict", "assign",
           "in_place", "optimizer_step", "double", "autocast", "training", "grad", "threads", "save_load",
           "attribute", "hook", "table", "global", "setting")


class QuickBuilder(PlanBuilder):
    """Plans without timing: capture, a scheduler drawn by ``seed`` under random table latencies, compile,
    verify against the model; a rebuild compiles the same schedule again (:func:`opsched.deploy.recompile`)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.options = {"threads": 2, "tolerance": 1e-4}
        self.built = self.resized = 0

    def build(self, model: torch.nn.Module, inputs: tuple) -> Plan:
        self.built += 1
        graph = capture(model, inputs)
        assert graph.fingerprint  # of the graph as captured: the latencies set below for the scheduler are not the graph's
        for n in graph.nodes:
            n.latency = float(self.rng.randint(1, 9))
        method = self.rng.choice(METHODS)
        schedule = make_schedule(method, graph, TableCost(graph, capacity=2), **METHOD_OPTIONS[method])
        schedule.measured = Measurement(method, {"name": method, "kind": "schedule"}, {})
        flat = pytree.tree_leaves(inputs)
        module = OptimizedModule(graph, schedule, cores=2, guard=Guard.of(inputs, model))
        verdict = verify(module, model, inputs, _tolerance(flat, model, inputs))
        assert verdict.ok, f"{method}: {verdict.why}"
        return Plan(call_signature(inputs), inputs, module, method, schedule)

    def resize(self, model: torch.nn.Module, plan: Plan, inputs: tuple) -> Plan:
        """``plan``'s schedule compiled for ``inputs`` (other sizes of the dynamic dimensions), as
        :meth:`opsched.jobs.OptimizeBuilder.resize` does, verified; the model answers where it does not."""
        graph = capture(model, inputs)
        schedule = schedule_at(plan.schedule, graph)
        if schedule is None:
            return self.build(model, inputs)
        self.built += 1
        module = OptimizedModule(graph, schedule, cores=2, guard=Guard.of(inputs, model))
        verdict = verify(module, model, inputs, _tolerance(pytree.tree_leaves(inputs), model, inputs))
        if not verdict.ok:
            return Plan(call_signature(inputs), inputs, None, "eager", note=f"resized: {verdict.why}")
        self.resized += 1  # a schedule of another size reused, verified at this one
        return Plan(call_signature(inputs), inputs, module, plan.chosen, schedule)

    def rebuild(self, model: torch.nn.Module, plan: Plan) -> Plan:
        self.built += 1
        module, verdict = recompile(model, plan.inputs, plan.schedule, {
            **self.options, "tolerance": _tolerance(plan.inputs, model, plan.inputs)})
        assert verdict.ok, verdict.why
        return Plan(plan.signature, plan.inputs, module, plan.chosen, plan.schedule)


def _tolerance(flat: Sequence[Any], model: torch.nn.Module, inputs: tuple) -> float:
    """The tolerance of the model's outputs as they come out now (under autocast, bfloat16's: the
    inputs' dtype would ask float32's of a bfloat16 answer)."""
    with torch.no_grad():
        outputs = [t for t in pytree.tree_leaves(model(*inputs)) if isinstance(t, torch.Tensor)]
    dtypes = [t.dtype for t in outputs] or [t.dtype for t in pytree.tree_leaves(list(flat))
                                             if isinstance(t, torch.Tensor)]
    return max((TOLERANCE.get(d, 1e-4) for d in dtypes), default=1e-4)


def differs(got: Any, want: Any, grads: bool = False, lowered: Sequence[bool] | None = None) -> str:
    """What differs between an answer ``got`` and the model's ``want``: their structure, an output's shape or
    dtype (with ``grads``, whether it requires gradients), or its values beyond its own dtype's tolerance (under
    autocast one output may be float32, an element-wise product, another bfloat16, a convolution, whose rounding
    the first one's tolerance would call wrong), or bfloat16's where ``lowered`` says the output went through
    bfloat16 (:func:`autocast_lowered`); '' where nothing does."""
    if pytree.tree_structure(got) != pytree.tree_structure(want):
        return f"structure {pytree.tree_structure(got)} where the model gives {pytree.tree_structure(want)}"
    pairs = [(k, g, w) for k, (g, w) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(want)))
             if isinstance(w, torch.Tensor)]
    for k, g, w in pairs:
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {k}: {tuple(g.shape)} {g.dtype} where the model gives {tuple(w.shape)} {w.dtype}"
        if grads and g.requires_grad != w.requires_grad:
            return f"output {k}: requires_grad {g.requires_grad} where the model's is {w.requires_grad}"
    for k, g, w in pairs:
        tolerance = TOLERANCE[torch.bfloat16] if lowered and lowered[k] else TOLERANCE.get(w.dtype, 1e-4)
        verdict = compare_outputs(g.detach(), w.detach(), tolerance)
        if not verdict.ok:
            return f"output {k}: {verdict.why}"
    return ""


def autocast_lowered(want: Any, full: Any) -> list[bool]:
    """For each output leaf of the model's answer under autocast (``want``), whether it went through bfloat16: it
    differs from the model's answer without autocast (``full``) beyond float32's tolerance. A float32 output can
    (the product of a bfloat16 convolution's output and a float32 value), and carries bfloat16's rounding: a plan
    that folds a batch norm into that convolution rounds otherwise, by a bfloat16 step, as the model may."""
    return [isinstance(w, torch.Tensor) and not compare_outputs(w.float(), f.float(), TOLERANCE[torch.float32]).ok
            for w, f in zip(pytree.tree_leaves(want), pytree.tree_leaves(full))]


@st.composite
def sequences(draw: st.DrawFn, max_actions: int = 8) -> dict[str, Any]:
    """A random model (:func:`support.small_models.recipes`, float32) and a random sequence of actions."""
    recipe = draw(recipes(max_steps=6))
    recipe["dtype"] = "float32"
    actions = draw(st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 2**16)), min_size=1,
                            max_size=max_actions))
    return {"recipe": recipe, "actions": actions, "wait": draw(st.booleans()), "dynamic": draw(st.booleans())}


class Sequence_:
    """One sequence run: the model, its optimized module, the dtype and sizes of the next call."""

    def __init__(self, case: dict[str, Any]):
        recipe = case["recipe"]
        torch.manual_seed(recipe["seed"])
        self.model = RecipeModel(recipe["steps"], recipe["inputs"], recipe["outputs"], as_dict=recipe["as_dict"]).eval()
        self.count = recipe["inputs"]
        self.dtype, self.batch, self.size, self.layout = torch.float32, 1, 6, "contiguous"
        self.builder = QuickBuilder(recipe["seed"])
        self.lines: list[str] = []
        # with "dynamic", the batch and spatial sizes the actions draw are declared dynamic: their plans are made
        # from another size's schedule (GuardedModule._sized_like, the builder's resize)
        dynamic = tuple({0: (1, 3), 2: (6, 8), 3: (6, 8)} for _ in range(self.count)) if case.get("dynamic") else ()
        self.fast = GuardedModule(self.model, self.builder, wait=case["wait"], max_plans=3, dynamic=dynamic,
                                  say=self.lines.append)
        self.wrong: list[str] = []
        self.hooks: list[Any] = []  # handles of the forward hooks the "hook" action added
        self.calls = 0

    def inputs(self, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        made = []
        for _ in range(self.count):
            x = torch.randn(self.batch, 4, self.size, self.size, generator=g).to(self.dtype)
            if self.layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            elif self.layout == "strided":  # every other column of a wider tensor: not contiguous
                wide = torch.randn(self.batch, 4, self.size, 2 * self.size, generator=g).to(self.dtype)
                x = wide[..., ::2]
            made.append(x)
        return tuple(made)

    def check_call(self, seed: int, what: str, grad: bool = False) -> None:
        inputs = self.inputs(seed)
        if grad:
            inputs = tuple(x.requires_grad_() for x in inputs)
            want, got = self._reference(inputs), self.fast(*inputs)
        else:
            with torch.no_grad():
                want = self._reference(inputs)
                got = self.fast(*inputs)
        self.calls += 1
        lowered = None
        if torch.is_autocast_enabled("cpu"):
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                lowered = autocast_lowered(want, self._reference(inputs))
        why = differs(got, want, lowered=lowered)
        if why:
            self.wrong.append(f"{what}: {why}")

    def _reference(self, inputs: tuple) -> Any:
        """The model's own answer. It waits while a plan is traced in the background, as opsched's own calls do:
        torch.fx's tracer replaces ``torch.nn.Module.__call__`` for the whole process meanwhile, and a module
        called around opsched on another thread may fail then (docs/calls.md, "Threads and background builds";
        this fuzzer met it twice in 1,500 sequences). The harness judges opsched's answers, not that limit."""
        with TRACING.calling():
            return self.model(*inputs)

    def act(self, action: str, seed: int) -> None:
        rng = random.Random(seed)
        model = self.model
        if action == "batch":
            self.batch = rng.choice([1, 2, 3])
        elif action == "spatial":
            self.size = rng.choice([6, 8])
        elif action in ("channels_last", "strided"):
            self.layout = action if self.layout != action else "contiguous"
        elif action == "load_state_dict":
            model.load_state_dict(_perturbed(model, seed))
        elif action == "assign":
            model.load_state_dict(_perturbed(model, seed), assign=True)
        elif action == "in_place":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 0.1 * rng.random())
        elif action == "optimizer_step" and any(True for _ in model.parameters()):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            out = [o for o in pytree.tree_leaves(self._reference(self.inputs(seed))) if o.requires_grad]
            if out:  # (an output may not depend on any weight)
                sum(o.float().square().mean() for o in out).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elif action == "attribute":  # a setting of the model's own that its forward reads
            model.as_dict = not model.as_dict
        elif action == "table":  # an element of a list the forward reads (which value is returned) set in place
            steps = range(self.count, self.count + len(model.steps))
            k = rng.randrange(len(model.outputs))
            model.outputs[k] = rng.choice([i for i in steps if i not in model.outputs] or [model.outputs[k]])
        elif action == "setting":  # a setting of one of PyTorch's layers the forward reads: a norm's eps, a padding
            layers = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
                      or (isinstance(m, torch.nn.Conv2d) and m.padding != (0, 0))]
            if layers:
                layer = rng.choice(layers)
                if isinstance(layer, torch.nn.BatchNorm2d):  # (each time another value than the one it has)
                    layer.eps = rng.choice([eps for eps in (1e-5, 0.1, 1.0) if eps != layer.eps])
                else:
                    layer.padding_mode = rng.choice([mode for mode in ("zeros", "reflect", "replicate", "circular")
                                                     if mode != layer.padding_mode])
        elif action == "global":  # a constant of the model's file set again
            small_models.OUTPUT_SCALE = rng.choice([0.5, 1.0, 2.0])
        elif action == "hook":  # a forward hook added to a layer, or the last one added taken away
            if self.hooks and rng.random() < 0.5:
                self.hooks.pop().remove()
            else:
                layers = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
                if layers:
                    self.hooks.append(rng.choice(layers).register_forward_hook(lambda m, args, out: out * 1.5))
        elif action == "double":
            self.dtype = torch.float64 if self.dtype == torch.float32 else torch.float32
            model.to(self.dtype)
        elif action == "autocast":
            with torch.autocast("cpu", torch.bfloat16):
                self.check_call(seed, "under autocast")
            return
        elif action == "training":
            state = copy.deepcopy(model.state_dict())
            model.train()
            self.check_call(seed, "in training mode")  # batch norms use the batch's statistics, as eager does
            model.eval()
            model.load_state_dict(state)  # the running statistics the two training calls moved
            return
        elif action == "grad":
            self.check_call(seed, "asking for gradients", grad=True)
            return
        elif action == "threads":
            self._two_threads(seed)
            return
        elif action == "save_load":
            self._save_and_load(seed)
            return
        self.check_call(seed, f"after {action}")

    def _two_threads(self, seed: int) -> None:
        errors: list[BaseException] = []

        def call(k: int) -> None:
            try:
                self.check_call(seed + k, f"thread {k}")
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if any(t.is_alive() for t in threads):
            self.wrong.append("two threads: a call hung")
        if errors:
            raise errors[0]

    def _save_and_load(self, seed: int) -> None:
        from opsched.deploy import load

        self.fast.wait_for_builds()
        if self.fast.watch.changed() or not any(p.schedule is not None and not p.stale
                                                 for p in self.fast.plans.values()):
            return  # nothing to save (said by an OpschedError: tests/test_guarded.py)
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "plan.json"
            self.fast.save(path)
            twin = copy.deepcopy(self.model)
            self.fast = load(path, twin, wait=self.fast.wait, max_plans=3, say=self.lines.append)
            self.fast.builder = self.builder
            self.model = twin
        self.check_call(seed, "after save and load")


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.1 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}


def run_sequence(case: dict[str, Any]) -> dict[str, Any]:
    """Run one sequence; return its counts. A wrong answer or shape is listed in ``wrong``; an exception that is
    not one of opsched's own is raised (a finding); one of opsched's own is counted in ``refused``."""
    small_models.OUTPUT_SCALE = 1.0
    run = Sequence_(case)
    refused = []
    try:
        run.check_call(0, "first call")
        for action, seed in case["actions"]:
            try:
                run.act(action, seed)
            except OpschedError as e:
                refused.append(f"{action}: {type(e).__name__}: {e}")
        run.fast.wait_for_builds()
        run.check_call(1, "at the end")
    finally:
        run.fast.close()
        small_models.OUTPUT_SCALE = 1.0
    return {"calls": run.calls, "wrong": run.wrong, "refused": refused, "built": run.builder.built,
            "resized": run.builder.resized}
