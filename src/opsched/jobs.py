"""One Python call per job, returning what its command reports: ``opsched.optimize`` (one model),
``opsched.optimize_batch`` (a model batch: ``opsched.multi`` is the package it builds on), ``opsched.map``
(a model mapped onto several devices) and ``opsched.run`` (a saved plan of any kind, run on its model).

Each goes the one way every command goes (see :mod:`opsched.pipeline`): cost -> search -> compile ->
evaluate (verify against the model's own outputs, time interleaved with the peers, choose the fastest), and
returns an :class:`~opsched.pipeline.Outcome` whose ``plan()`` is the plan to save, ``module`` the chosen
configuration, ``measured_ms`` the measured table and ``chosen`` its name::

    import torch, torchvision, opsched
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
    result = opsched.optimize(model, (torch.randn(1, 3, 64, 64),))
    result.chosen, result.measured_ms        # e.g. 'ios', {'eager': 9.1, 'sequential': 7.9, 'ios': 7.7, ...}
    result.plan().save("plan.json")
    fast = result.module                     # call it as the model

With simulated costs nothing runs: ``plan()`` is the requested method's schedule and ``measured_ms`` is empty.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opsched.cost.devices import is_simulated
from opsched.errors import OpschedError, VerificationError
from opsched.graph.blocks import DEFAULT_MAX_SIZE
from opsched.pipeline import Outcome

TABLE_METHODS = ("sequential", "greedy", "lios")  # made beside the requested method, as the table's rows


def check_cost(cost: str) -> bool:
    """True for a simulated device (``sim:NAME``, known), False for ``measured``; anything else is bad input,
    said before a model is loaded."""
    if is_simulated(cost):
        from opsched.cost.simulate import device_named

        device_named(cost)
        return True
    if cost != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {cost!r}")
    return False


def check_options(cost: str, device: str = "cpu", kernels: str = "eager", cuda_graph: bool = False) -> bool:
    """Refuse in one line what cannot run here (an unknown cost model or kernels, a CUDA device PyTorch does not
    see, a CUDA graph without one), before a model is loaded; True when the costs are simulated."""
    from opsched.runtime.cuda import available as cuda_available
    from opsched.runtime.kernels import check_kernels

    simulated = check_cost(cost)
    if device == "cuda" and not cuda_available():
        raise OpschedError("--device cuda: PyTorch sees no CUDA device here")
    if cuda_graph and (simulated or device != "cuda"):
        raise OpschedError("--cuda-graph needs --device cuda (and measured costs)")
    check_kernels(kernels)
    return simulated


def optimize(model: Any, example_inputs: Sequence[Any], *, method: str = "ios", cost: str = "measured",
             device: str = "cpu", kernels: str = "auto", peers: bool = False, threads: int | None = None,
             streams: int | None = None, max_group_size: int = 3, max_groups: int = 8,
             max_block_size: int = DEFAULT_MAX_SIZE, tolerance: float | None = None, repeats: int = 15,
             cache: bool = True, cuda_graph: bool = False, name: str | None = None, graph: Any = None,
             batch_sizes: Sequence[int] = (), strict: bool = False, wait: bool = False, max_plans: int = 8,
             follow_weights: bool = True, dynamic_shapes: Any = None, say: Callable[[str], Any] = lambda text: None,
             progress: Any = None) -> Outcome:
    """Capture ``model`` (in eval mode, with its inputs, on ``device``) unless its ``graph`` is given, schedule
    it with sequential, greedy, LIOS and ``method``, and on a real device compile every schedule, verify it
    against the model and time it interleaved with the peers (eager; with ``peers`` or compiled ``kernels``
    also torch.compile and ONNX Runtime). ``kernels``: ``auto`` chooses each block's kernel from what each
    measured on it (:mod:`opsched.runtime.auto`), so that a plan may be the model as one ONNX Runtime region;
    ``eager``, ``inductor`` or ``onnxruntime`` run every unit so. Raises :class:`~opsched.errors.VerificationError` when no schedule
    verifies.

    On a real device ``module`` is a :class:`~opsched.runtime.guarded.GuardedModule`: a plan per call
    signature, made the same way for each new one (in the background, the model answering meanwhile; before
    answering with ``wait``; refused with ``strict``), rebuilt when the model's weights change; at most
    ``max_plans`` kept. ``batch_sizes`` makes the plans for those batch sizes now (the example inputs repeated
    or cut along their first dimension). ``follow_weights=False``: the weights, and the settings of PyTorch's
    layers, are not looked at on each call (see :class:`~opsched.runtime.guarded.GuardedModule`;
    ``module.refresh()`` after changing them).
    ``dynamic_shapes`` (torch.export's form: ``({1: Dim("length", min=8, max=512)},)``) declares dimensions
    whose sizes vary: torch.export is asked whether the model keeps them free (a refusal raises
    :class:`~opsched.errors.CaptureError`), and each new size within the ranges gets its plan from the schedule
    made for the example (captured, compiled, verified, timed beside the model; no search): see
    :mod:`opsched.runtime.dynamic`."""
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
        raise OpschedError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    if (batch_sizes or dynamic_shapes is not None) and is_simulated(cost):
        raise OpschedError("batch_sizes and dynamic_shapes need measured costs: a simulated device runs nothing")
    dims = ()
    if dynamic_shapes is not None:
        from opsched.runtime.dynamic import check_with_export, dynamic_dims
        from opsched.runtime.guarded import say_on_stderr

        declared = dynamic_dims(dynamic_shapes, example_inputs, model)
        dims, note = check_with_export(model, tuple(example_inputs), dynamic_shapes, declared)
        for line in [note] * bool(note) + [f"input {k}: dim {d} made static by torch.export: not dynamic"
                                           for k, (a, b) in enumerate(zip(declared, dims)) for d in a if d not in b]:
            say_on_stderr(line)  # about the user's own declaration: said whatever ``say`` is
    options = {"method": method, "cost": cost, "device": device, "kernels": kernels, "peers": peers,
               "threads": threads, "streams": streams, "max_group_size": max_group_size, "max_groups": max_groups,
               "max_block_size": max_block_size, "tolerance": tolerance, "repeats": repeats, "cache": cache,
               "cuda_graph": cuda_graph}
    # weights not watched: the first plan too is built from weights of its own (opsched.models.sharing)
    built_from = model if follow_weights or graph is not None else copy.deepcopy(model)
    from opsched.runtime.guards import attributes_set_by, copied

    with attributes_set_by(built_from) as own:  # what its forward sets itself while it is measured
        outcome = optimize_once(built_from, example_inputs, name=name, graph=graph, say=say, progress=progress,
                                **options)
    if outcome.evaluation is None:
        return outcome
    from opsched.models.spec import rebatch
    from opsched.runtime.guarded import GuardedModule, say_on_stderr

    builder = OptimizeBuilder({**options, "name": name})
    first = copied(tuple(example_inputs))  # the user's own tensors may change later
    outcome.guarded = GuardedModule(model, builder, [builder.plan_of(outcome, first)],
                                    strict=strict, wait=wait, max_plans=max(max_plans, len(batch_sizes) + 1),
                                    follow_weights=follow_weights, dynamic=dims,
                                    own_attributes=own)
    outcome.guarded.say = say  # the job's own progress lines while it makes the batch sizes asked for
    for b in batch_sizes:
        outcome.guarded.prepare(*[rebatch(x, b) for x in example_inputs])
    outcome.guarded.say, outcome.guarded.max_plans = say_on_stderr, max_plans
    return outcome


def optimize_once(model: Any, example_inputs: Sequence[Any], *, method: str = "ios", cost: str = "measured",
                  device: str = "cpu", kernels: str = "auto", peers: bool = False, threads: int | None = None,
                  streams: int | None = None, max_group_size: int = 3, max_groups: int = 8,
                  max_block_size: int = DEFAULT_MAX_SIZE, tolerance: float | None = None, repeats: int = 15,
                  cache: bool = True, cuda_graph: bool = False, name: str | None = None, graph: Any = None,
                  say: Callable[[str], Any] = lambda text: None, progress: Any = None) -> Outcome:
    """:func:`optimize` for the one call signature of ``example_inputs``: its outcome, with no guarded module."""
    import torch

    from opsched.pipeline import Workload, default_streams, method_options, run_workload

    simulated = check_options(cost, device, kernels, cuda_graph)
    cores = threads or torch.get_num_threads()
    if graph is None:
        from opsched.graph.capture import capture

        say("capturing the model ...")
        graph = capture(model, tuple(example_inputs), name=name)
    methods = {m: (m, method_options(m, streams=streams, max_group_size=max_group_size, max_groups=max_groups,
                                     max_block_size=max_block_size,
                                     default_streams=default_streams(simulated, device, cores)))
               for m in dict.fromkeys([*TABLE_METHODS, method])}
    chosen_peers = ("eager", "torch_compile", "onnxruntime") if peers or kernels not in ("eager", "auto") \
        else ("eager",)
    if cuda_graph:  # plans replayed as CUDA graphs meet the model replayed as one (outputs overwritten alike)
        chosen_peers += ("cuda_graph",)
    outcome = run_workload(Workload(model, tuple(example_inputs), graph, methods, cost=cost, device=device,
                                    kernels=kernels, cores=cores, peers=chosen_peers, tolerance=tolerance,
                                    repeats=repeats, cache=cache, cuda_graph=cuda_graph, say=say,
                                    profile_progress=progress, whole_on_inductor=True))
    outcome.graph, outcome.requested = graph, method
    if device == "cuda" and not simulated and not cuda_graph:
        outcome.notes.append("the plans ran on CUDA streams, each kernel launched from the host; at small batch, "
                             "where launches take longer than the kernels, --cuda-graph (cuda_graph=True) replays "
                             "each plan as one CUDA graph, beside the model captured as one (docs/gpu.md)")
    require_a_plan(outcome, model)
    return outcome


class OptimizeBuilder:
    """How the module :func:`optimize` hands back makes its plans (a
    :class:`~opsched.runtime.guarded.PlanBuilder`): a new call signature goes through :func:`optimize_once`
    with the first call's ``options``; a plan whose weights changed is compiled again from a new capture
    and verified (its schedule holds: the graph is the same), or made again whole where it chose a peer."""

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def build(self, model: Any, inputs: tuple) -> Any:
        return self.plan_of(optimize_once(model, inputs, **self.options), inputs)

    @staticmethod
    def plan_of(outcome: Outcome, inputs: tuple) -> Any:
        """The :class:`~opsched.runtime.guarded.Plan` of a measured ``outcome``: its chosen configuration (a
        schedule's module, a peer's callable, or the model itself for eager)."""

        from opsched.runtime.guarded import Plan
        from opsched.runtime.guards import call_signature

        ev = outcome.evaluation
        chosen = ev.chosen
        schedule = outcome.plan(chosen if ev.kinds[chosen] == "schedule" else None)
        module = None if chosen == "eager" else ev.modules.get(chosen)
        note = "eager chosen: no plan is faster above the run's noise" if chosen == "eager" else \
            f"{chosen} chosen, which has no single callable: the model answers" if module is None else ""
        return Plan(call_signature(inputs), inputs, module, chosen, schedule,
                    dict(ev.measured_ms), note)

    def rebuild(self, model: Any, plan: Any) -> Any:
        import dataclasses

        from opsched.deploy import recompile
        from opsched.schedule import ScheduleError

        if plan.chosen == "eager":
            return dataclasses.replace(plan, stale=False)  # nothing derived from the weights
        schedule = plan.schedule
        if schedule is None or schedule.measured is None or plan.chosen != schedule.measured.measured_as:
            return self.build(model, plan.inputs)  # a peer, made again whole
        try:
            module, verdict = recompile(model, plan.inputs, schedule, self.options)
        except ScheduleError:  # the model captures to another graph now: a plan made again whole
            return self.build(model, plan.inputs)
        if not verdict.ok:
            return dataclasses.replace(plan, module=None, chosen="eager", stale=False,
                                       note=f"the plan rebuilt from the model as it is now does not verify: {verdict.why}")
        return dataclasses.replace(plan, module=module, stale=False, note="rebuilt from the model as it is now")

    def resize(self, model: Any, plan: Any, inputs: tuple) -> Any:
        """The plan for ``inputs``, which differ from ``plan``'s only in the sizes of dimensions declared dynamic
        (:mod:`opsched.runtime.dynamic`): the model captured on them, ``plan``'s schedule compiled for that
        graph, verified against the model and timed beside it through the runner (:func:`evaluate_plans`), the
        schedule chosen only where it beats the model above the run's noise. No costs measured, no search: a
        plan made whole where the graph has other units at this size, or where a peer was chosen."""
        from opsched.graph.capture import capture

        schedule = plan.schedule
        if schedule is None or schedule.measured is None or plan.chosen not in ("eager", schedule.measured.measured_as):
            return self.build(model, inputs)
        made = self.sized(model, capture(model, inputs, name=self.options.get("name")), schedule, inputs,
                          plan.signature)
        return self.build(model, inputs) if made is None else made

    def sized(self, model: Any, graph: Any, schedule: Any, inputs: tuple, signature: tuple) -> Any:
        """The plan of ``schedule`` (made for the call ``signature``) compiled for ``graph``, ``model``'s graph
        at ``inputs``, verified against ``model`` and timed beside it (see :meth:`resize`); None where ``graph``
        has other units than the schedule's."""
        import torch
        import torch.utils._pytree as pytree

        from opsched.pipeline import evaluate_plans
        from opsched.runtime.dynamic import schedule_at
        from opsched.runtime.guards import describe
        from opsched.runtime.kernels import plan_kernels

        sized = schedule_at(schedule, graph)
        if sized is None:
            return None
        flat = pytree.tree_leaves(inputs)
        device = self.options.get("device", "cpu")
        origin = schedule.stats.get("scheduled_for") or describe(signature)  # the size it was searched at
        sized.stats["scheduled_for"] = origin
        sized.batch = int(flat[0].shape[0]) if flat and getattr(flat[0], "dim", lambda: 0)() else None
        name = schedule.measured.measured_as
        outcome = Outcome(None, {name: sized}, plan_kernels(graph, sized, device, flat), graph=graph)
        evaluate_plans(outcome, graph, model, inputs, cores=self.options.get("threads") or torch.get_num_threads(),
                       device=device, tolerance=self.options.get("tolerance"), repeats=self.options.get("repeats", 15),
                       cuda_graph=bool(self.options.get("cuda_graph")))
        made = self.plan_of(outcome, inputs)
        if made.schedule is None:  # did not verify at this size
            made.note = f"{name}'s schedule made for {origin} does not verify at this size: " \
                        f"{outcome.evaluation.dropped.get(name, '')}"
        else:
            made.note = f"{made.note + '; ' if made.note else ''}the schedule made for {origin}"
        return made


def require_a_plan(outcome: Outcome, model: Any = None) -> None:
    """Raise :class:`VerificationError` when ``outcome`` was measured and none of its schedules verified; where
    ``model`` holds a module with PyTorch's attention fast path on, saying so."""
    if outcome.evaluation is not None and outcome.evaluation.fastest("schedule") is None:
        schedules = set(outcome.schedules).union(*(other.schedules for other in outcome.also.values()))
        raise VerificationError("no schedule verified: " + "; ".join(
            f"{n}: {why}" for n, why in outcome.evaluation.dropped.items() if n in schedules) + _fast_path_note(model))


def _fast_path_note(model: Any) -> str:
    """Why plans of a model with ``nn.MultiheadAttention`` or ``nn.TransformerEncoderLayer`` may not verify: called
    without gradients, such a module takes PyTorch's fast path (with a padding mask, zeros at the padded
    positions), which a captured program does not take."""
    import torch

    if not isinstance(model, torch.nn.Module) or not torch.backends.mha.get_fastpath_enabled():
        return ""
    kinds = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)
    found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, kinds)})
    if not found:
        return ""
    return (f" (the model's {' and '.join(found)} {'takes' if len(found) == 1 else 'take'} PyTorch's fast path when "
            "called without gradients, which a "
            "captured program does not: with a padding mask its padded positions come out 0; after "
            "torch.backends.mha.set_fastpath_enabled(False) the model answers as its captured program, and "
            "plans made then are kept to calls with the fast path off)")


