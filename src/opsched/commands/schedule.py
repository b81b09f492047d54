"""``opsched schedule``: a DAG JSON graph scheduled with the table cost model."""

from __future__ import annotations

import argparse
from typing import Any

from opsched.commands.common import block_progress, refuse_existing
from opsched.errors import OpschedError


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.cost.table import TableCost
    from opsched.graph import dagjson
    from opsched.pipeline import method_options
    from opsched.schedulers import make_schedule

    if not args.graph.endswith(".json"):
        raise OpschedError(f"{args.graph}: opsched schedule takes a DAG JSON file (*.json); "
                           "models are scheduled with opsched optimize")
    refuse_existing(args.out, force=args.force)
    graph = dagjson.read(args.graph)
    cost = TableCost(graph, capacity=args.capacity, sync_overhead=args.sync_overhead)
    options = method_options(args.method, streams=args.streams, max_group_size=args.max_group_size,
                             max_groups=args.max_groups, split=not args.no_split,
                             max_block_size=args.max_block_size, time_limit=args.time_limit)
    if args.method == "ios":
        options["progress"] = block_progress()
    schedule = make_schedule(args.method, graph, cost, **options)
    baseline = make_schedule("sequential", graph, cost)
    if args.out:
        schedule.save(args.out)
    result: dict[str, Any] = {"method": schedule.method, "predicted_latency": schedule.predicted_latency}
    if schedule.stages is not None:
        result["stages"] = [{"strategy": st.strategy, "groups": st.groups} for st in schedule.stages]
    result["ops"] = [{"name": o.name, "stream": o.stream, "start": o.start, "finish": o.finish} for o in schedule.ops]
    result["stats"] = schedule.stats
    result["bounds"] = schedule.bounds
    result["sequential_latency"] = baseline.predicted_latency
    result["cost"] = cost.describe()
    if not args.json:
        _print_schedule(schedule, baseline.predicted_latency, args.out)
    return result


def _print_schedule(schedule, sequential_latency: float, out: str | None) -> None:
    if schedule.stages is not None:
        rows = [("stage", "strategy", "groups")]
        rows += [(str(k), st.strategy, "  |  ".join(" -> ".join(g) for g in st.groups))
                 for k, st in enumerate(schedule.stages)]
    else:
        rows = [("stream", "units in order", "")]
        rows += [(str(k), " -> ".join(units), "") for k, units in enumerate(schedule.streams()) if units]
    width = [max(len(r[c]) for r in rows) for c in range(2)]
    for r in rows:
        print(f"{r[0].rjust(width[0])}  {r[1].ljust(width[1])}  {r[2]}".rstrip())
    latency, bound = schedule.predicted_latency, schedule.bounds["lower_bound"]
    speedup = sequential_latency / latency if latency else float("inf")
    print()
    print(f"predicted latency  {latency:.6g}  (sequential {sequential_latency:.6g}: {speedup:.2f}x; "
          f"lower bound {bound:.6g})")
    st = schedule.stats
    if st.get("states") is not None:
        print(f"search             {st['states']} states, {st['transitions']} transitions, "
              f"{st['search_seconds']:.3f} s")
    else:
        print(f"search             {st['search_seconds']:.3f} s")
    if out:
        print(f"plan written to    {out}")
