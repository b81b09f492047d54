"""One entry point for every mapping algorithm: ``solve(problem, method)`` -> the mapping, whether it is
proven optimal, the lower bound beside it and the search statistics.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> g = Graph([Node("a", latency=2.0), Node("b", latency=2.0)])
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
>>> s = solve(build_problem(g, p), "milp", time_limit=5)
>>> s.makespan, s.optimal, s.lower_bound
(2.0, True, 2.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opsched.mapping import MappingError
from opsched.mapping.heuristics import HEURISTICS, heuristic
from opsched.mapping.plan import Mapping, check
from opsched.mapping.problem import Problem
from opsched.mapping.replay import Timeline, replay

METHODS = (*HEURISTICS, "milp", "milp-split")


@dataclass
class Solved:
    mapping: Mapping
    timeline: Timeline
    optimal: bool
    lower_bound: float
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return self.timeline.makespan


def solve(problem: Problem, method: str, time_limit: float = 30.0, seed: int = 0, symmetry: str = "none",
          progress: Callable[[int, int], None] | None = None, bound: bool = True) -> Solved:
    """Map ``problem`` with ``method`` within ``time_limit`` seconds (the searches; the list heuristics take
    milliseconds). ``lower_bound`` is DiviML's recursive bound, raised to what a solver proved."""
    from opsched.mapping.bound import lower_bound
    from opsched.mapping.milp import rounding_slack

    if not time_limit > 0:  # nan too
        raise MappingError(f"the time limit must be a number of seconds > 0, got {time_limit!r}")
    started = time.perf_counter()
    stats: dict[str, Any] = {}
    optimal = False
    proven_bound = 0.0
    if method in HEURISTICS:
        mapping = heuristic(problem, method, seed=seed, time_limit=time_limit, progress=progress)
    elif method == "milp":
        from opsched.mapping.heft import heft
        from opsched.mapping.milp import milp

        try:
            hint = heft(problem)
        except MappingError:  # HEFT's greedy placement can run out of memory where the MILP finds a mapping
            hint = None
        result = milp(problem, time_limit=time_limit, hint=hint, symmetry=symmetry)
        mapping, optimal, proven_bound = result.mapping, result.optimal, result.bound
        stats.update(status=result.status, solver_makespan=result.solver_makespan,
                     symmetry_factor=result.symmetry_factor)
    elif method == "milp-split":
        from opsched.mapping.split import milp_split

        result = milp_split(problem, time_limit=time_limit, symmetry=symmetry, progress=progress, seed=seed)
        mapping, optimal = result.mapping, result.optimal
        stats.update(modules=len(result.decomposition.modules), channels=result.decomposition.channels,
                     single_channel=result.decomposition.single_channel, solves=result.solves,
                     symmetry_factor=result.symmetry_factor,
                     module_sizes=[len(m) for m in result.decomposition.modules],
                     cut_by=result.decomposition.cut_by,
                     decomposition_out_of_time=result.decomposition.out_of_time,
                     heuristics={name: {"makespan": ms, "seconds": sec} for name, (ms, sec) in result.heuristics.items()},
                     taken_from=result.taken_from)
    else:
        raise MappingError(f"unknown mapping method {method!r}; choose from {', '.join(METHODS)}")
    check(problem, mapping)
    timeline = replay(problem, mapping)
    seconds = time.perf_counter() - started
    # MILP-SPLIT's modules are the bound's (the same decompose arguments): cutting a large graph takes seconds
    parts = result.decomposition if method == "milp-split" else None
    lb = max(lower_bound(problem, parts) if bound else 0.0, proven_bound)
    if optimal:  # proven, up to the MILP's rounding of times to whole steps (the optimum may be that much less)
        lb = max(lb, timeline.makespan - rounding_slack(problem))
    stats["solve_seconds"] = seconds
    return Solved(mapping, timeline, optimal, min(lb, timeline.makespan), seconds, stats)
