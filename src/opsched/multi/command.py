"""``opsched multi``: several models as one fused, scheduled, verified program (see docs/multi.md)."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

from opsched.errors import OpschedError


def load_batch(args: argparse.Namespace) -> tuple[list[str], list[Any]]:
    """The models the command line names (each ``--copies`` times, every copy with its own seeded random
    weights): their names and LoadedModels."""
    import torch

    from opsched.models.spec import LoadedModel, load_models, parse_shape

    shapes = [parse_shape(s) for s in args.input_shape or []]
    loaded: list[LoadedModel] = []
    for spec in args.models:
        group = load_models(spec, batch=args.batch, input_shapes=shapes or None, image_size=args.image_size)
        for k in range(args.copies):
            if k == 0:
                loaded += group
                continue
            models = copy.deepcopy([g.model for g in group])  # one deepcopy: modules shared stay shared
            torch.manual_seed(k)
            for model in models:
                for module in model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
            loaded += [LoadedModel(f"{g.name}#{k}", m.eval(), g.inputs) for g, m in zip(group, models)]
    return [m.name for m in loaded], loaded


def _load_preprocessing(args: argparse.Namespace, device: str = "cpu") -> tuple[Any, tuple]:
    """``--preprocess``: the module every model's input goes through once, and its example (raw) inputs, on
    ``device``."""
    from opsched.models.spec import load_models

    found = load_models(args.preprocess, batch=args.batch, image_size=args.image_size)
    if len(found) != 1:
        raise OpschedError(f"--preprocess {args.preprocess}: expected one module, found {len(found)}")
    found[0].to(device)
    return found[0].model.eval(), found[0].inputs


def load_command_batch(args: argparse.Namespace, device: str = "cpu") -> tuple[list[str], list[Any], Any, Any]:
    """The model batch the command line names (MODELs, ``--copies``, ``--preprocess``, ``--batch``,
    ``--input-shape``, ``--image-size``), as ``opsched multi`` loads it and ``opsched run`` rebuilds it from a
    plan, on ``device``: the models' names and LoadedModels, the inputs
    :func:`opsched.multi.optimize.model_batch` takes (each model's own, or the raw inputs the preprocessing
    reads) and the preprocessing module (or None)."""
    names, loaded = load_batch(args)
    for m in loaded:
        m.to(device)
    inputs, preprocess = [m.inputs for m in loaded], None
    if args.preprocess:
        preprocess, inputs = _load_preprocessing(args, device)
    return names, loaded, inputs, preprocess


# The command line's MODELs and options that load a batch: a multi plan records them (options.multi.load),
# and opsched run takes from there what it is not given.
LOAD_OPTIONS = ("models", "copies", "preprocess", "batch", "input_shape", "image_size")


def load_record(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's MODELs and the options that load the batch, as a multi plan records them."""
    return {key: getattr(args, key) for key in LOAD_OPTIONS}


