"""The exact mapping of DiviML's MILP (Section IV-A), solved with OR-Tools CP-SAT.

Variables and constraints, in the paper's numbering:

- (1) each unit (each piece of the batch, for throughput) on exactly one device: ``x[u][d]`` / ``x[u][q][d]``;
- (2) every job finishes by the makespan ``C``, which is minimised (latency; throughput is ``B / C``);
- (3) precedence with communication: a reader starts after its producer finishes, plus the transfer when
  the two are on different devices (enforced on the pair of placements);
- (4, 5) batching: the pieces of a unit on one device form one job of 1..4 pieces (B/4, B/2, 3B/4, B), one
  indicator ``b[u][d][k]`` per size, only sizes the device accepts; the job's duration is that size's cost;
- (6) memory: weights of every job plus its share of inputs and output within each device's budget;
- (7) no overlap on a device: for the latency objective, a disjunction only for pairs of units on no common
  path (pairs on a path are ordered by (3)), as the paper prunes with the transitive closure (a redundant
  global no-overlap on top made CP-SAT's presolve prove a wrong optimum, so it is not stated). For
  throughput, pieces of units on one path can overlap on a device, so every pair of jobs is covered, by
  CP-SAT's global no-overlap.
- symmetry (``none|batch|task|time``): interchangeable devices within a node and interchangeable nodes are
  ordered by their pieces / units / busy time (DiviML Section VI; ``symmetry.py``), the hint permuted to fit.

Times are scaled to integers (``scale`` steps per time unit, chosen so the horizon is about 10^7 steps);
the bound CP-SAT proves is reported less the largest rounding error, so it stays a lower bound.
CP-SAT rather than HiGHS: the model is scheduling (intervals, no-overlap, implications on pairs of
placements), which CP-SAT states directly; a MILP solver needs big-M rows for each, whose LP relaxations are
weak. Measured (``solver="highs"`` solves this same model as a MILP, ``highs.py``; ``docs/mapping.md``): on
small DAGs both prove the optimum, HiGHS 3-15x slower; an 11-unit RandWire module CP-SAT proves in 0.06 s,
HiGHS not in 20 s; on 55 and 110 units HiGHS did not improve on HEFT's mapping in 20 s, CP-SAT did.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Mapping as MappingType
from dataclasses import dataclass

from opsched.interrupt import solve_cp_sat
from opsched.mapping import MappingError
from opsched.mapping.plan import Job, Mapping
from opsched.mapping.problem import Problem
from opsched.mapping.replay import replay
from opsched.mapping.symmetry import SYMMETRIES, add_constraints, canonical

HORIZON_STEPS = 1e7
SOLVERS = ("cp-sat", "highs")


@dataclass
class MilpResult:
    mapping: Mapping
    status: str
    optimal: bool        # CP-SAT proved the optimum (of the integer-scaled times)
    bound: float         # a lower bound on the makespan
    solver_makespan: float
    seconds: float
    symmetry_factor: int = 1   # equivalent mappings each one the model kept stands for (1: no symmetry broken)


def milp(problem: Problem, time_limit: float = 30.0, hint: Mapping | None = None, symmetry: str = "none",
         pinned: MappingType[int, int] | None = None, workers: int = 2,
         progress: Callable[[float], None] | None = None,
         memory_caps: Sequence[tuple[Sequence[int], float]] = (), solver: str = "cp-sat") -> MilpResult:
    """The optimal mapping of ``problem`` (or the best found within ``time_limit`` seconds). ``hint`` starts
    the search from a known mapping; ``pinned`` fixes some units (all their pieces) on a device;
    ``memory_caps`` (devices, bytes) caps what the mapping holds on each group of devices together (what
    MILP-SPLIT leaves a module so that the modules after it still fit). ``solver``: CP-SAT, or HiGHS on the same model read as a
    MILP (``highs.py``; no ``progress`` reports, one thread), for comparing them.

    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=4.0), Node("c", args=("a",), latency=4.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> r = milp(build_problem(g, p, edge_bytes={(0, 1): 2.0, (0, 2): 2.0}))
    >>> r.optimal, replay(build_problem(g, p, edge_bytes={(0, 1): 2.0, (0, 2): 2.0}), r.mapping).makespan
    (True, 7.0)
    """
    from ortools.sat.python import cp_model

    if symmetry not in SYMMETRIES:
        raise MappingError(f"unknown symmetry {symmetry!r}; choose from {', '.join(SYMMETRIES)}")
    if solver not in SOLVERS:
        raise MappingError(f"unknown MILP solver {solver!r}; choose from {', '.join(SOLVERS)}")
    if solver == "highs" and progress is not None:
        raise MappingError("progress reports come from CP-SAT's solution callback; HiGHS has none here")
    started = time.perf_counter()
    n, k, pieces = problem.n, problem.devices, problem.pieces
    scale = _scale(problem)

    def steps(t: float) -> int:
        return round(t * scale)

    dur = [[[steps(problem.time(u, d, c)) if math.isfinite(problem.time(u, d, c)) else None
             for c in range(1, pieces + 1)] for d in range(k)] for u in range(n)]
    comm = {(a, b, da, db): steps(problem.comm(a, b, da, db, 1))
            for a, b in problem.graph.edges for da in range(k) for db in range(k) if da != db}
    horizon = sum(max(x for row in dur[u] for x in row if x is not None) for u in range(n))
    horizon += sum(max([comm[(a, b, da, db)] for da in range(k) for db in range(k) if da != db] or [0])
                   for a, b in problem.graph.edges) + 1
    m = cp_model.CpModel()
    makespan = m.NewIntVar(0, horizon, "C")
    mem_unit = max(1.0, max((d.memory for d in problem.platform.devices if math.isfinite(d.memory)), default=1.0) / 1e6)
    usage: list[list[tuple[cp_model.LinearExprT, int]]] = [[] for _ in range(k)]
    intervals: list[list] = [[] for _ in range(k)]
    busy: list[list] = [[] for _ in range(k)]
    pinned = pinned or {}
    if pieces == 1:
        x = [[m.NewBoolVar(f"x{u}_{d}") for d in range(k)] for u in range(n)]
        for u in range(n):
            for d in range(k):
                if dur[u][d][0] is None or pinned.get(u, d) != d:
                    m.Add(x[u][d] == 0)
        start = [m.NewIntVar(0, horizon, f"s{u}") for u in range(n)]
        end = [m.NewIntVar(0, horizon, f"e{u}") for u in range(n)]
        for u in range(n):
            m.AddExactlyOne(x[u])
            m.Add(makespan >= end[u])
            for d in range(k):
                if dur[u][d][0] is None or pinned.get(u, d) != d:
                    continue
                iv = m.NewOptionalIntervalVar(start[u], dur[u][d][0], end[u], x[u][d], f"i{u}_{d}")
                intervals[d].append(iv)
                busy[d].append((x[u][d], dur[u][d][0]))
                usage[d].append((x[u][d], math.ceil(problem.memory(u) / mem_unit)))
        for a, b in problem.graph.edges:
            m.Add(start[b] >= end[a])
            for (aa, bb, da, db), c in comm.items():
                if (aa, bb) == (a, b) and c > 0:
                    m.Add(start[b] >= end[a] + c).OnlyEnforceIf([x[a][da], x[b][db]])
        related = [problem.graph.ancestors[u] | problem.graph.descendants[u] for u in range(n)]
        pairs = []  # (i, j, i before j) for a start's orders
        for i in range(n):
            for j in range(i + 1, n):
                if related[i] >> j & 1:
                    continue  # on a common path: ordered by precedence already
                before = m.NewBoolVar(f"o{i}_{j}")
                pairs.append((i, j, before))
                for d in range(k):
                    if dur[i][d][0] is None or dur[j][d][0] is None:
                        continue
                    m.Add(end[i] <= start[j]).OnlyEnforceIf([before, x[i][d], x[j][d]])
                    m.Add(end[j] <= start[i]).OnlyEnforceIf([before.Not(), x[i][d], x[j][d]])
        pieces_on = [[x[u][d] for u in range(n)] for d in range(k)]
        units_on = [sum(lits) for lits in pieces_on]  # one piece a unit
    else:
        x = [[[m.NewBoolVar(f"x{u}_{q}_{d}") for d in range(k)] for q in range(pieces)] for u in range(n)]
        for u in range(n):
            for d in range(k):
                if all(c is None for c in dur[u][d]) or pinned.get(u, d) != d:
                    m.AddBoolAnd([x[u][q][d].Not() for q in range(pieces)])
        size = [[[m.NewBoolVar(f"b{u}_{d}_{c}") for c in range(pieces + 1)] for d in range(k)] for u in range(n)]
        start = [[m.NewIntVar(0, horizon, f"s{u}_{d}") for d in range(k)] for u in range(n)]
        end = [[m.NewIntVar(0, horizon, f"e{u}_{d}") for d in range(k)] for u in range(n)]
        for u in range(n):
            for q in range(pieces):
                m.AddExactlyOne(x[u][q])
            for d in range(k):
                m.AddExactlyOne(size[u][d])
                m.Add(sum(c * size[u][d][c] for c in range(pieces + 1)) == sum(x[u][q][d] for q in range(pieces)))
                m.Add(makespan >= end[u][d]).OnlyEnforceIf(size[u][d][0].Not())
                for c in range(1, pieces + 1):
                    if dur[u][d][c - 1] is None:
                        m.Add(size[u][d][c] == 0)
                        continue
                    iv = m.NewOptionalIntervalVar(start[u][d], dur[u][d][c - 1], end[u][d], size[u][d][c],
                                                  f"i{u}_{d}_{c}")
                    intervals[d].append(iv)
                    busy[d].append((size[u][d][c], dur[u][d][c - 1]))
                    usage[d].append((size[u][d][c], math.ceil(problem.memory(u, c) / mem_unit)))
        for a, b in problem.graph.edges:
            for q in range(pieces):
                for da in range(k):
                    for db in range(k):
                        gap = comm.get((a, b, da, db), 0)
                        m.Add(start[b][db] >= end[a][da] + gap).OnlyEnforceIf([x[a][q][da], x[b][q][db]])
        units_on = [n - sum(size[u][d][0] for u in range(n)) for d in range(k)]  # b[u][d][0]: none on d
        pieces_on = [[x[u][q][d] for u in range(n) for q in range(pieces)] for d in range(k)]
    for d, device in enumerate(problem.platform.devices):
        if pieces > 1:
            # For latency the pairs' disjunctions above imply it. Stated there too, over optional intervals that
            # share each unit's start and end across devices, it made CP-SAT's presolve (OR-Tools 9.15) prove a
            # wrong optimum: 17.0 on a 6-unit DAG where 16.5 is feasible (found by HiGHS; presolve off gave 16.5).
            m.AddNoOverlap(intervals[d])
        if math.isfinite(device.memory):
            m.Add(sum(c * lit for lit, c in usage[d]) <= math.floor(device.memory / mem_unit))
    for group, cap in memory_caps:
        if math.isfinite(cap):
            m.Add(sum(c * lit for d in group for lit, c in usage[d]) <= math.floor(cap / mem_unit))
    found = add_constraints(m, problem, symmetry, pinned.values(), pieces_on, busy, units_on)
    if hint is not None and not within_caps(problem, hint, memory_caps):
        hint = None  # it breaks a cap: no help to CP-SAT, nor a fallback
    if hint is not None:
        hint = canonical(problem, hint, symmetry, pinned.values())
        _hint(m, problem, hint, x)
        if solver == "highs":
            # HiGHS completes a partial start with a sub-MIP its time limit does not cover (3.5 s past a 5 s
            # limit on 110 units): it gets the rest of the start too, from the replay of the mapping
            _hint_schedule(m, problem, hint, scale, start, end, pairs if pieces == 1 else size)
    m.Minimize(makespan)
    # the limit is the whole call's: building the model (about 0.5 s for 150 units) counts
    budget = max(0.05, time_limit - (time.perf_counter() - started))
    if solver == "highs":
        from opsched.mapping.highs import solve_highs

        found_highs = solve_highs(m, budget)
        status, bound, name = found_highs.status, found_highs.bound, "HiGHS"

        def value(var) -> int:
            return round(found_highs.values[var.Index()])
    else:
        cp = cp_model.CpSolver()
        cp.parameters.max_time_in_seconds = budget
        cp.parameters.num_workers = workers
        callback = _Progress(progress, makespan, scale) if progress else None
        code = solve_cp_sat(cp, m, callback)  # on a worker thread: Ctrl-C ends it as an interrupt
        status, bound, value, name = cp.StatusName(code), cp.BestObjectiveBound(), cp.Value, "CP-SAT"
    if status not in ("OPTIMAL", "FEASIBLE"):
        if hint is None or not _fits_pins(hint, pinned):
            raise MappingError("no mapping fits the devices' memory budgets" if status == "INFEASIBLE" else
                               f"{name} found no mapping within {time_limit:g} s")
        if status == "INFEASIBLE":  # the model rounds memory up, caps down: a hint that fits may not fit it
            bound = 0.0
        # out of time before the solver's first mapping (a large model's presolve alone can take that long):
        # the hint is the best mapping known, and what the solver proved is still a bound
        slack = rounding_slack(problem)
        return MilpResult(hint, status, False, max(0.0, bound / scale - slack), replay(problem, hint).makespan,
                          time.perf_counter() - started, found.factor)
    jobs: list[tuple[int, int, int, tuple[int, ...]]] = []
    for u in range(n):
        for d in range(k):
            if pieces == 1:
                if value(x[u][d]):
                    jobs.append((value(start[u]), u, d, (0,)))
            else:
                qs = tuple(q for q in range(pieces) if value(x[u][q][d]))
                if qs:
                    jobs.append((value(start[u][d]), u, d, qs))
    order: list[list[Job]] = [[] for _ in range(k)]
    for _, u, d, qs in sorted(jobs):
        order[d].append(Job(u, d, qs))
    mapping = Mapping(order)
    slack = rounding_slack(problem)
    solver_makespan = value(makespan) / scale
    replayed = replay(problem, mapping).makespan
    optimal = status == "OPTIMAL" and replayed <= solver_makespan + slack
    if hint is not None and not optimal and _fits_pins(hint, pinned) and replay(problem, hint).makespan < replayed:
        mapping = hint  # stopped by the time limit before it got back to where it started
    return MilpResult(mapping, status, optimal, max(0.0, bound / scale - slack), solver_makespan,
                      time.perf_counter() - started, found.factor)


def held(problem: Problem, mapping: Mapping, devices: Iterable[int]) -> float:
    """The bytes ``mapping`` holds on ``devices`` together."""
    return sum(problem.memory(j.unit, len(j.pieces)) for d in devices for j in mapping.order[d])


def within_caps(problem: Problem, mapping: Mapping, memory_caps: Sequence[tuple[Sequence[int], float]]) -> bool:
    """Whether ``mapping`` holds no more than each cap's bytes on its group of devices together."""
    return all(held(problem, mapping, group) <= cap for group, cap in memory_caps)


def _fits_pins(mapping: Mapping, pinned: MappingType[int, int]) -> bool:
    return all(j.device == pinned.get(j.unit, j.device) for j in mapping.jobs())


def rounding_slack(problem: Problem) -> float:
    """How far the MILP's rounding of times to whole steps can move a schedule's makespan: one rounding per job
    and per transfer. A proven optimum is the true one within it, and a proven bound less it is a true bound."""
    return (problem.n * problem.pieces + len(problem.graph.edges)) / _scale(problem)


def _scale(problem: Problem) -> float:
    """Integer steps per time unit: a power of ten putting the largest possible schedule near 10^7 steps."""
    total = sum(max(t for row in problem.times[u] for t in row if math.isfinite(t)) for u in range(problem.n))
    total += sum(problem.comm(a, b, 0, 1, 1) if problem.devices > 1 else 0.0 for a, b in problem.graph.edges)
    if total <= 0:
        return 1.0
    return 10.0 ** math.floor(math.log10(HORIZON_STEPS / total))


def _hint(m, problem: Problem, hint: Mapping, x) -> None:
    """Hint the devices of a known mapping (its times follow; hinting them too, rounded, misled CP-SAT)."""
    for job in hint.jobs():
        u, d = job.unit, job.device
        for q in job.pieces:
            row = x[u] if problem.pieces == 1 else x[u][q]
            for dd in range(problem.devices):
                m.AddHint(row[dd], int(dd == d))


def _hint_schedule(m, problem: Problem, hint: Mapping, scale: float, start, end, orders_or_sizes) -> None:
    """Hint the times of a known mapping's replay and, for latency, each unrelated pair's order
    (``orders_or_sizes``: the (i, j, before) pairs), for throughput each job's size (the size indicators)."""
    timeline = replay(problem, hint)
    if problem.pieces == 1:
        at = {j.unit: timeline.start[j] for j in hint.jobs()}
        for j in hint.jobs():
            m.AddHint(start[j.unit], round(timeline.start[j] * scale))
            m.AddHint(end[j.unit], round(timeline.finish[j] * scale))
        for i, j, before in orders_or_sizes:
            m.AddHint(before, int(at[i] <= at[j]))
        return
    placed = {(j.unit, j.device): j for j in hint.jobs()}
    for u in range(problem.n):
        for d in range(problem.devices):
            job = placed.get((u, d))
            for c, indicator in enumerate(orders_or_sizes[u][d]):
                m.AddHint(indicator, int(c == (len(job.pieces) if job else 0)))
            # a job not in the mapping gets times too (any: its rows do not hold), so that HiGHS has its orders
            m.AddHint(start[u][d], round(timeline.start[job] * scale) if job else 0)
            m.AddHint(end[u][d], round(timeline.finish[job] * scale) if job else 0)


class _Progress:
    """Reports each better makespan CP-SAT finds."""

    def __new__(cls, report: Callable[[float], None], makespan, scale: float):
        from ortools.sat.python import cp_model

        class Callback(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                report(self.Value(makespan) / scale)

        return Callback()