def optimize_batch(models: Sequence[Any], inputs: Any, *, strict: bool = False, wait: bool = False,
                   max_plans: int = 8, follow_weights: bool = True, dynamic_dims: Sequence[dict] = (),
                   **options: Any) -> Any:
    """Several models as one fused, scheduled, verified program (HiveMind): see
    :func:`opsched.multi.optimize.optimize` for the options (``kernels`` is ``eager`` unless asked, as the server's
    fused groups run; ``opsched multi`` asks for ``auto``). Returns a :class:`~opsched.multi.MultiOutcome`
    (``plan()``, ``module``, ``measured_ms``, ``chosen``, each model's error); raises
    :class:`VerificationError` when no fused plan verifies.

    Measured, ``module`` is a :class:`~opsched.runtime.guarded.GuardedModule` called like the batch (the shared
    inputs, or every model's in order): a fused plan per call signature, made the same way for each new one (in
    the background, the models answering one after another meanwhile; before answering with ``wait``; refused
    with ``strict``), made again when a model's weights change (unless ``follow_weights=False``, as
    :func:`optimize`); at most ``max_plans`` kept. ``dynamic_dims`` (one ``{dim: (lowest, highest)}`` per flat input
    of a call, as :func:`opsched.runtime.dynamic.dynamic_dims` gives them) names dimensions whose sizes vary: a
    call that differs from a plan's only in them gets its plan from that plan's schedule
    (:meth:`BatchBuilder.resize`: no search; verified and timed beside the models)."""
    from opsched.multi.optimize import model_batch
    from opsched.multi.optimize import optimize as optimize_batch
    from opsched.runtime.guarded import GuardedModule
    from opsched.runtime.guards import copied

    # weights not watched: the first plan too is built from weights of its own (opsched.models.sharing); one
    # deepcopy of them all, so that modules the models share stay shared
    result = optimize_batch(models if follow_weights else copy.deepcopy(list(models)), inputs, **options)
    require_a_plan(result.outcome)
    if result.outcome.evaluation is None:  # simulated costs: nothing runs
        return result
    # (the batch's own preprocessing goes with each build: see BatchBuilder.build)
    builder = BatchBuilder({k: v for k, v in options.items() if k not in ("say", "progress", "preprocess")})
    batch = result.fusion.batch if follow_weights else \
        model_batch(models, inputs, options.get("preprocess"), options.get("separate_inputs", False)).eval()
    first = copied(tuple(batch.inputs))
    result.outcome.guarded = GuardedModule(batch, builder, [builder.plan_of(result, first)], strict=strict,
                                           wait=wait, max_plans=max_plans, follow_weights=follow_weights,
                                           dynamic=tuple(dynamic_dims))
    return result


