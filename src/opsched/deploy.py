"""Plans across processes: :func:`save` writes every call signature an optimized module serves into one plan
file, and :func:`load` (``opsched.load``) makes the optimized module again for a model built elsewhere (another
process, another machine of the same kind), checking the plan against it.

A plan file of ``opsched optimize`` is the chosen schedule of its first call signature (what ``opsched run``
and ``opsched show`` read), with ``inputs`` (the call it was made for: each input's shape, strides, dtype),
``build`` (the options more plans are made with) and ``signatures`` (each other call signature's inputs, its
chosen configuration, its measured figures and its schedule)::

    result = opsched.optimize(model, (x,), batch_sizes=[1, 8])
    result.save("plan.json")
    # elsewhere, with the same model class and weights:
    fast = opsched.load("plan.json", model)

For each signature :func:`load` captures the model on inputs of that signature, checks that the graph is the one
the plan was made for (its fingerprint), compiles the schedule and verifies it against the model on those
inputs; a plan for another model (or a PyTorch that captures it differently) is a
:class:`~opsched.schedule.ScheduleError`, a plan that does not reproduce the model a
:class:`~opsched.errors.VerificationError`. Nothing is timed again: the plan's choice stands, as measured where
it was made.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.errors import OpschedError, VerificationError, first_line
from opsched.runtime.dynamic import dims_from_record, dims_record
from opsched.schedule import Schedule, ScheduleError
from opsched.schedule import from_dict as schedule_from_dict
from opsched.schedule import load as load_schedule

# the options of opsched.optimize a plan file records, so that a loaded module makes more plans the same way
BUILD_OPTIONS = ("method", "cost", "device", "kernels", "peers", "threads", "streams", "max_group_size",
                 "max_groups", "max_block_size", "tolerance", "repeats", "cache", "cuda_graph", "name")


def plan_file(module: Any) -> Schedule:
    """The plan file of a :class:`~opsched.runtime.guarded.GuardedModule`: its first signature's schedule with
    every signature it serves from the weights as they are (a plan built from weights that changed since is
    written once rebuilt, at its signature's next call), and made without autocast (a plan made under autocast is
    made again at its first such call after loading: the file records calls, not modes). Raises
    :class:`OpschedError` when no signature has a verified schedule."""
    from opsched.runtime.guards import inputs_record

    changed = module.watch.changed()
    if changed:
        raise OpschedError(f"{changed} since the last call: call the module once (its plans are rebuilt), then save")
    plans = sorted((p for p in list(module.plans.values()) if not p.stale and not p.signature[1]),
                   key=lambda p: p.made or 0)  # a copy
    with_schedule = [p for p in plans if p.schedule is not None]
    if not with_schedule:
        raise OpschedError("no call signature of this module has a verified schedule to save")
    first = with_schedule[0]  # the first made that has a schedule
    head = schedule_from_dict(_plain(first.schedule))
    if head.measured is not None:
        head.measured = dataclasses.replace(head.measured, chosen={**head.measured.chosen, "name": first.chosen})
    head.inputs, head.input_structure = inputs_record(first.inputs)
    head.build = {k: v for k, v in module.builder.options.items() if k in BUILD_OPTIONS}
    if module.dynamic:
        head.build["dynamic"] = dims_record(module.dynamic)
    head.signatures = [{**dict(zip(("inputs", "input_structure"), inputs_record(p.inputs))), "chosen": p.chosen,
                        "measured_ms": {n: round(ms, 4) for n, ms in p.measured_ms.items()}, "note": p.note,
                        "plan": _plain(p.schedule)} for p in plans if p is not first]
    return head


def _plain(schedule: Schedule | None) -> dict[str, Any] | None:
    if schedule is None:
        return None
    doc = schedule.to_dict()
    for key in ("inputs", "input_structure", "build", "signatures"):
        doc.pop(key, None)
    return doc


def save(module: Any, path: str | Path) -> None:
    """Write ``module``'s plan file (see :func:`plan_file`) to ``path``, whole or not at all."""
    plan_file(module).save(path)


