"""``opsched multi``: several models as one fused, scheduled, verified program (see :func:`opsched.jobs.optimize_batch`
and docs/multi.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from opsched.commands.common import choice_text, output_paths, run_progress
from opsched.errors import OpschedError
from opsched.progress import say


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.jobs import check_options, optimize_batch
    from opsched.multi.load import load_command_batch, load_record
    from opsched.multi.optimize import COMPILED_PEERS, MULTI_PEERS

    simulated = check_options(args.cost, args.device, args.kernels, args.cuda_graph)
    device = "cpu" if simulated else args.device  # simulated costs are computed on the CPU, as for one model
    plan_path, _ = output_paths(args, "multi-" + "-".join(m.split(":")[-1] for m in args.models))
    if args.train and simulated and args.device == "cuda":
        raise OpschedError("--train --device cuda needs measured costs: with simulated ones everything runs on the CPU")
    if args.preprocess and args.train:
        raise OpschedError("--train trains the models on their own inputs: leave out --preprocess")
    names, loaded, inputs, preprocess = load_command_batch(args, device)
    say(f"loaded {len(args.models)} model(s) x {args.copies}")
    methods = list(dict.fromkeys(["sequential", "lios", "hivemind", args.method]))
    peers = MULTI_PEERS + (COMPILED_PEERS if args.peers or args.kernels not in ("eager", "auto") else ())
    result = optimize_batch([m.model for m in loaded], inputs, methods=methods, cost=args.cost,
                            preprocess=preprocess, kernels=args.kernels,
                            rewrites=() if args.no_fuse else ("shared", "same_input", "same_shape"),
                            cores=args.threads, tolerance=args.tolerance, repeats=args.repeats,
                            cache=not args.no_cache, peers=peers, say=say, progress=run_progress,
                            requested=args.method, cuda_graph=args.cuda_graph, device=device)
    outcome, fusion = result.outcome, result.fusion
    schedules = result.schedules
    out: dict[str, Any] = {
        "models": names, "shared_input": fusion.batch.shared_input, "units": len(fusion.graph),
        "units_before_fusion": len(fusion.combined), "preprocess": args.preprocess, "fused": dict(fusion.fused),
        "fusions": fusion.decisions, "regions_ms": fusion.whole,
        "cost": args.cost, "simulated": simulated, "device": args.cost if simulated else device,
        "method": args.method, "kernels": args.kernels,
        "predicted_ms": {"sequential_models": result.predicted_sequential_ms,
                         **{m: s.predicted_latency for m, s in schedules.items()}},
    }
    plan = result.plan()
    plan.models.load = load_record(args)  # what opsched run rebuilds the batch from
    if not simulated:
        ev = outcome.evaluation
        out.update({"measured_ms": dict(ev.measured_ms),
                    "speedups": {"over": "sequential_models", **ev.speedups("sequential_models")},
                    "threads": {n: t for n, t in ev.threads.items() if t is not None},
                    "chosen": ev.chosen, "tie": list(ev.tie), "noise": ev.noise(),
                    "plan_method": plan.measured.measured_as, "max_error": max(result.model_errors),
                    "max_abs_error": ev.abs_errors[plan.measured.measured_as], "model_errors": result.model_errors,
                    "dropped": dict(ev.dropped), "warnings": ev.warnings + outcome.notes})
    plan.save(plan_path)
    out["plan"] = str(plan_path)
    if args.train:
        from opsched.multi.train import compare_training

        out["train"] = compare_training([m.model for m in loaded], [m.inputs for m in loaded], steps=args.steps,
                                        lrs=args.lr, cores=args.threads, repeats=args.repeats, device=device)
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
    if out["regions_ms"]:
        whole = out["regions_ms"]
        predicted = "batched" if whole["batched_ms"] < whole["apart_ms"] else "nothing batched"
        if predicted == "batched" and not any(out["fused"][kind] for kind in ("same_input", "same_shape")):
            predicted = "batched, but the models apart on streams of their own measured faster (+unbatched)"
        print(f"regions    the graph's compiled regions, predicted: {whole['batched_ms']:.3g} ms batched, "
              f"{whole['apart_ms']:.3g} ms apart: {predicted}")
    print(f"cost       {out['cost']}" + ("  -- every latency below is SIMULATED, not measured" if simulated else ""))
    print()
    measured = out.get("measured_ms", {})
    names = list(dict.fromkeys([*out["predicted_ms"], *measured]))
    speedups = out.get("speedups", {})  # over the rounds both ran (a race leaves plainly slower ones out early)
    width = max(18, *map(len, names))
    print(f"  {'':<{width}} {'predicted ms':>13}" + (f" {'measured ms':>12} {'vs sequential':>14}" if measured else ""))
    for name in names:
        predicted = out["predicted_ms"].get(name)
        line = f"{'*' if name == out.get('chosen') else ' '} {name:<{width}} {f'{predicted:.3f}' if predicted else '-':>13}"
        if measured:
            ms = measured.get(name)
            line += f" {f'{ms:.3f}' if ms else 'dropped':>12} {f'{speedups[name]:.2f}x' if name in speedups else '':>14}"
        print(line)
    if measured:
        print(f"\nchosen     {out['chosen']}: {choice_text(out)}; every model within {out['max_error']:.2g} of its "
              "own forward (scaled to each output's magnitude)")
    if "train" in out:
        t = out["train"]
        interval = t["speedup_interval_99"]
        noise = "too few steps to tell the noise" if interval is None else \
            f"99% {interval[0]:.2f}-{interval[1]:.2f}{'' if t['above_noise'] else ', within the noise'}"
        print(f"training   {t['steps']} steps: {t['ms_per_step']['sequential_models']:.2f} ms/step one after "
              f"another, {t['ms_per_step']['fused']:.2f} fused ({t['speedup']:.2f}x, {noise}); "
              + ({True: "every model verified", None: f"not compared: {t['why']}"}.get(t["verified"])
                 or f"NOT VERIFIED: {t['why']}")
              + f" (scaled error {t['param_error']:.2g}; max_param_diff {t['max_param_diff']:.2g}, float32's own "
              f"noise, float64 against one after another: {t['float32_noise']:.2g})")
    print(f"plan       {out['plan']}")
