"""``opsched optimize``: one model through the one runner (see :func:`opsched.jobs.optimize`), reported as a
table (or ``--json``), with the plan and a Gantt chart of its predicted timeline written."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from opsched.commands.common import (
    choice_text,
    count,
    load_and_capture,
    measured_fields,
    output_paths,
    run_progress,
    timeline_title,
)
from opsched.progress import say


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.jobs import check_options, optimize

    model_spec = args.model or "inception_v3"
    simulated = check_options(args.cost, args.device, args.kernels, args.cuda_graph)  # before anything loads
    if simulated and args.batch_sizes:
        from opsched.errors import OpschedError

        raise OpschedError("--batch-sizes makes measured plans; a simulated device (--cost sim:...) runs nothing")
    plan_path, gantt_path = output_paths(args, model_spec)
    loaded, graph, load_seconds, capture_seconds = load_and_capture(args, model_spec,
                                                                    args.device if not simulated else "cpu",
                                                                    say=say)
    outcome = optimize(loaded.model, tuple(loaded.inputs), method=args.method, cost=args.cost, device=args.device,
                       kernels=args.kernels, peers=args.peers, threads=args.threads, streams=args.streams,
                       max_group_size=args.max_group_size, max_groups=args.max_groups,
                       max_block_size=args.max_block_size, tolerance=args.tolerance, repeats=args.repeats,
                       cache=not args.no_cache, cuda_graph=args.cuda_graph, graph=graph,
                       batch_sizes=args.batch_sizes, say=say, progress=run_progress)
    schedules = outcome.every_schedule  # the whole graph on Inductor too, where auto offered it
    requested = schedules[args.method]
    result: dict[str, Any] = {
        "model": loaded.name, "batch": requested.batch, "device": args.cost if simulated else args.device,
        "cost": args.cost, "simulated": simulated, "method": args.method, "kernels": args.kernels,
        "units": len(graph), "search_seconds": requested.stats["search_seconds"], "plan": str(plan_path),
        "predicted_ms": {m: s.predicted_latency for m, s in schedules.items() if s.costed},
        "load_seconds": round(load_seconds, 3), "capture_seconds": round(capture_seconds, 3),
        "reason": explain(requested, graph, outcome.cost),
    }
    plan = outcome.plan()
    if not simulated:
        result.update(measured_fields(outcome, plan))
        from opsched.deploy import plan_file

        plan = plan_file(outcome.guarded)  # with the call it was made for, and every other batch size's plan
        result["signatures"] = signature_rows(plan)
    plan.save(plan_path)
    result["gantt"] = str(gantt_path)
    from opsched.report.gantt import merged_units, write_gantt

    write_gantt(gantt_path, plan.ops, graph, timeline_title(plan, loaded.name), merges=merged_units(plan))
    for warning in result.get("warnings", []):
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if not args.json:
        _print(result, schedules)
    return result


def signature_rows(plan) -> list[dict[str, Any]]:
    """Each call signature a plan file holds: its inputs' shapes, the configuration chosen and its measured ms."""
    rows = [{"inputs": [i.get("shape") for i in plan.inputs], "chosen": plan.measured.chosen.get("name") if plan.measured else None,
             "measured_ms": dict(plan.measured.measured_ms) if plan.measured else {}}]
    rows += [{"inputs": [i.get("shape") for i in s["inputs"]], "chosen": s.get("chosen"),
              "measured_ms": s.get("measured_ms", {})} for s in plan.signatures]
    return rows


def kernel_choice_lines(refused: dict[str, str], inductor: dict[str, Any] | None) -> list[str]:
    """What ``auto`` did not offer ONNX Runtime and why (``refused``: a unit's name, or a note such as
    ``(every unit)``, to the reason), and whether it ran the whole graph on Inductor beside the plans and why
    (``inductor``), in words: the lines ``opsched optimize`` and ``opsched show`` print."""
    lines = [f"not offered ONNX Runtime: {'' if unit.startswith('(') else 'unit '}{unit} ({why})"
             for unit, why in refused.items()]
    if inductor:
        lines.append(f"{'offered' if inductor['offered'] else 'not offered'} Inductor for the whole graph: "
                     f"{inductor['why']}")
    return lines


def signature_text(row: dict[str, Any]) -> str:
    """One call signature of a plan file in words: ``inputs (1, 3, 224, 224): ios 3.1 ms (eager 4.2 ms)``."""
    shapes = ", ".join(str(tuple(s)) if s is not None else "a value" for s in row["inputs"])
    measured = row.get("measured_ms", {})
    chosen = row.get("chosen")
    figure = f" {measured[chosen]:.3g} ms" if chosen in measured else ""
    eager = f" (eager {measured['eager']:.3g} ms)" if "eager" in measured and chosen != "eager" else ""
    return f"inputs {shapes}: {chosen}{figure}{eager}"


