"""``opsched map``: map a model or a DAG JSON graph onto a platform's devices and print (or return) the plan.

The returned object is the design's: ``method``, ``objective``, ``platform``, ``predicted`` (the latency, or
inputs per time unit for throughput), ``lower_bound`` (on the latency / makespan of the batch),
``optimal``, ``solve_seconds``, ``placements`` and ``transfers``; plus ``makespan``, ``batch``, ``unit``,
``simulated``, ``devices`` (units per device), ``stats`` and ``plan`` (the file written with ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from opsched.mapping import MappingError
from opsched.mapping.platform import load_platform
from opsched.mapping.problem import Problem, build_problem
from opsched.mapping.solve import solve


def map_command(args: argparse.Namespace) -> dict[str, Any]:
    platform = load_platform(args.platform)
    if args.out and Path(args.out).exists() and not getattr(args, "force", False):
        raise MappingError(f"{args.out} exists; pass --force to overwrite it")
    problem = load_problem(args, platform)
    for note in problem.notes:
        print(f"opsched: note: {note}", file=sys.stderr)
    with _progress(args.method) as progress:
        solved = solve(problem, args.method, time_limit=args.time_limit, seed=args.seed, symmetry=args.symmetry,
                       progress=progress)
    from opsched.mapping.plan import placements, to_schedule, transfers

    schedule = to_schedule(problem, solved.mapping, solved.timeline, args.method, solved.lower_bound, solved.optimal,
                           solved.stats)
    if args.out:
        schedule.save(args.out)
    units = {name: 0 for name in platform.names}
    for op in schedule.ops:
        units[platform.names[op.stream]] += 1
    result = {
        "method": args.method, "objective": problem.objective, "platform": platform.name,
        "predicted": problem.objective_value(solved.makespan), "lower_bound": solved.lower_bound,
        "optimal": solved.optimal, "solve_seconds": solved.seconds,
        "placements": placements(problem, solved.timeline), "transfers": transfers(problem, solved.timeline),
        "makespan": solved.makespan, "batch": problem.batch, "unit": _unit(problem), "simulated": problem.simulated,
        "devices": units, "stats": solved.stats, "plan": args.out,
    }
    if problem.objective == "throughput":
        result["throughput_bound"] = problem.objective_value(solved.lower_bound)
    if not args.json:
        _print(result, problem)
    return result


def load_problem(args: argparse.Namespace, platform) -> Problem:
    """The graph (DAG JSON, or a model captured at ``--batch``) and its costs on ``platform``."""
    if args.model.endswith(".json"):
        from opsched.mapping import graphfile

        graph, latencies, edge_bytes = graphfile.read(args.model)
        return build_problem(graph, platform, args.objective, args.batch or 1, latencies or None,
                             edge_bytes if edge_bytes else None)
    from opsched.models.spec import unit_graph

    graph = unit_graph(args.model, args.batch)
    if graph is not None:
        return build_problem(graph, platform, args.objective, args.batch or 1)
    from opsched.commands import load_and_capture

    loaded, graph, _, _ = load_and_capture(args, args.model, "cpu")
    costs: dict[tuple[str, int], list[float]] = {}

    def measure(device, threads: int) -> list[float]:
        from opsched.mapping.execute import check_cuda_devices, cuda_index, on_cuda_device

        gpu = cuda_index(device.kind)
        if gpu is not None:
            check_cuda_devices([(device.name, device.kind)], "the platform has")
        key = (device.kind, 1 if gpu is not None else threads)  # threads are a CPU device's
        if key not in costs:
            from opsched.commands import _flat
            from opsched.pipeline import cost_model

            if gpu is None:
                cost, _ = cost_model(graph, _flat(loaded.inputs), "measured", cores=threads, device="cpu")
                costs[key] = [cost.latency[threads][u] for u in range(len(graph))]
            else:  # the units' weights and the inputs on that GPU, timed there
                with on_cuda_device(graph, _flat(loaded.inputs), gpu) as (placed, inputs):
                    cost, _ = cost_model(placed, inputs, "measured", device="cuda")
                costs[key] = [cost.best[u] for u in range(len(graph))]
        return costs[key]

    return build_problem(graph, platform, args.objective, args.batch or int(loaded.inputs[0].shape[0]),
                         measure=measure)


def _unit(problem: Problem) -> str:
    if problem.objective == "throughput":
        return f"inputs/{problem.time_unit}" if problem.time_unit else "inputs per time unit"
    return problem.time_unit


class _progress:
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
    print(f"predicted   {result['predicted']:.6g}{unit}" + ("  (optimal)" if result["optimal"] else ""))
    print(f"makespan    {result['makespan']:.6g}  (lower bound {result['lower_bound']:.6g})")
    print(f"solved in   {result['solve_seconds']:.2f} s")
    factor = result["stats"].get("symmetry_factor", 1)
    if factor > 1:
        print(f"symmetry    each mapping searched stands for up to {factor:.3g} equivalent ones (interchangeable "
              "devices and nodes)")
    for device, count in result["devices"].items():
        print(f"  {device:<10} {count} units")
    print(f"transfers   {len(result['transfers'])}")
    if result["plan"]:
        print(f"plan        {result['plan']}")
