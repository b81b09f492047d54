"""The mapping heuristics by name, for :func:`opsched.mapping.solve.solve` and for MILP-SPLIT, which runs them
first (``split.py``): the list heuristics take milliseconds, the two searches up to their ``time_limit``.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> g = Graph([Node("a", latency=2.0), Node("b", latency=2.0)])
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
>>> [len(jobs) for jobs in heuristic(build_problem(g, p), "heft").order]
[1, 1]
"""

from __future__ import annotations

from collections.abc import Callable

from opsched.mapping import MappingError
from opsched.mapping.plan import Mapping
from opsched.mapping.problem import Problem

HEURISTICS = ("best-device", "met", "greedy", "heft", "sa", "ea")
SEARCHES = ("sa", "ea")  # the ones that take their time limit (or their iterations): seconds, not milliseconds


def heuristic(problem: Problem, name: str, seed: int = 0, time_limit: float = 10.0,
              progress: Callable[[int, int], None] | None = None) -> Mapping:
    """The mapping of ``problem`` that heuristic ``name`` (one of :data:`HEURISTICS`) finds; ``seed``,
    ``time_limit`` and ``progress`` are the searches' (SA, EA)."""
    if name == "best-device":
        from opsched.mapping.best_device import best_device

        return best_device(problem)
    if name == "met":
        from opsched.mapping.met import met

        return met(problem)
    if name == "greedy":
        from opsched.mapping.greedy import greedy

        return greedy(problem)
    if name == "heft":
        from opsched.mapping.heft import heft

        return heft(problem)
    if name == "sa":
        from opsched.mapping.anneal import anneal

        return anneal(problem, seed=seed, time_limit=time_limit, progress=progress)
    if name == "ea":
        from opsched.mapping.evolve import evolve

        return evolve(problem, seed=seed, time_limit=time_limit, progress=progress)
    raise MappingError(f"unknown mapping heuristic {name!r}; choose from {', '.join(HEURISTICS)}")
