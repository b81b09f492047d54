"""DiviML's recursive lower bound (Section IV-B2) on the makespan of every feasible mapping.

For modules M_1..M_Q in order and G_s = M_s + ... + M_Q, each bound below is one of the paper's two
inequalities with every OPT replaced by a lower bound of it, so the result stays a lower bound:

- ``LB(G_s) >= LB(M_s) + min over inputs I of G_{s+1} of base(dep(I))``: the unit of M_s that finishes
  last feeds some input I of G_{s+1}, and everything depending on I runs after it. Used only when every
  unit of M_s without a successor in M_s has one in G_{s+1} (else the last unit may feed nothing).
- ``LB(G_s) >= LB(G_{s+1}) + min over outputs O of M_s of base(pre(O))``: the first unit of G_{s+1} to start
  waits for some output O of M_s and all O's ancestors in M_s. Used only when every unit of G_{s+1} without
  a predecessor in G_{s+1} reads M_s.

``base(S)``: the larger of the critical path of S (each unit at its fastest, transfers free) and the work
bound (the LP relaxation of spreading S's work over the devices, each device's load at most T: GLOP).
For throughput, every piece of the batch crosses the critical path, and the work bound spreads the pieces
as jobs of any accepted size. ``LB(M_s)`` is the larger of ``base(M_s)`` and, when given, what the module's
MILP proved (``module_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from opsched.graph.ir import indices, mask_of
from opsched.mapping.modules import Decomposition, decompose
from opsched.mapping.problem import Problem


class Prepared:
    """What every bound of one problem reuses: each unit's fastest time and the classes of devices that
    cost every unit the same."""

    def __init__(self, problem: Problem):
        self.fastest = [min(min(row) for row in problem.times[u]) for u in range(problem.n)]
        self.classes = problem.speed_classes()


def base_bound(problem: Problem, units: Sequence[int], prepared: Prepared | None = None) -> float:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=4.0), Node("b", latency=4.0), Node("c", latency=4.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> round(base_bound(build_problem(g, p), [0, 1, 2]), 6)
    6.0
    """
    if not units:
        return 0.0
    prepared = prepared or Prepared(problem)
    return max(critical_path(problem, units, prepared.fastest), work_bound(problem, units, prepared.classes))


def critical_path(problem: Problem, units: Sequence[int], fastest: Sequence[float]) -> float:
    inside = mask_of(units)
    longest: dict[int, float] = {}
    for u in sorted(units):
        longest[u] = fastest[u] + max((longest[a] for a in indices(problem.graph.preds[u] & inside)), default=0.0)
    return max(longest.values())


def work_bound(problem: Problem, units: Sequence[int], classes: Sequence[Sequence[int]]) -> float:
    """min T: jobs of every size k (fractional counts z >= 0) cover each unit's pieces, each device's load <= T.

    ``classes``: devices that cost every unit the same are one class of m devices whose load is at most m T
    (any fractional load of the class splits evenly over them), which makes the LP as small as the platform
    has kinds: 12 times smaller on six nodes of two pairs of devices.
    """
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("GLOP")
    t = solver.NumVar(0.0, solver.infinity(), "T")
    load = [solver.Constraint(-solver.infinity(), 0.0) for _ in classes]
    for row, members in zip(load, classes, strict=True):
        row.SetCoefficient(t, -float(len(members)))
    for u in units:
        cover = solver.Constraint(float(problem.pieces), solver.infinity())
        for row, members in zip(load, classes, strict=True):
            for k in range(1, problem.pieces + 1):
                cost = problem.time(u, members[0], k)
                if math.isfinite(cost):
                    z = solver.NumVar(0.0, solver.infinity(), "")
                    cover.SetCoefficient(z, float(k))
                    row.SetCoefficient(z, cost)
    solver.Minimize(t)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return 0.0
    return max(0.0, t.solution_value() * (1 - 1e-9))


def lower_bound(problem: Problem, decomposition: Decomposition | None = None,
                module_bound: Callable[[list[int]], float] | None = None) -> float:
    """The recursive bound over ``decomposition`` (default: ``decompose(graph)``)."""
    graph = problem.graph
    modules = (decomposition or decompose(graph)).modules
    prepared = Prepared(problem)

    def bound_of(mask: int, whole: int, whole_bound: float) -> float:
        # a dependency (predecessor) set that is the whole rest (module) has the recursive bound already
        return whole_bound if mask == whole else base_bound(problem, list(indices(mask)), prepared)

    everything = list(range(problem.n))
    if len(modules) == 1:
        return max(base_bound(problem, everything, prepared), module_bound(modules[0]) if module_bound else 0.0)
    own = [max(base_bound(problem, m, prepared), module_bound(m) if module_bound else 0.0) for m in modules]
    suffix_bound = own[-1]
    rest_mask = mask_of(modules[-1])
    for s in range(len(modules) - 2, -1, -1):
        here = mask_of(modules[s])
        rest = rest_mask
        candidates = [own[s], suffix_bound, base_bound(problem, list(indices(here | rest)), prepared)]
        inputs = [u for u in indices(rest) if graph.preds[u] & here]
        last_feed = all(graph.succs[u] & rest for u in indices(here) if not graph.succs[u] & here)
        if inputs and last_feed:
            candidates.append(own[s] + min(bound_of((graph.descendants[i] | (1 << i)) & rest, rest, suffix_bound)
                                           for i in inputs))
        outputs = [u for u in indices(here) if graph.succs[u] & rest]
        first_waits = all(graph.preds[u] & here for u in indices(rest) if not graph.preds[u] & rest)
        if outputs and first_waits:
            candidates.append(suffix_bound + min(bound_of((graph.ancestors[o] | (1 << o)) & here, here, own[s])
                                                 for o in outputs))
        suffix_bound = max(candidates)
        rest_mask = here | rest
    return suffix_bound
