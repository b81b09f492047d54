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


def _load_preprocessing(args: argparse.Namespace) -> tuple[Any, tuple]:
    """``--preprocess``: the module every model's input goes through once, and its example (raw) inputs."""
    from opsched.models.spec import load_models

    found = load_models(args.preprocess, batch=args.batch, image_size=args.image_size)
    if len(found) != 1:
        raise OpschedError(f"--preprocess {args.preprocess}: expected one module, found {len(found)}")
    return found[0].model.eval(), found[0].inputs


def multi_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.commands import VerificationFailed, _output_paths, _progress_bar, _say
    from opsched.cost.simulate import device_named
    from opsched.multi.optimize import MULTI_PEERS, optimize

    simulated = args.cost.startswith("sim:")
    if simulated:
        device_named(args.cost)
    elif args.cost != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {args.cost!r}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OpschedError("--device cuda: PyTorch sees no CUDA device here")
        raise OpschedError("opsched multi runs on the CPU for now; study a GPU with --cost sim:NAME")
    args.gantt = None
    plan_path, _ = _output_paths(args, "multi-" + "-".join(m.split(":")[-1] for m in args.models))
    _say(args, f"loading {len(args.models)} model(s) x {args.copies} ...")
    names, loaded = load_batch(args)
    inputs, preprocess = [m.inputs for m in loaded], None
    if args.preprocess:
        if args.train:
            raise OpschedError("--train trains the models on their own inputs: leave out --preprocess")
        preprocess, inputs = _load_preprocessing(args)
    methods = list(dict.fromkeys(["sequential", "lios", "hivemind", args.method]))
    result = optimize([m.model for m in loaded], inputs, methods=methods, cost=args.cost, preprocess=preprocess,
                      kernels=args.kernels, rewrites=() if args.no_fuse else ("shared", "same_input", "same_shape"),
                      cores=args.threads, tolerance=args.tolerance, repeats=args.repeats, cache=not args.no_cache,
                      peers=MULTI_PEERS + (("torch_compile",) if args.peers or args.kernels == "inductor" else ()),
                      say=lambda text: _say(args, text), progress=_progress_bar)
    outcome, fusion = result.outcome, result.fusion
    schedules = outcome.schedules
    out: dict[str, Any] = {
        "models": names, "shared_input": fusion.batch.shared_input, "units": len(fusion.graph),
        "units_before_fusion": len(fusion.combined), "preprocess": args.preprocess, "fused": dict(fusion.fused),
        "fusions": fusion.decisions,
        "cost": args.cost, "simulated": simulated, "method": args.method, "kernels": args.kernels,
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