def load(path: str | Path, model: torch.nn.Module, *, strict: bool = False, wait: bool = False,
         max_plans: int = 8, follow_weights: bool = True, tolerance: float | None = None,
         say: Callable[[str], Any] | None = None) -> Any:
    """The optimized module of the plan file at ``path`` for ``model`` (in eval mode, on the plan's device),
    built in this process: a :class:`~opsched.runtime.guarded.GuardedModule` serving every signature the file
    holds, making plans for new ones as ``opsched.optimize`` would (``strict``, ``wait``, ``max_plans``,
    ``follow_weights`` as there). See the module's docstring for what is checked."""
    from opsched.jobs import OptimizeBuilder
    from opsched.runtime.guarded import GuardedModule, say_on_stderr
    from opsched.runtime.guards import attributes_set_by

    head = load_schedule(path)
    if head.kind != "schedule":
        raise ScheduleError(f"{path}: opsched.load takes a plan of opsched optimize; this one is a {head.kind}'s "
                            "(run it with opsched run)")
    if head.inputs is None:
        raise ScheduleError(f"{path}: the plan does not record the call it was made for (written before plan "
                            "files held their inputs): make it again with opsched optimize")
    if not isinstance(model, torch.nn.Module):
        raise OpschedError(f"opsched.load needs the model as a torch.nn.Module, got {type(model).__name__}")
    model.eval()
    options = {k: v for k, v in (head.build or {}).items() if k in BUILD_OPTIONS}
    if tolerance is not None:
        options["tolerance"] = tolerance
    builder = OptimizeBuilder(options)
    entries = [((head.inputs, head.input_structure), head.measured.chosen["name"] if head.measured else head.method,
                dict(head.measured.measured_ms) if head.measured else {}, "", head)]
    for k, sig in enumerate(head.signatures):
        if not isinstance(sig, dict) or not isinstance(sig.get("inputs"), list):
            raise ScheduleError(f"{path}: signature {k} does not record its inputs")
        schedule = schedule_from_dict(sig["plan"], f"{path} (signature {k})") if sig.get("plan") else None
        entries.append(((sig["inputs"], sig.get("input_structure")), str(sig.get("chosen", "eager")), dict(sig.get("measured_ms", {})),
                        str(sig.get("note", "")), schedule))
    built_from = model if follow_weights else copy.deepcopy(model)  # weights not watched: opsched.models.sharing
    with attributes_set_by(built_from) as own:  # what its forward sets itself while the plans are verified
        plans = [_loaded_plan(path, built_from, builder, *entry, options) for entry in entries]
    dynamic = dims_from_record(head.build["dynamic"], str(path)) if "dynamic" in (head.build or {}) else ()
    return GuardedModule(model, builder, plans, strict=strict, wait=wait, max_plans=max(max_plans, len(plans)),
                         follow_weights=follow_weights, dynamic=dynamic,
                         own_attributes=own, say=say or say_on_stderr)


def _loaded_plan(path: str | Path, model: torch.nn.Module, builder: Any, record: list, chosen: str,
                 measured_ms: dict[str, float], note: str, schedule: Schedule | None, options: dict) -> Any:
    """One signature's plan, made for ``model`` and verified; a peer's (other than eager) is marked stale, so
    that its first call makes it again."""
    from opsched.runtime.guards import example_inputs, without_autocast

    try:
        inputs = example_inputs(*record)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ScheduleError(f"{path}: the inputs it records cannot be made ({e})") from None
    with without_autocast():  # a plan file's plans were made without autocast: so are they made and guarded here
        return _made_again(path, model, inputs, chosen, measured_ms, note, schedule, options)


def _made_again(path: str | Path, model: torch.nn.Module, inputs: tuple, chosen: str, measured_ms: dict[str, float],
                note: str, schedule: Schedule | None, options: dict) -> Any:
    from opsched.runtime.guarded import Plan
    from opsched.runtime.guards import call_signature, describe

    signature = call_signature(inputs)
    runs_schedule = schedule is not None and schedule.measured is not None and chosen == schedule.measured.measured_as
    if not runs_schedule:
        if schedule is not None:  # the model answers this call (or a peer): still, the plan must be this model's
            same_graph(model, inputs, schedule, options, str(path))
        return Plan(signature, inputs, None, chosen, schedule, measured_ms, note, stale=chosen != "eager")
    try:
        module, verdict = recompile(model, inputs, schedule, options, str(path))
    except ScheduleError:
        raise
    except Exception as e:
        raise VerificationError(f"{path}: this model cannot run the call the plan was made for "
                                f"({describe(signature)}): {first_line(e)}") from e
    if not verdict.ok:
        raise VerificationError(f"{path} does not reproduce this model: {verdict.why} (are these the weights "
                                "the plan was made for, in eval mode?)")
    return Plan(signature, inputs, module, chosen, schedule, measured_ms, note)


def same_graph(model: torch.nn.Module, inputs: tuple, schedule: Schedule, options: dict[str, Any],
               source: str = "the plan") -> Any:
    """``model`` captured on ``inputs``; raises :class:`ScheduleError` when its graph is not the one ``schedule``
    was made for."""
    from opsched.graph.capture import capture

    graph = capture(model, inputs, name=options.get("name"))
    if graph.fingerprint != schedule.fingerprint:
        raise ScheduleError(f"{source} was made for another model, or a PyTorch that captures it differently: its "
                            f"graph {schedule.graph_name} has fingerprint {schedule.fingerprint}, this model's "
                            f"{graph.name} has {graph.fingerprint} (torch {torch.__version__})")
    return graph


def recompile(model: torch.nn.Module, inputs: tuple, schedule: Schedule, options: dict[str, Any],
              source: str = "the plan") -> tuple[Any, Any]:
    """``schedule`` compiled for ``model`` captured on ``inputs`` (the weights as they are now), and its
    verification against the model on those inputs. Raises :class:`ScheduleError` when the captured graph is
    not the one the schedule was made for."""
    from opsched.evaluation import verify
    from opsched.runtime.guards import Guard
    from opsched.runtime.kernels import plan_kernels
    from opsched.runtime.module import OptimizedModule

    graph = same_graph(model, inputs, schedule, options, source)
    flat = pytree.tree_leaves(inputs)
    cores = options.get("threads") or torch.get_num_threads()
    device = schedule.device if schedule.device in ("cpu", "cuda") else "cpu"
    kernels = plan_kernels(graph, schedule, device, flat)
    module = OptimizedModule(graph, schedule, cores, kernels, device=device,
                             cuda_graph=schedule.run.cuda_graph, guard=Guard.of(inputs, model))
    return module, verify(module, model, inputs, options.get("tolerance"))
