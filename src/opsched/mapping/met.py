"""MET (minimum execution time): each unit where it runs fastest, communication and queues ignored; for
throughput, the placement of its batch pieces (a device, or a split) that finishes the unit soonest on
its own (DiviML's bMET). Units run in topological order on each device."""

from __future__ import annotations

from opsched.mapping.common import Memory, best_placement, duration, nothing_fits
from opsched.mapping.plan import Mapping
from opsched.mapping.problem import Problem


def met(problem: Problem) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=2.0), Node("b", latency=3.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}},)
    >>> [[j.unit for j in jobs] for jobs in met(build_problem(g, p)).order]
    [[0, 1], []]
    """
    memory = Memory(problem)
    device_of = []
    for u in range(problem.n):
        best = best_placement(problem, u, lambda j: duration(problem, j), memory)
        if best is None:
            raise nothing_fits(problem, u)
        jobs, _ = best
        memory.take(jobs)
        device_of.append(tuple(j.device for j in sorted(jobs, key=lambda j: j.pieces) for _ in j.pieces))
    return Mapping.from_pieces(problem, device_of, range(problem.n))
