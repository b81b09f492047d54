"""DiviML's Table V for our GPT-3 graph: one decoding step of GPT-3 175B (``gpt3-decode``: 96 layers, each
attention and MLP cut into 4 tensor-parallel slices, fp16, 20 tokens of context an input) on the simulated
``gpt3-cluster`` (six identical nodes of two A100s and two T4s), throughput at batch B, SIMULATED.

Rows: single node (each node's sixth of the graph on that node's devices: HEFT, the MILP, MILP-SPLIT), multi
node (the whole cluster: HEFT, MILP-SPLIT with no symmetry breaking and with each kind), and the upper bound
(the batch over DiviML's lower bound on the makespan). Every solver row has the same time limit. With ``--runs
N`` the multi-node rows run N times (a 120 s solve varies by a few percent from run to run; the symmetry kinds
are compared over the runs). Prints markdown tables (run 1's rows, and each multi-node row's throughput over the
runs) and writes them to ``--out``; one JSON line a row, with where and when it was measured, to ``--jsonl``.

    python benchmarks/gpt3_cluster.py --time-limit 120 --runs 3 --out docs/gpt3_cluster.md \
        --jsonl docs/gpt3_cluster.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from opsched.mapping import MappingError
from opsched.mapping.bound import lower_bound
from opsched.mapping.pernode import per_node
from opsched.mapping.plan import check
from opsched.mapping.platform import load_platform
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.solve import solve
from opsched.models.gpt import gpt3_decode
from opsched.provenance import machine

ROWS = [("single node", "heft", "none"), ("single node", "milp", "none"), ("single node", "milp-split", "none"),
        ("multi node", "heft", "none"), ("multi node", "milp-split", "none"), ("multi node", "milp-split", "batch"),
        ("multi node", "milp-split", "task"), ("multi node", "milp-split", "time")]
PAPER = {("single node", "milp", "none"): 4.8, ("single node", "milp-split", "none"): 5.7,
         ("multi node", "milp-split", "none"): 5.0, ("multi node", "milp-split", "batch"): 5.6,
         ("multi node", "milp-split", "task"): 6.3, ("multi node", "milp-split", "time"): 6.3, "bound": 9.9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds for each solver row (paper: 600)")
    parser.add_argument("--only", nargs="*", help="rows whose 'where/method/symmetry' contains one of these")
    parser.add_argument("--runs", type=int, default=1, help="times each multi-node row runs")
    parser.add_argument("--out", default="gpt3_cluster.md")
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    platform = load_platform("gpt3-cluster")
    started = time.perf_counter()
    problem = build_problem(gpt3_decode(args.batch), platform, "throughput", args.batch)
    setup = time.perf_counter() - started
    factor = platform.symmetry().factor
    print(f"{len(problem.graph)} units, {len(platform)} devices, costs in {setup:.1f} s; "
          f"symmetry group {factor:.3g} (every kind of breaking)", flush=True)
    where_and_when = machine()
    results = []
    for run, (where, method, symmetry) in [(1, row) for row in ROWS if row[0] == "single node"] + \
            [(run, row) for run in range(1, args.runs + 1) for row in ROWS if row[0] == "multi node"]:
        label = f"{where}/{method}/{symmetry}"
        if args.only and not any(o in label for o in args.only):
            continue
        started = time.perf_counter()
        try:
            if where == "single node":
                mapping = per_node(problem, method, time_limit=args.time_limit)
                stats: dict = {}
            else:
                solved = solve(problem, method, time_limit=args.time_limit, symmetry=symmetry, bound=False)
                mapping, stats = solved.mapping, solved.stats
        except MappingError as error:  # HEFT splitting every unit's batch runs out of memory, say
            results.append({"where": where, "method": method, "symmetry": symmetry, "run": run, "failed": str(error),
                            "seconds": time.perf_counter() - started, "paper": PAPER.get((where, method, symmetry)),
                            **where_and_when})
            print(json.dumps(results[-1]), flush=True)
            continue
        seconds = time.perf_counter() - started
        check(problem, mapping)
        makespan = replay(problem, mapping).makespan
        row = {"where": where, "method": method, "symmetry": symmetry, "run": run, "makespan_ms": makespan,
               "inputs_per_s": problem.objective_value(makespan) * 1000.0, "seconds": seconds,
               "devices_used": len({j.device for j in mapping.jobs()}),
               "split_units": sum(1 for u in range(problem.n) if len({j.device for j in mapping.jobs()
                                                                       if j.unit == u}) > 1),
               "symmetry_factor": stats.get("symmetry_factor", 1), "paper": PAPER.get((where, method, symmetry)),
               **where_and_when}
        results.append(row)
        print(json.dumps(row), flush=True)
    started = time.perf_counter()
    bound = lower_bound(problem)
    results.append({"where": "upper bound", "method": "DiviML's lower bound on the makespan", "symmetry": "",
                    "makespan_ms": bound, "inputs_per_s": problem.objective_value(bound) * 1000.0,
                    "seconds": time.perf_counter() - started, "paper": PAPER["bound"], **where_and_when})
    print(json.dumps(results[-1]), flush=True)
    lines = [(f"Batch {args.batch}, time limit {args.time_limit:g} s a row, SIMULATED "
             f"({len(problem.graph)} units on {len(platform)} devices)."), "",
             *([f"<!-- source: {args.jsonl} -->"] if args.jsonl else []),  # tests/test_figures.py checks the table
             ("| rows | throughput (inputs/s) | makespan (ms) | solve (s) | devices used | units split | "
             "paper (inputs/s) |"), "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("run", 1) != 1:
            continue
        if "failed" in r:
            lines.append(f"| {r['where']} - {r['method']} | no mapping: {r['failed']} | | {r['seconds']:.1f} | | | "
                         f"{r['paper'] or ''} |")
            continue
        name = f"{r['where']} - {r['method']}" + (f", symmetry {r['symmetry']}" if r["symmetry"] not in ("", "none")
                                                 else "")
        lines.append(f"| {name} | {r['inputs_per_s']:.1f} | {r['makespan_ms']:.2f} | {r['seconds']:.1f} | "
                     f"{r.get('devices_used', '')} | {r.get('split_units', '')} | {r['paper'] or ''} |")
    if args.runs > 1:
        lines += ["", f"Multi-node rows over {args.runs} runs, throughput (inputs/s), SIMULATED.", "",
                  *([f"<!-- source: {args.jsonl} -->"] if args.jsonl else []),
                  "| row | " + " | ".join(f"run {k}" for k in range(1, args.runs + 1)) + " |",
                  "|---" * (args.runs + 1) + "|"]
        for where, method, symmetry in ROWS:
            runs = [r for r in results if (r["where"], r["method"], r["symmetry"]) == (where, method, symmetry)
                    and where == "multi node"]
            if not runs:
                continue
            figures = [f"{r['inputs_per_s']:.1f}" if "inputs_per_s" in r else "no mapping" for r in runs]
            lines.append(f"| {method}, symmetry {symmetry} | " + " | ".join(figures) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