def _shared(batch: Any) -> bool:
    """Whether the batch's models read one set of inputs (or the preprocessing's), not each its own."""
    return batch.preprocess is not None or batch.shared_input


def _as_given(batch: Any, inputs: tuple) -> Any:
    """A call's inputs as the job takes them: the shared ones, or each model's (see :func:`_shared`)."""
    return tuple(inputs) if _shared(batch) else batch.split(inputs)


class BatchBuilder:
    """How the module :func:`optimize_batch` hands back makes its plans (a
    :class:`~opsched.runtime.guarded.PlanBuilder`): a new call signature goes through the same job with the first
    call's ``options``, on the batch's models; a plan whose weights changed is made again from its schedule (its
    batched units and stacked weights from the models as they are now). ``sequential_models`` chosen, the batch
    itself answers."""

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def build(self, batch: Any, inputs: tuple) -> Any:
        from opsched.multi.optimize import optimize as optimize_batch

        given = self._given(batch, inputs)
        result = optimize_batch(list(batch.models), given, preprocess=batch.preprocess, **self.options)
        require_a_plan(result.outcome)
        return self.plan_of(result, inputs)

    def _given(self, batch: Any, inputs: tuple) -> Any:
        """The call's inputs as the job takes them (:func:`_as_given`); raises :class:`MultiError` where a batch
        first called with each model's own inputs is called with inputs of one layout (the job would read them
        as shared)."""
        from opsched.multi.combine import MultiError, input_layout

        given = _as_given(batch, inputs)
        if not _shared(batch) and not self.options.get("separate_inputs") \
                and len({input_layout(a) for a in given}) == 1:
            raise MultiError("every model's inputs have one layout in this call, and a batch first called with "
                             "each model's own inputs reads them all: no fused plan is made for it")
        return given

    def rebuild(self, batch: Any, plan: Any) -> Any:
        """``plan`` made again from the models' new weights: its schedule, on the fused graph made again with the
        batched units it records (as :meth:`resize` makes it at another size), verified and timed; no search.
        Before, a weight change searched the fused graph again whole (the fused group of a server of 16 ResNet-18:
        minutes)."""
        return self.resize(batch, plan, plan.inputs)

    def resize(self, batch: Any, plan: Any, inputs: tuple) -> Any:
        """The plan for ``inputs``, which differ from ``plan``'s only in the sizes of dimensions declared dynamic:
        the batch's fused graph made again at them with the batched units ``plan`` records (no cost model
        asked), ``plan``'s schedule compiled for it, verified against every model and timed beside them one after
        another, as :meth:`OptimizeBuilder.resize` does for one model. A plan made whole where the fused graph
        has other units at this size, or where a peer was chosen."""
        import dataclasses

        from opsched.multi.combine import MultiError
        from opsched.multi.fuse import fuse_graph
        from opsched.multi.optimize import MultiOutcome, model_batch

        schedule = plan.schedule
        # (the models one after another chosen at the plan's size, its schedule may still pay at this one)
        if schedule is None or schedule.models is None or schedule.measured is None \
                or plan.chosen not in ("eager", "sequential_models", schedule.measured.measured_as):
            return self.build(batch, inputs)
        sized = model_batch(list(batch.models), self._given(batch, inputs), batch.preprocess,
                            bool(self.options.get("separate_inputs")))
        try:
            fusion = fuse_graph(sized, schedule.models.rewrites, made=schedule.models.batched)
        except MultiError:  # the batched units the plan records cannot be made at this size
            return self.build(batch, inputs)
        options = {k: v for k, v in self.options.items() if k in ("device", "tolerance", "repeats", "cuda_graph",
                                                                   "kernels")}
        # on the batch's device where none was asked for, as its first plan (opsched.multi.optimize)
        made = OptimizeBuilder({**options, "device": options.get("device") or sized.device,
                                "threads": self.options.get("cores")}).sized(
            sized, fusion.graph, schedule, inputs, plan.signature)
        if made is None:
            return self.build(batch, inputs)
        if made.schedule is not None:  # what rebuilds its fused graph, as the first plan's
            made.schedule = dataclasses.replace(made.schedule, models=MultiOutcome(fusion, None).models_section())
        return made

    @staticmethod
    def plan_of(result: Any, inputs: tuple) -> Any:
        """The :class:`~opsched.runtime.guarded.Plan` of a measured model batch's ``result`` (its schedule with
        the ``models`` section that rebuilds it)."""
        import dataclasses

        plan = OptimizeBuilder.plan_of(result.outcome, inputs)
        if plan.chosen == "sequential_models":  # the models one after another: what the batch itself does
            plan = dataclasses.replace(plan, module=None, note="sequential_models chosen: no plan is faster "
                                                              "above the run's noise")
        # the plan's own schedule, with the models section that rebuilds it
        models = result.plan().models if plan.schedule is not None else None
        return dataclasses.replace(plan, schedule=plan.schedule and dataclasses.replace(plan.schedule, models=models))


