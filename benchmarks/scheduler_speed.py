"""Speed of the schedulers' search, measured on this machine with the table cost model.

IOS: one 33-unit RandWire stage (networkx WS(32, 4, 0.75), edges from lower to higher index, one exit
unit after all sinks) per seed, searched as one block with r=3, s=8; prints states, transitions, seconds
(median of --repeats) and microseconds per transition (goal here: at most 7; the IOS paper gives no cost per
transition to compare with, see docs/schedulers.md). LIOS, Nimble and greedy: a 374-unit random layered
DAG (the size of NASNet-A large in IOS), median of --repeats. (IOS is not run on it: a graph of width 23
without cut units is far outside what a DP over stages can search in minutes.)

    python benchmarks/scheduler_speed.py [--seeds 5] [--repeats 3] [--out docs/scheduler_speed.jsonl]

Prints markdown tables and appends one JSON line per measurement (with the machine, versions, date, commit) to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from sweep import machine

from opsched.cost.table import TableCost
from opsched.models.synthetic import random_layered_dag, randwire_stage
from opsched.schedulers import make_schedule
from opsched.schedulers.ios import ios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-r", type=int, default=3)
    parser.add_argument("-s", type=int, default=8)
    parser.add_argument("--out", default="docs/scheduler_speed.jsonl")
    args = parser.parse_args()
    rows = []
    where = machine()
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; all figures measured")
    print(f"\nIOS, one 33-unit RandWire WS(32, 4, 0.75) stage, r={args.r}, s={args.s}, searched as one block")
    print("| seed | units | width | states | transitions | seconds (median) | us/transition | predicted / sequential |")
    print("|---|---|---|---|---|---|---|---|")
    rates = []
    for seed in range(args.seeds):
        g = randwire_stage(32, "ws", seed)
        cost = TableCost(g)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            s = ios(g, cost, max_group_size=args.r, max_groups=args.s, split=False)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        per = seconds / s.stats["transitions"] * 1e6
        rates.append(per)
        seq = make_schedule("sequential", g, cost).predicted_latency
        rows.append({"search": "ios", "graph": f"randwire ws(32, 4, 0.75) seed {seed}", "units": len(g),
                     "width": g.width, "r": args.r, "s": args.s, "states": s.stats["states"],
                     "transitions": s.stats["transitions"], "seconds": round(seconds, 4),
                     "us_per_transition": round(per, 3), "over_sequential": round(s.predicted_latency / seq, 4),
                     "repeats": args.repeats, **where})
        print(f"| {seed} | {len(g)} | {g.width} | {s.stats['states']} | {s.stats['transitions']} | {seconds:.3f} | "
              f"{per:.2f} | {s.predicted_latency / seq:.3f} |", flush=True)
    print(f"median us/transition over seeds: {statistics.median(rates):.2f}")

    g = random_layered_dag(374, 40, 0.05, seed=0)
    cost = TableCost(g)
    print(f"\n374-unit random layered DAG (width {g.width}), median of {args.repeats}")
    print("| method | streams | seconds (median) | predicted / sequential |")
    print("|---|---|---|---|")
    seq = make_schedule("sequential", g, cost).predicted_latency
    for method, options in [("lios", {"streams": 8}), ("nimble", {}), ("greedy", {})]:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            s = make_schedule(method, g, cost, **options)
            times.append(time.perf_counter() - start)
        print(f"| {method} | {options.get('streams', '-')} | {statistics.median(times):.4f} | "
              f"{s.predicted_latency / seq:.3f} |", flush=True)
        rows.append({"search": method, "graph": "random layered dag 374 seed 0", "units": len(g), "width": g.width,
                     "options": options, "seconds": round(statistics.median(times), 5),
                     "over_sequential": round(s.predicted_latency / seq, 4), "repeats": args.repeats, **where})
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
