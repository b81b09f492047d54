"""The optimal stream schedule for small graphs, with OR-Tools CP-SAT.

Model: each unit runs on one of K streams for its latency; units on one stream do not overlap; a unit
starts after its inputs finish (plus the synchronisation overhead when the input ran on another stream).
The makespan is minimised. Latencies are scaled to integers (``resolution`` steps per latency unit), so
the optimum is exact up to that rounding; ``stats["status"]`` says OPTIMAL or FEASIBLE (time limit hit), and
``stats["optimal"]`` is true only when the optimum was proven for the latency the cost model reports (the
table cost without capacity; not a cost model whose streams slow each other).
"""

from __future__ import annotations

import time

from opsched.cost.base import CostModel
from opsched.errors import OpschedError
from opsched.graph.ir import Graph
from opsched.interrupt import solve_cp_sat
from opsched.schedule import Schedule, from_streams


def exact(graph: Graph, cost: CostModel, streams: int = 8, time_limit: float = 30.0,
          resolution: int = 1000, max_units: int = 60) -> Schedule:
    """
    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(3, 2)
    >>> exact(g, TableCost(g), streams=2).predicted_latency
    3.0
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise OpschedError("the exact scheduler needs OR-Tools (pip install ortools)") from None
    if len(graph) > max_units:
        raise OpschedError(f"the exact scheduler is for small graphs ({len(graph)} units > {max_units}); "
                           "use ios or lios")
    started = time.perf_counter()
    n, k = len(graph), max(1, min(streams, len(graph)))
    dur = [round(cost.op_latency(u) * resolution) for u in range(n)]
    gap = round(cost.sync_overhead * resolution)
    horizon = sum(dur) + gap * len(graph.edges) + 1
    m = cp_model.CpModel()
    start = [m.NewIntVar(0, horizon, f"s{u}") for u in range(n)]
    end = [m.NewIntVar(0, horizon, f"e{u}") for u in range(n)]
    on = [[m.NewBoolVar(f"x{u}_{j}") for j in range(k)] for u in range(n)]
    for u in range(n):
        m.Add(end[u] == start[u] + dur[u])
        m.AddExactlyOne(on[u])
    for j in range(k):
        m.AddNoOverlap([m.NewOptionalIntervalVar(start[u], dur[u], end[u], on[u][j], f"i{u}_{j}") for u in range(n)])
    for a, b in graph.edges:
        if gap:
            # same == OR_j (on[a][j] and on[b][j]): only an edge between streams pays the event wait.
            same = m.NewBoolVar(f"same{a}_{b}")
            both = [m.NewBoolVar(f"both{a}_{b}_{j}") for j in range(k)]
            for j in range(k):
                m.AddBoolAnd([on[a][j], on[b][j]]).OnlyEnforceIf(both[j])
                m.AddBoolOr([on[a][j].Not(), on[b][j].Not()]).OnlyEnforceIf(both[j].Not())
            m.AddMaxEquality(same, both)
            m.Add(start[b] >= end[a] + gap).OnlyEnforceIf(same.Not())
        m.Add(start[b] >= end[a])
    makespan = m.NewIntVar(0, horizon, "makespan")
    m.AddMaxEquality(makespan, end)
    m.Add(on[0][0] == 1)  # streams are interchangeable
    m.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solve_cp_sat(solver, m)  # on a worker thread: Ctrl-C ends it as an interrupt
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise OpschedError(f"CP-SAT found no schedule within {time_limit} s")
    placed: list[list[int]] = [[] for _ in range(k)]
    for u in sorted(range(n), key=lambda u: (solver.Value(start[u]), u)):
        placed[next(j for j in range(k) if solver.Value(on[u][j]))].append(u)
    schedule = from_streams(graph, cost, "exact", placed,
                            stats={"status": solver.StatusName(status),
                                   "search_seconds": time.perf_counter() - started,
                                   "solver_makespan": solver.Value(makespan) / resolution},
                            options={"streams": streams, "time_limit": time_limit, "resolution": resolution})
    # CP-SAT proves the optimum of the timeline it models (each unit for its own latency, streams not
    # slowing each other). A cost model that prices streams sharing the device differently (the measured
    # and simulated models) gives the schedule another latency, for which nothing was proven.
    schedule.stats["optimal"] = status == cp_model.OPTIMAL and abs(
        schedule.predicted_latency - schedule.stats["solver_makespan"]) <= n / resolution
    return schedule