@dataclass
class Mapped(Outcome):
    """A mapping's outcome: the :class:`~opsched.mapping.problem.Problem` it solved and the solver's answer
    (``solved``: mapping, timeline, lower bound, proof), besides the runner's outcome. On real devices the
    schedules are the mapping and each device alone, verified and timed beside eager; on simulated ones,
    the mapping only."""

    problem: Any = None
    solved: Any = None

    def plan(self, name: str | None = None) -> Any:
        """The mapping asked for (not a device alone, though faster: that is what ``chosen`` says), recording
        what was chosen and every measured figure."""
        return Outcome.plan(self, name or self.requested)

    @property
    def measured(self) -> bool:
        return self.evaluation is not None


def map(model: Any, example_inputs: Sequence[Any] | None = None, *, platform: Any, method: str,
        objective: str = "latency", batch: int | None = None, time_limit: float = 30.0, seed: int = 0,
        symmetry: str = "none", latencies: Any = None, edge_bytes: Any = None, threads: int | None = None,
        tolerance: float | None = None, repeats: int = 15, cache: bool = True, name: str | None = None,
        graph: Any = None, say: Callable[[str], Any] = lambda text: None, progress: Any = None,
        notes: Callable[[str], Any] = lambda text: None) -> Mapped:
    """Map ``model`` onto ``platform`` (a :class:`~opsched.mapping.platform.Platform`, or a built-in's name
    or a PLATFORM.json path) with ``method``. ``model`` is a PyTorch model (captured with
    ``example_inputs``, unless its captured ``graph`` is given) or a :class:`~opsched.graph.ir.Graph` (a DAG JSON
    graph, with ``latencies`` per unit and device and ``edge_bytes``, or a model's units for simulated devices).

    On a platform whose devices are all real, with a PyTorch model, the mapped plan is compiled onto its
    devices, verified against the model and timed interleaved with eager and with every device alone (the
    single-device configurations); the one ``chosen`` above the run's noise is recorded in the plan. Elsewhere
    the figures are the replay's prediction (simulated, or a DAG JSON graph's own latencies) and nothing
    runs."""
    import torch

    from opsched.graph.ir import Graph
    from opsched.mapping.plan import to_schedule
    from opsched.mapping.platform import load_platform
    from opsched.mapping.problem import build_problem
    from opsched.mapping.replay import replay
    from opsched.mapping.solve import solve

    if isinstance(platform, str):
        platform = load_platform(platform)
    cores = threads or torch.get_num_threads()  # the caller's, before anything measured sets its own
    runnable = not isinstance(model, Graph)
    kernels = None
    if runnable:
        from opsched.runtime.choice import choose_kernels, place_of
        from opsched.runtime.kernels import ChosenKernels

        if graph is None:
            from opsched.graph.capture import capture

            say("capturing the model ...")
            graph = capture(model, tuple(example_inputs), name=name)
        # one kernel per unit for the whole platform, chosen before the mapping: each unit is measured on the
        # kernel it will run on, whichever device the mapping puts it on
        kernels = ChosenKernels(choose_kernels(graph, "eager", place_of([d.kind for d in platform.devices])))
        measure = UnitCosts(graph, _flat(example_inputs), cache, kernels)
        problem = build_problem(graph, platform, objective, batch or int(_flat(example_inputs)[0].shape[0]),
                                measure=measure)
        if sum(device.kind == "cpu" for device in platform.devices) > 1:  # threads of one process, side by side
            problem.handoff = measure.handoff
    else:
        graph = model
        problem = build_problem(graph, platform, objective, batch or 1, latencies, edge_bytes)
    for note in problem.notes:
        notes(note)
    solved = solve(problem, method, time_limit=time_limit, seed=seed, symmetry=symmetry, progress=progress)
    timeline = solved.timeline
    cpus = sorted({job.device for job in solved.mapping.jobs() if platform.devices[job.device].kind == "cpu"})
    if runnable and len(cpus) > 1:
        # Several CPU devices busy together: each device's units cost what they do beside the others' (measured
        # for this mapping). The search compared mappings on the units alone; its bound and optimum hold for
        # those, and so below this.
        from opsched.runtime.corun import co_running_factors

        say("measuring each device's units beside the other devices' ...")
        devices = [([job.unit for job in solved.mapping.order[d]], platform.devices[d].threads) for d in cpus]
        problem.co_running = dict(zip(cpus, co_running_factors(graph, tuple(example_inputs), devices,
                                                               kernels=kernels)))
        timeline = replay(problem.beside(), solved.mapping)
    plan = to_schedule(problem, solved.mapping, timeline, method, solved.lower_bound, solved.optimal,
                       solved.stats)
    outcome = Mapped(cost=None, schedules={method: plan}, kernels=kernels, problem=problem, solved=solved,
                     graph=graph, requested=method)
    simulated = [d.name for d in plan.devices.devices if d.simulated]
    if not runnable or len(simulated) == len(plan.devices.devices):
        return outcome  # a graph's own latencies, or simulated devices only: the replay is the figure
    if simulated or plan.devices.split_batch:
        outcome.notes.append("not timed: " + (f"the platform has simulated device(s) {', '.join(simulated)}"
                                              if simulated else "the plan splits the batch across devices, which "
                                              "runs only in simulation"))
        return outcome
    from opsched.mapping.execute import check_runnable
    from opsched.pipeline import evaluate_plans

    check_runnable(plan)  # a CUDA device this machine does not have is said before anything runs
    # each device alone first: the simpler configuration, kept when the mapping only ties it (opsched.noise)
    outcome.schedules = {**single_device_plans(problem), **outcome.schedules}
    evaluate_plans(outcome, graph, model, tuple(example_inputs), cores=cores, tolerance=tolerance,
                   repeats=repeats, say=say)
    if outcome.plan() is None:
        raise VerificationError(f"the {method} mapping does not reproduce the model: "
                                f"{outcome.evaluation.dropped.get(method)}")
    return outcome


