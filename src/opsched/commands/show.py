"""``opsched show``: summarise a plan of any kind and draw its predicted timeline (a Gantt chart or a
Chrome/Perfetto trace)."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from opsched.commands.common import count, read_plan, refuse_existing, time_unit, timeline_title


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = read_plan(args.plan)
    refuse_existing(args.gantt, args.trace, force=args.force)
    label = timeline_title(plan, plan.graph_name)
    mapping = plan.devices
    if args.gantt and mapping:
        from opsched.report.mapping import write_mapping_gantt

        write_mapping_gantt(args.gantt, plan)
    elif args.gantt:
        from opsched.report.gantt import merged_units, write_gantt

        write_gantt(args.gantt, plan.ops, None, label, merges=merged_units(plan))
    if args.trace:
        from opsched.report.trace import write_trace

        write_trace(args.trace, plan.ops, label)
    streams = plan.streams()
    result = {"plan": args.plan, "method": plan.method, "form": plan.form, "graph": plan.graph_name,
              "device": plan.device, "cost": plan.cost, "simulated": plan.simulated, "batch": plan.batch,
              "units": len(plan.ops), "streams": len(streams),
              "stages": len(plan.stages) if plan.stages is not None else None,
              "predicted_latency": plan.predicted_latency, "timeline": label,
              "gantt": args.gantt, "trace": args.trace}
    result["kind"] = plan.kind
    if plan.inputs:
        from opsched.commands.optimize import signature_rows, signature_text

        result["signatures"] = signature_rows(plan)
    if plan.unit_kernels:
        result["kernels"] = dict(sorted(Counter(plan.unit_kernels.values()).items()))
        refused = plan.stats.get("kernel_choice", {}).get("not_offered", {}).get("onnxruntime", {})
        if refused:
            result["not_on_onnxruntime"] = refused
        on_inductor = plan.stats.get("kernel_choice", {}).get("inductor_whole_graph")
        if on_inductor:
            result["inductor_whole_graph"] = on_inductor
    if mapping:
        result.update(devices=[d.name for d in mapping.devices], lower_bound=plan.bounds.get("lower_bound"),
                      optimal=mapping.optimal, transfers=len(mapping.transfers))
    if not args.json:
        batch = f"batch {plan.batch}, " if plan.batch else ""
        print(f"plan        {args.plan}: {plan.method} for {plan.graph_name} ({batch}{plan.device})")
        print(f"form        {plan.form}: {count(len(plan.ops), 'unit')} on {count(len(streams), 'stream')}"
              + (f" in {count(len(plan.stages), 'stage')}" if plan.stages is not None else ""))
        unit = time_unit(plan)
        if not plan.costed:
            print(f"predicted   - (the whole graph as one region compiled by Inductor, measured and not costed; "
                  f"its units on the cost model's kernels: {plan.predicted_latency:.4g}{' ' + unit if unit else ''})")
        else:
            print(f"predicted   {plan.predicted_latency:.4g}{' ' + unit if unit else ''}  ({label})")
        if "kernels" in result:
            print(f"kernels     {plan.run.kernels}: " + ", ".join(f"{count(n, 'unit')} {k}"
                                                          for k, n in result["kernels"].items()))
        from opsched.commands.optimize import kernel_choice_lines

        for line in kernel_choice_lines(result.get("not_on_onnxruntime", {}), result.get("inductor_whole_graph")):
            print(f"{'':<11} {line}")
        names = result["devices"] if mapping else None
        for k, units in enumerate(streams):
            print(f"{'device ' + names[k] if names else f'stream {k}':<11} {count(len(units), 'unit')}")
        if mapping:
            print(f"bound       {result['lower_bound']:.4g} (lower bound; "
                  f"{'proven optimal' if result['optimal'] else 'not proven optimal'}), "
                  f"{count(result['transfers'], 'transfer')}")
        for k, row in enumerate(result.get("signatures", [])):
            print(f"{'signature' if k == 0 else '':<11} {signature_text(row)}" + (" (this plan)" if k == 0 else ""))
        for what, path in (("gantt", args.gantt), ("trace", args.trace)):
            if path:
                print(f"{what:<11} {path}")
    return result