def check_run_args(args: argparse.Namespace, plan: Any) -> None:
    """``opsched run`` of a multi plan: refuse in one line a command line that names another batch than the
    plan was made for (other models, copies, preprocessing, batch or input shapes), and take the options not
    given from the plan."""
    from opsched.models.spec import parse_shape
    from opsched.multi.fuse import REWRITES

    record = plan.options["multi"]
    load = record.get("load") if isinstance(record, dict) else None
    if not isinstance(load, dict):
        raise OpschedError(f"{args.plan} was made by an opsched multi that did not record how to rebuild its "
                           "batch; make it again with opsched multi ... --out")
    _check_record(args.plan, "rewrites", record.get("rewrites"), lambda v: _strings(v) and set(v) <= set(REWRITES))
    _check_record(args.plan, "batched", record.get("batched"), _strings)
    _check_record(args.plan, "load.models", load.get("models"), lambda v: _strings(v) and len(v) > 0)
    _check_record(args.plan, "load.copies", load.get("copies"), _positive)
    for key, ok in (("preprocess", lambda v: isinstance(v, str)), ("batch", _positive),
                    ("image_size", _positive), ("input_shape", _strings)):
        _check_record(args.plan, f"load.{key}", load.get(key), lambda v, ok=ok: v is None or ok(v))
    models = load["models"]
    if len(args.models) != len(models) or not all(map(_same_spec, args.models, models)):
        raise OpschedError(f"{args.plan} was made for the models {' '.join(models)}, not {' '.join(args.models)}")
    for key, flag in (("copies", "--copies"), ("preprocess", "--preprocess"), ("input_shape", "--input-shape"),
                      ("image_size", "--image-size")):
        recorded, given = load.get(key), getattr(args, key)
        if given is None:
            setattr(args, key, recorded)
            continue
        if key == "input_shape" and recorded is not None:
            same = [parse_shape(s) for s in given] == [parse_shape(s) for s in recorded]
        else:
            same = given == recorded or (key == "preprocess" and recorded is not None and _same_spec(given, recorded))
        if same:
            continue
        if recorded is None:
            raise OpschedError(f"{args.plan} was made without {flag}; leave it out")
        if key == "input_shape":
            recorded, given = " ".join(recorded), " ".join(given)
        raise OpschedError(f"{args.plan} was made for {flag} {recorded}, not {given}")
    if args.batch is None:
        args.batch = load.get("batch")
    elif args.batch not in (load.get("batch"), plan.batch):
        raise OpschedError(f"{args.plan} was made for batch {load.get('batch') or plan.batch}, not {args.batch}")


def _check_record(plan_path: str, key: str, value: Any, ok: Any) -> None:
    if not ok(value):
        raise OpschedError(f"{plan_path}: options.multi.{key} is malformed ({value!r})")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _same_spec(given: str, recorded: str) -> bool:
    """Two model (or preprocessing) specifiers name the same thing: equal, or the same factory of one file."""
    from pathlib import Path

    if given == recorded:
        return True
    path, sep, factory = given.rpartition(":")
    other, other_sep, other_factory = recorded.rpartition(":")
    return bool(sep and other_sep and path.endswith(".py") and factory == other_factory
                and Path(path).resolve() == Path(other).resolve())


def rebuild_batch(args: argparse.Namespace, plan: Any, device: str = "cpu") -> tuple[Any, Any, list[str]]:
    """The model batch a multi plan was made for, loaded from the command line as ``opsched multi`` loads it
    (see :func:`check_run_args`) onto ``device``, and its graph with the plan's rewrites made: (a LoadedModel
    whose model is the :class:`opsched.multi.ModelBatch` and whose inputs are the batch's, the graph, the
    models' names)."""
    from opsched.models.spec import LoadedModel
    from opsched.multi.fuse import fuse_graph
    from opsched.multi.optimize import model_batch

    record = plan.options["multi"]
    names, loaded, inputs, preprocess = load_command_batch(args, device)
    batch = model_batch([m.model for m in loaded], inputs, preprocess)
    for m in batch.models:
        m.eval()
    fusion = fuse_graph(batch, record["rewrites"], made=record["batched"])
    name = " ".join(args.models) + (f" x{args.copies}" if args.copies > 1 else "")
    return LoadedModel(name, batch, tuple(batch.inputs)), fusion.graph, names


