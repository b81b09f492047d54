"""``opsched map``: map a model or a DAG JSON graph onto a platform's devices (see :func:`opsched.jobs.map`) and
report the plan: the design's ``method``, ``objective``, ``platform``, ``predicted`` (the latency, or inputs
per time unit for throughput), ``lower_bound``, ``optimal``, ``solve_seconds``, ``placements`` and
``transfers``; plus ``makespan``, ``batch``, ``unit``, ``simulated`` (true when any device is simulated or the
costs are a DAG JSON file's: :func:`opsched.mapping.platform.figures_simulated`), ``devices`` (units per device),
``stats`` and ``plan``. On a platform whose devices are all real, also what ``opsched optimize`` reports of its
measured run: ``measured_ms`` (the mapping, each device alone and eager), ``chosen``, ``max_error``; and,
with several CPU devices, ``co_running`` (by device the mapping uses, how much slower its units run beside
the other devices' than alone, measured for this mapping: its prediction uses it; the search and its bound use
the units alone; empty when it uses one device) and ``handoff_ms`` (what a value crossing them costs, searched
with)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from opsched.commands.common import choice_text, load_and_capture, measured_fields, refuse_existing
from opsched.progress import say

if TYPE_CHECKING:
    from opsched.mapping.problem import Problem


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.jobs import map as map_onto
    from opsched.mapping.platform import load_platform
    from opsched.models.spec import unit_graph

    platform = load_platform(args.platform)
    refuse_existing(args.out, force=getattr(args, "force", False))
    options = {"platform": platform, "method": args.method, "objective": args.objective, "time_limit": args.time_limit,
               "seed": args.seed, "symmetry": args.symmetry, "threads": args.threads, "tolerance": args.tolerance,
               "repeats": args.repeats, "cache": not args.no_cache, "say": say,
               "notes": lambda note: print(f"opsched: note: {note}", file=sys.stderr)}
    with search_progress(args.method) as progress:
        if args.model.endswith(".json"):
            from opsched.mapping import graphfile

            graph, latencies, edge_bytes = graphfile.read(args.model)
            outcome = map_onto(graph, batch=args.batch or 1, latencies=latencies or None,
                               edge_bytes=edge_bytes or None, progress=progress, **options)
        elif (graph := unit_graph(args.model, args.batch)) is not None:
            outcome = map_onto(graph, batch=args.batch or 1, progress=progress, **options)
        else:
            loaded, graph, _, _ = load_and_capture(args, args.model, "cpu")
            outcome = map_onto(loaded.model, tuple(loaded.inputs), graph=graph, batch=args.batch, progress=progress,
                               **options)
    problem, solved = outcome.problem, outcome.solved
    mapped = outcome.schedules[args.method]
    plan = outcome.plan()
    units = {name: 0 for name in platform.names}
    for op in mapped.ops:
        units[platform.names[op.stream]] += 1
    result: dict[str, Any] = {
        "method": args.method, "objective": problem.objective, "platform": platform.name,
        "predicted": problem.objective_value(mapped.predicted_latency), "lower_bound": solved.lower_bound,
        "optimal": solved.optimal, "solve_seconds": solved.seconds,
        "placements": mapped.devices.placements(mapped.ops, mapped.batch),
        "transfers": [{**vars(t), "inputs": list(t.inputs)} for t in mapped.devices.transfers],
        "makespan": solved.makespan, "batch": problem.batch, "unit": _unit(problem), "simulated": problem.simulated,
        "devices": units, "stats": solved.stats, "plan": args.out,
    }
    if problem.objective == "throughput":
        result["throughput_bound"] = problem.objective_value(solved.lower_bound)
    if problem.co_running or problem.handoff:  # several CPU devices of this machine, measured
        result["co_running"] = {problem.platform.devices[d].name: f for d, f in sorted(problem.co_running.items())}
        result["handoff_ms"] = problem.handoff
    if outcome.measured:
        result.update(measured_fields(outcome, plan))
    elif outcome.notes:
        result["warnings"] = list(outcome.notes)
    if args.out:
        plan.save(args.out)
    for warning in result.get("warnings", []):
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if not args.json:
        _print(result, problem)
    return result


def _unit(problem: Problem) -> str:
    if problem.objective == "throughput":
        return f"inputs/{problem.time_unit}" if problem.time_unit else "inputs per time unit"
    return problem.time_unit


class search_progress:
    """Progress on stderr (see :mod:`opsched.progress`) for the searches that report it."""

    def __init__(self, method: str):
        self.method = method
        self.bar = None

    def __enter__(self):
        if self.method not in ("sa", "ea", "milp-split"):
            return None
        from opsched.progress import progress_bar

        def update(done: int, total: int) -> None:
            if self.bar is None:
                self.bar = progress_bar(self.method, total)
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.bar.close()  # the search is over: its time is the bar's, not the lower bound's after it

        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _print(result: dict[str, Any], problem: Problem) -> None:
    label = "SIMULATED" if result["simulated"] else "measured costs"
    unit = f" {result['unit']}" if result["unit"] else ""
    what = "throughput" if problem.objective == "throughput" else "latency"
    print(f"mapping     {result['method']} onto {result['platform']} ({label}), {what}, batch {result['batch']}")
    print(f"predicted   {result['predicted']:.6g}{unit}")
    print(f"makespan    {result['makespan']:.6g}  (lower bound {result['lower_bound']:.6g})"
          + ("  (optimal)" if result["optimal"] else ""))
    print(f"solved in   {result['solve_seconds']:.2f} s")
    if "co_running" in result:
        beside = ", ".join(f"{name} {f:.3g}x" for name, f in result["co_running"].items())
        print("costs       " + (f"each device's units beside the others', against alone: {beside}; " if beside else "")
              + f"a value crossing CPU devices {result['handoff_ms']:.3g} ms (measured)")
    ran = result["stats"].get("heuristics")
    if ran is not None:  # MILP-SPLIT: the heuristics it ran on the whole graph, and which mapping it returns
        print("heuristics  " + (", ".join(f"{name} {h['makespan']:.6g} ({h['seconds']:.2f} s)" for name, h in ran.items())
                                or "none found a mapping") + f"; the mapping is {result['stats']['taken_from']}'s")
    factor = result["stats"].get("symmetry_factor", 1)
    if factor > 1:
        print(f"symmetry    each mapping searched stands for up to {factor:.3g} equivalent ones (interchangeable "
              "devices and nodes)")
    for device, count in result["devices"].items():
        print(f"  {device:<10} {count} units")
    print(f"transfers   {len(result['transfers'])}")
    measured = result.get("measured_ms")
    if measured:
        print("measured    (this machine; every configuration verified against eager, timed interleaved)")
        for name, ms in sorted(measured.items(), key=lambda item: item[1]):
            mark = "*" if name == result["chosen"] else " "
            print(f"  {mark} {name:<16} {ms:8.3f} ms  {result['speedups'][name]:5.2f}x eager")
        print(f"chosen      {result['chosen']}: {choice_text(result)}; the plan written is {result['plan_method']}'s "
              f"(largest error {result['max_error']:.3g} of each output's magnitude)")
    elif result.get("warnings"):
        print("measured    not run (see the warnings)")
    if result["plan"]:
        print(f"plan        {result['plan']}")