def single_device_plans(problem: Any) -> dict[str, Any]:
    """The whole graph on one device, for each kind of device of ``problem``'s platform that can hold it
    (devices alike in kind and threads are one configuration): ``{"NAME alone": plan}``, the baselines a
    mapping must beat."""
    from opsched.mapping import MappingError
    from opsched.mapping.plan import Mapping, check, to_schedule
    from opsched.mapping.replay import replay

    platform = problem.platform
    order = range(problem.n)  # a Graph's units are in a topological order
    plans, seen = {}, set()
    for d, device in enumerate(platform.devices):
        if (device.kind, device.threads) in seen:
            continue
        seen.add((device.kind, device.threads))
        mapping = Mapping.from_devices(problem.n, [d] * problem.n, order, len(platform.devices))
        try:
            check(problem, mapping)
        except MappingError:  # a device that cannot hold the whole graph is no configuration
            continue
        timeline = replay(problem, mapping)
        name = f"{device.name} alone"
        plans[name] = to_schedule(problem, mapping, timeline, name, 0.0, False, {})
    return plans


def run(plan: Any, model: Any, example_inputs: Sequence[Any], *, graph: Any = None, baseline: str = "eager",
        threads: int | None = None, tolerance: float | None = None, repeats: int = 15, cuda_graph: bool = False,
        engine: Callable[[str, int], Sequence[Any]] | None = None) -> Outcome:
    """Run ``plan`` (a :class:`~opsched.schedule.Schedule` of any kind, or its file's path) on ``model`` fed
    ``example_inputs``, on the device it was made for, every unit on the kernel it records: verified against
    the model and timed interleaved with ``baseline`` and with the peer the plan chose, if it chose one.
    ``graph`` is the model captured, when the caller has it; a model batch's plan runs on its fused graph, which
    the caller makes (:func:`opsched.multi.load.rebuild_batch` gives the batch and the graph; the baseline is
    then ``sequential_models``). ``engine(label, cores)`` gives the candidates that run the plan elsewhere (the
    Ray engine's actors) instead of this process. Returns the :class:`~opsched.pipeline.Outcome` (its
    ``requested`` is the plan's label: ``ios``, or ``ios+regions``); raises :class:`OpschedError` (one line) for
    a plan that cannot run here (a simulated device, a mapping onto devices this machine lacks, CUDA without a
    GPU, a model batch's plan without its graph), :class:`~opsched.schedule.ScheduleError` when the plan is not
    this model's and :class:`VerificationError` when it does not reproduce it."""
    import torch
    import torch.utils._pytree as pytree

    from opsched import schedule as schedule_module
    from opsched.pipeline import evaluate_plans
    from opsched.runtime.kernels import plan_kernels

    if not isinstance(plan, schedule_module.Schedule):
        plan = schedule_module.load(plan)
    check_runs_here(plan)
    if plan.kind == "model batch" and graph is None:
        raise OpschedError("a model batch's plan runs on its fused graph: pass graph= (see "
                           "opsched.multi.load.rebuild_batch)")
    device = plan.device if plan.device in ("cpu", "cuda") else "cpu"  # a mapped plan runs on its CPU devices
    if cuda_graph and device != "cuda":
        raise OpschedError(f"a CUDA graph needs a plan made for cuda; this one was made for {plan.device}")
    inputs = tuple(example_inputs)
    if graph is None:
        from opsched.graph.capture import capture

        graph = capture(model, inputs)
    schedule_module.validate(plan, graph)
    cores = threads or torch.get_num_threads()
    label, chosen = plan_choice(plan)
    kernels = plan_kernels(graph, plan, device, pytree.tree_leaves(inputs))
    elsewhere = list(engine(label, cores)) if engine is not None else []
    outcome = Outcome(None, {} if engine is not None else {label: plan}, kernels, graph=graph, requested=label)
    peers = [baseline] + ([chosen["name"]] if chosen["kind"] == "peer" and chosen["name"] != baseline else [])
    evaluate_plans(outcome, graph, model, inputs, cores=cores, device=device, peers=peers, tolerance=tolerance,
                   repeats=repeats, cuda_graph=cuda_graph or plan.run.cuda_graph, extra=elsewhere)
    if label not in outcome.evaluation.measured_ms:
        raise VerificationError(f"the plan does not run as it should: {outcome.evaluation.dropped.get(label)}")
    return outcome


