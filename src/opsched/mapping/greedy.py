"""Greedy: units in topological order, each placed (device, or batch split) where the makespan so far
grows least, ties to its earliest finish; appended to the devices' queues (no insertion)."""

from __future__ import annotations

from opsched.mapping.common import Memory, arrival, best_placement, duration, nothing_fits
from opsched.mapping.plan import Job, Mapping
from opsched.mapping.problem import Problem


def greedy(problem: Problem) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=2.0), Node("b", latency=2.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> [[j.unit for j in jobs] for jobs in greedy(build_problem(g, p)).order]
    [[0], [1]]
    """
    memory = Memory(problem)
    free = [0.0] * problem.devices
    placed: dict[tuple[int, int], Job] = {}
    finish: dict[Job, float] = {}
    order: list[list[Job]] = [[] for _ in range(problem.devices)]
    for u in range(problem.n):
        best = best_placement(problem, u, lambda j: max(free[j.device], arrival(problem, j, placed, finish)) +
                              duration(problem, j), memory)
        if best is None:
            raise nothing_fits(problem, u)
        jobs, ends = best
        memory.take(jobs)
        for j, end in zip(jobs, ends):
            free[j.device] = end
            finish[j] = end
            order[j.device].append(j)
            for q in j.pieces:
                placed[(u, q)] = j
    return Mapping(order)