def multi_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.commands import VerificationFailed, _output_paths, _progress_bar
    from opsched.cost.simulate import device_named
    from opsched.multi.optimize import MULTI_PEERS, optimize
    from opsched.progress import say

    simulated = args.cost.startswith("sim:")
    if simulated:
        device_named(args.cost)
    elif args.cost != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {args.cost!r}")
    device = "cpu" if simulated else args.device  # simulated costs are computed on the CPU, as for one model
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OpschedError("--device cuda: PyTorch sees no CUDA device here")
        if args.train:
            raise OpschedError("--train runs on the CPU for now: leave out --device cuda")
    args.gantt = None
    plan_path, _ = _output_paths(args, "multi-" + "-".join(m.split(":")[-1] for m in args.models))
    if args.preprocess and args.train:
        raise OpschedError("--train trains the models on their own inputs: leave out --preprocess")
    names, loaded, inputs, preprocess = load_command_batch(args, device)
    say(f"loaded {len(args.models)} model(s) x {args.copies}")
    methods = list(dict.fromkeys(["sequential", "lios", "hivemind", args.method]))
    result = optimize([m.model for m in loaded], inputs, methods=methods, cost=args.cost, preprocess=preprocess,
                      kernels=args.kernels, rewrites=() if args.no_fuse else ("shared", "same_input", "same_shape"),
                      cores=args.threads, tolerance=args.tolerance, repeats=args.repeats, cache=not args.no_cache,
                      peers=MULTI_PEERS + (("torch_compile",) if args.peers or args.kernels == "inductor" else ()),
                      say=say, progress=_progress_bar)
    outcome, fusion = result.outcome, result.fusion
    schedules = outcome.schedules
    out: dict[str, Any] = {
        "models": names, "shared_input": fusion.batch.shared_input, "units": len(fusion.graph),
        "units_before_fusion": len(fusion.combined), "preprocess": args.preprocess, "fused": dict(fusion.fused),
        "fusions": fusion.decisions,
        "cost": args.cost, "simulated": simulated, "device": args.cost if simulated else device,
        "method": args.method, "kernels": args.kernels,
        "predicted_ms": {"sequential_models": result.predicted_sequential_ms,
                         **{m: s.predicted_latency for m, s in schedules.items()}},
    }
    plan = schedules[args.method]
    if not simulated:
        ev = outcome.evaluation
        plan = result.plan()
        if plan is None:
            raise VerificationFailed("no fused plan verified: " + "; ".join(
                f"{n}: {why}" for n, why in ev.dropped.items() if n in schedules))
        plan.options["multi"]["load"] = load_record(args)  # what opsched run rebuilds the batch from
        out.update({"measured_ms": dict(ev.measured_ms),
                    "threads": {n: t for n, t in ev.threads.items() if t is not None},
                    "chosen": ev.chosen, "plan_method": plan.options["measured_as"],
                    "max_abs_error": max(result.model_errors), "model_errors": result.model_errors,
                    "dropped": dict(ev.dropped), "warnings": ev.warnings + outcome.notes})
    plan.save(plan_path)
    out["plan"] = str(plan_path)
    if args.train:
        from opsched.multi.train import compare_training

        out["train"] = compare_training([m.model for m in loaded], [m.inputs for m in loaded], steps=args.steps,
                                        lrs=args.lr, cores=args.threads, repeats=args.repeats)
    for warning in out.get("warnings", []):
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if not args.json:
        _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    simulated = out["simulated"]
    print(f"models     {len(out['models'])}: {', '.join(out['models'][:6])}{' ...' if len(out['models']) > 6 else ''}"
          f" ({'one shared input' if out['shared_input'] else 'inputs of their own'})")
    if out["preprocess"]:
        print(f"preprocess {out['preprocess']}, run once for every model")
    print(f"units      {out['units_before_fusion']} -> {out['units']} "
          f"(computed once: {out['fused']['shared']}, batched: {out['fused']['same_input']} same input, "
          f"{out['fused']['same_shape']} same shape)")
    print(f"cost       {out['cost']}" + ("  -- every latency below is SIMULATED, not measured" if simulated else ""))
    print()
    measured = out.get("measured_ms", {})
    names = list(dict.fromkeys([*out["predicted_ms"], *measured]))
    base = measured.get("sequential_models")
    print(f"  {'':<18} {'predicted ms':>13}" + (f" {'measured ms':>12} {'vs sequential':>14}" if measured else ""))
    for name in names:
        predicted = out["predicted_ms"].get(name)
        line = f"{'*' if name == out.get('chosen') else ' '} {name:<18} {f'{predicted:.3f}' if predicted else '-':>13}"
        if measured:
            ms = measured.get(name)
            line += f" {f'{ms:.3f}' if ms else 'dropped':>12} {f'{base / ms:.2f}x' if ms and base else '':>14}"
        print(line)
    if measured:
        print(f"\nchosen     {out['chosen']}; every model within {out['max_abs_error']:.2g} of its own forward")
    if "train" in out:
        t = out["train"]
        print(f"training   {t['steps']} steps: {t['ms_per_step']['sequential_models']:.2f} ms/step one after "
              f"another, {t['ms_per_step']['fused']:.2f} fused; max_param_diff {t['max_param_diff']:.2g}")
    print(f"plan       {out['plan']}")