def plan_choice(plan: Any) -> tuple[str, dict[str, Any]]:
    """What ``plan`` is, as its run measured it (``ios``, or ``ios+regions`` with compiled regions; its method
    where it was not measured), and what that run chose (a schedule, or a peer)."""
    label = plan.measured.measured_as if plan.measured else plan.method
    return label, plan.measured.chosen if plan.measured else {"name": label, "kind": "schedule"}


def check_runs_here(plan: Any, source: str = "the plan") -> dict[str, int] | None:
    """Raise :class:`OpschedError` (one line) unless ``plan`` can run on this machine: not made for a simulated
    device, a mapping onto devices this machine has (its units per device are returned), CUDA where PyTorch sees
    a GPU."""
    from opsched.runtime.cuda import available as cuda_available

    devices = None
    if plan.kind == "mapping":
        from opsched.mapping.execute import check_runnable

        devices = check_runnable(plan)  # refuses simulated devices in one line
    if is_simulated(plan.device):
        raise OpschedError(f"{source} was made for a simulated device ({plan.device}); it can be shown "
                           "(opsched show) but not run here")
    if plan.device == "cuda" and not cuda_available():
        raise OpschedError(f"{source} was made for cuda; PyTorch sees no CUDA device here")
    return devices


class UnitCosts:
    """``build_problem``'s ``measure``: the units' measured milliseconds on a real device (a CPU device at its
    threads; a CUDA device with the units' weights and the inputs copied there), measured once per kind.
    ``handoff``: what a value crossing between two CPU devices costs the local engine, which runs them as
    threads of one process: the thread waiting for it is woken. The measured cost model's hand-off, from the
    first CPU device measured, as that model charges a value crossing streams. Every unit is measured on the
    kernel ``kernels`` (the mapping's :class:`~opsched.runtime.kernels.ChosenKernels`) chose for it, which is
    the kernel the mapped plan runs it on."""

    def __init__(self, graph: Any, inputs: Sequence[Any], cache: bool, kernels: Any):
        self.graph, self.inputs, self.cache, self.kernels = graph, inputs, cache, kernels
        self.costs: dict[tuple[str, int], list[float]] = {}
        self.handoff = 0.0

    def __call__(self, device: Any, threads: int) -> list[float]:
        from opsched.mapping.execute import check_cuda_devices, on_cuda_device
        from opsched.pipeline import cost_model
        from opsched.schedule import PlanDevice

        graph, inputs, cache = self.graph, self.inputs, self.cache
        gpu = PlanDevice(device.name, device.kind, device.node, threads).cuda_index
        if gpu is not None:
            check_cuda_devices([(device.name, device.kind)], "the platform has")
        key = (device.kind, 1 if gpu is not None else threads)  # threads are a CPU device's
        if key not in self.costs:
            if gpu is None:
                cost, _ = cost_model(graph, inputs, "measured", cores=threads, device="cpu", cache=cache,
                                     kernels=self.kernels)
                self.costs[key] = [cost.latency[threads][u] for u in range(len(graph))]
                self.handoff = self.handoff or cost.sync_overhead
            else:  # the units' weights and the inputs on that GPU, timed there
                with on_cuda_device(graph, inputs, gpu) as (placed, moved):
                    cost, _ = cost_model(placed, moved, "measured", device="cuda", cache=cache,
                                         kernels=self.kernels)
                self.costs[key] = [cost.best[u] for u in range(len(graph))]
        return self.costs[key]


def _flat(inputs: Any) -> list[Any]:
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tuple(inputs))
