"""MET (minimum execution time): each unit where it runs fastest, communication and queues ignored; for
throughput, the placement of its batch pieces (a device, or a split) that finishes the unit soonest on
its own (DiviML's bMET). Units run in topological order on each device."""

from __future__ import annotations

from opsched.mapping.common import Memory, duration, jobs_of, nothing_fits, patterns
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
        options = [p for p in patterns(problem) if memory.fits(jobs_of(u, p))]
        if not options:
            raise nothing_fits(problem, u)
        chosen = min(options, key=lambda p: (max(duration(problem, j) for j in jobs_of(u, p)), len(set(p)), p))
        memory.take(jobs_of(u, chosen))
        device_of.append(chosen)
    return Mapping.from_pieces(problem, device_of, range(problem.n))