def explain(schedule, graph, cost) -> str:
    """Why the schedule looks as it does, in one sentence: what its stages do, and, when it runs one unit at
    a time, what concurrency and merging cost under this cost model."""
    if schedule.stages is None:
        streams = sum(1 for units in schedule.streams() if units)
        return f"{streams} stream(s); units wait only on inputs from other streams"
    concurrent = sum(1 for st in schedule.stages if st.strategy == "concurrent" and len(st.groups) > 1)
    merges = sum(1 for st in schedule.stages if st.strategy == "merge")
    if schedule.run.regions:
        blocks = schedule.stats.get("region_blocks", 0)
        return (f"{blocks} of {schedule.stats.get('blocks_of_several', '?')} blocks of several units run as "
                f"compiled regions (the compiler fuses across their units), {concurrent} concurrent stage(s) and "
                f"{merges} merge(s) predicted to pay; units run back to back form one region")
    if concurrent or merges:
        return f"{concurrent} concurrent stage(s) and {merges} merge(s) predicted to pay"
    if graph.width == 1:
        return "one unit at a time: the graph is a chain, nothing can run at the same time"
    factors = []
    contention = getattr(cost, "contention", None)
    if contention:
        factors.append(f"concurrent stages cost {contention:.2f}x their units' time on the cores they share")
    merge = getattr(cost, "merge_factor", None)
    if merge:
        factors.append(f"merged convolutions {merge:.2f}x their units")
    why = "; ".join(factors) if factors else "no stage was predicted faster than running its units in turn"
    return f"one unit at a time: nothing predicted to pay ({why})"


def _print(result: dict[str, Any], schedules) -> None:
    simulated = result["simulated"]
    kind = "simulated" if simulated else "predicted"
    print(f"model      {result['model']} (batch {result['batch']}, {result['units']} units)")
    print(f"cost       {result['cost']}" + ("  -- every latency below is SIMULATED, not measured" if simulated
                                              else f"  (kernels: {result['kernels']})"))
    print()
    measured = result.get("measured_ms", {})
    dropped = result.get("dropped", {})
    width = max(14, *(len(m) for m in schedules))
    header = f"  {'':<{width}} {kind + ' ms':>14}"
    if measured:
        header += f" {'measured ms':>12} {'vs eager':>9}"
    print(header)
    peers = [p for p in ("eager", "cuda_graph", "torch_compile", "onnxruntime") if p in measured or p in dropped]
    rows = [(p, None) for p in peers] + [(m, schedules[m].predicted_latency if schedules[m].costed else None)
                                         for m in schedules]
    sequential = result["predicted_ms"]["sequential"]
    for name, predicted in rows:
        mark = "*" if name == result.get("chosen") else " "
        line = f"{mark} {name:<{width}} {f'{predicted:.3f}' if predicted is not None else '-':>14}"
        if name in measured:
            ms = measured[name]
            threads = result.get("threads", {}).get(name)
            rounds = result.get("noise", {}).get("left_out", {}).get(name)
            line += f" {ms:>12.2f} {result['speedups'][name]:>8.2f}x" + (f"  ({count(threads, 'thread')})" if threads else "") \
                + (f"  (timed {rounds} rounds: plainly slower, left out)" if rounds else "")
        elif name in dropped:
            line += f"  dropped: {dropped[name]}"
        elif predicted and not measured:
            line += f"   {sequential / predicted:.2f}x sequential"
        print(line)
    print()
    if measured:
        chosen = result["chosen"]
        peer_names = [p for p in peers if p in measured]
        left_out = result.get("noise", {}).get("left_out", {})
        # (a left-out peer's median is of the first rounds only: not compared with the others' medians)
        best_peer = min([p for p in peer_names if p not in left_out] or peer_names, key=measured.__getitem__)
        over_peer = 1.0 if best_peer == chosen else 1.0 / result["noise"]["chosen_over"][best_peer]["ratio"]
        print(f"chosen     {chosen} (*): {over_peer:.2f}x the fastest peer "
              f"({best_peer}); {choice_text(result)}; the plan written is {result['plan_method']}'s schedule and "
              "records the choice")
    print(f"reason     {result['method']}: {result['reason']}")
    requested = schedules[result["method"]]
    stats = requested.stats
    print(f"search     {result['method']}: {stats['search_seconds']:.2f} s"
          + (f", {stats['states']} states, {stats['transitions']} transitions" if stats.get("states") else ""))
    if "max_abs_error" in result:
        print(f"verified   against eager ({result['plan_method']}): largest error {result['max_error']:.3g} of each "
              f"output's magnitude (max abs {result['max_abs_error']:.3g})")
    if "cost_model" in result:
        c = result["cost_model"]
        print(f"profiling  {c['profile_seconds']:.1f} s ({c['units_measured']} unit timings measured, "
              f"{c['units_cached']} cached; {c['stages_measured']} stages measured, {c['stages_cached']} cached"
              + (f"; {c['regions_measured']} compiled regions measured, {c['regions_cached']} cached"
                 if c.get("regions_measured") or c.get("regions_cached") else "") + ")")
    choice = result.get("cost_model", {}).get("kernel_choice")
    if choice:
        units = ", ".join(f"{n} {kernel}" for kernel, n in sorted(choice.get("units", {}).items()))
        if "blocks_on_onnxruntime" in choice:  # (absent where choosing failed or ONNX Runtime is not installed)
            print(f"kernels    auto: {choice['blocks_on_onnxruntime']} blocks on ONNX Runtime ({units} units; "
                  f"chosen in {choice['seconds']:.1f} s)")
        else:
            print(f"kernels    auto: {units or 'the default kernels'}")
        for line in kernel_choice_lines(choice.get("not_offered", {}).get("onnxruntime", {}),
                                        choice.get("inductor_whole_graph")):
            print(f"{'':<10} {line}")
    if "compile_seconds" in result:
        print(f"compiling  {result['compile_seconds']:.1f} s ({result['kernels']})")
    print(f"plan       {result['plan']}")
    for row in result.get("signatures", [])[1:]:  # the plan's own call is the first
        print(f"also       {signature_text(row)}")
    print(f"gantt      {result['gantt']}")
