"""What the commands share: loading and capturing a model, reading a plan, naming output files, progress.

Imports nothing of opsched's commands or runner: every command module builds on it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError


def load_and_capture(args: argparse.Namespace, spec: str, device: str | None = None,
                     say: Callable[[str], Any] = lambda text: None):
    """Load the model ``spec`` names (with ``--batch``, ``--input-shape``, ``--image-size``) and capture it:
    (loaded model, graph, seconds loading, seconds capturing). With ``device``, the model is first put in
    inference mode and moved there with its inputs, as the commands that run it need. ``say`` is told of the
    capture once the model has loaded: a model specifier that does not load is bad input, reported alone."""
    from opsched.graph.capture import capture
    from opsched.models.spec import load_model, parse_shape

    started = time.perf_counter()
    shapes = [parse_shape(s) for s in args.input_shape or []]
    loaded = load_model(spec, batch=args.batch, input_shapes=shapes or None, image_size=args.image_size)
    if device is not None:
        loaded.model.eval()
        if device != "cpu":
            from opsched.runtime.cuda import tensor_device

            loaded.to(tensor_device(device))
    loaded_at = time.perf_counter()
    say(f"capturing {loaded.name} ...")
    graph = capture(loaded.model, tuple(loaded.inputs), name=loaded.name)
    return loaded, graph, loaded_at - started, time.perf_counter() - loaded_at


def flat(inputs):
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tuple(inputs))


def read_plan(path: str) -> Any:
    """The plan at ``path``, read and checked (see :func:`opsched.schedule.from_dict`)."""
    from opsched.jsonfile import read_json
    from opsched.schedule import ScheduleError, from_dict

    return from_dict(read_json(path, ScheduleError), path)


def output_paths(args, model_spec: str) -> tuple[Path, Path]:
    """The plan and Gantt paths. Nothing is overwritten without --force: a file the user names that exists
    is refused; the default names (opsched-MODEL-bB-METHOD.json and .png) take the first free number
    (``-2``, ``-3``, ...) when an earlier run left its files there."""
    gantt = getattr(args, "gantt", None)
    if args.out:
        plan = Path(args.out)
        if plan.exists() and not args.force:
            raise OpschedError(f"{plan} exists; pass --force to overwrite it")
    else:
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in model_spec.split("/")[-1])
        stem = f"opsched-{stem}-b{args.batch or 1}-{args.method}"
        plan, number = Path(f"{stem}.json"), 1
        while not args.force and (plan.exists() or (not gantt and plan.with_suffix(".png").exists())):
            number += 1
            plan = Path(f"{stem}-{number}.json")
    gantt_path = Path(gantt) if gantt else plan.with_suffix(".png")
    if gantt and gantt_path.exists() and not args.force:
        raise OpschedError(f"{gantt_path} exists; pass --force to overwrite it")
    return plan, gantt_path


def refuse_existing(*paths: str | None, force: bool = False) -> None:
    """Nothing a user wrote is overwritten without asking: refuse, in one line, a path given that exists."""
    for path in paths:
        if path and Path(path).exists() and not force:
            raise OpschedError(f"{path} exists; pass --force to overwrite it")


def timeline_title(plan, name: str) -> str:
    if plan.simulated:
        on = plan.devices.platform["name"] if plan.devices is not None else plan.cost[4:]
        what = f"SIMULATED on {on} (predicted, not measured)"
    elif not plan.costed:
        what = (f"its units' timeline predicted by the {plan.cost} cost model on its own kernels (the plan runs as "
                "one region compiled by Inductor: measured, not costed)")
    else:
        what = f"predicted by the {plan.cost} cost model"
    # a DAG JSON file's latencies have no unit; a mapping says which it has
    unit = time_unit(plan)
    unit = f" {unit}" if unit else ""
    batch = f", batch {plan.batch}" if plan.batch else ""
    return f"{name}, {plan.method}{batch}: {what}, {plan.predicted_latency:.3g}{unit}"


def time_unit(plan: Any) -> str:
    """The unit of a plan's times: none for a DAG JSON graph's latencies; a mapping's own; else ms."""
    if plan.devices is not None:
        return plan.devices.time_unit
    return "" if plan.cost == "table" else "ms"


def choice_text(result: dict[str, Any]) -> str:
    """Why ``chosen`` was chosen, in words: the only configuration that nothing beats above the run's noise,
    or one of several and kept as the simplest, with the noise floor measured in the run."""
    noise = result["noise"]
    floor = noise["same_program_spread"]
    floor_text = f"one program timed twice differed by {100 * floor:.1f}%" if floor is not None else ""
    others = [n for n in result["tie"] if n != result["chosen"]]
    if others:
        return (f"tied with {', '.join(others)} within this run's noise ({floor_text}; a gain must clear that "
                "and the bootstrap interval of the ratio), kept as the simpler")
    return f"every other configuration is beaten above this run's noise ({floor_text})"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def run_progress(description: str, total: int):
    """The profiler's ``progress``: its runs, as a bar on a terminal or a few lines elsewhere (see
    :mod:`opsched.progress`)."""
    from opsched.progress import progress_bar

    return progress_bar(description, total, unit="run")


def block_progress():
    """A progress callback for a block-by-block search, on stderr (see :mod:`opsched.progress`)."""
    from opsched.progress import progress_bar

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar("searching", total, unit="block")
        bar.update(1)
        if done == total:
            bar.close()

    return update


def measured_fields(outcome: Any, plan: Any, baseline: str = "eager") -> dict[str, Any]:
    """The measured part of a job's JSON: every verified configuration's median and speedup over ``baseline``
    (paired over the rounds both ran: :meth:`~opsched.evaluation.Evaluation.speedups`), the one chosen, the
    errors, and what was dropped or left out and why."""
    ev = outcome.evaluation
    out: dict[str, Any] = {
        "measured_ms": dict(ev.measured_ms), "speedups": {"over": baseline, **ev.speedups(baseline)},
        "threads": {n: t for n, t in ev.threads.items() if t is not None},
        "chosen": ev.chosen, "tie": list(ev.tie), "noise": ev.noise(), "plan_method": plan.measured.measured_as,
        "max_error": ev.errors[plan.measured.measured_as], "max_abs_error": ev.abs_errors[plan.measured.measured_as],
        "max_errors": dict(ev.errors), "max_abs_errors": dict(ev.abs_errors), "dropped": dict(ev.dropped),
        "warnings": ev.warnings + outcome.notes,
    }
    if outcome.cost is not None:
        out["cost_model"] = outcome.cost.describe()
    out["eager_threads"] = ev.threads.get("eager")
    out["fastest_measured"] = ev.chosen
    kernels = outcome.kernels
    compiled = [o.kernels for o in outcome.same_graph() if o.kernels is not None and o.kernels.asked != "eager"]
    if compiled:  # (the whole graph on Inductor, where auto offered it, included)
        out["compile_seconds"] = round(sum(k.compile_seconds for k in compiled), 1)
    eager = kernels.eager_units if kernels is not None else None
    if eager:
        out["warnings"].append(f"{len(eager)} unit(s) ONNX Runtime could not take ran eagerly: "
                               f"{', '.join(eager[:5])}{' ...' if len(eager) > 5 else ''}")
    return out
