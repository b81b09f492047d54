"""Best single device: every unit, the whole batch, on one device in topological order; the device whose
replayed makespan is lowest (among those with the memory for it)."""

from __future__ import annotations

import math

from opsched.mapping import MappingError
from opsched.mapping.plan import Mapping
from opsched.mapping.problem import Problem
from opsched.mapping.replay import replay


def best_device(problem: Problem) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=2.0), Node("b", args=("a",), latency=3.0)])
    >>> p = platform_from_dict({"devices": [{"name": "slow", "scale": 3}, {"name": "fast"}],
    ...                         "links": {"default": {"bandwidth": 1}}})
    >>> [len(jobs) for jobs in best_device(build_problem(g, p)).order]
    [0, 2]
    """
    best, best_time = None, math.inf
    everything = tuple(range(problem.pieces))
    for d, device in enumerate(problem.platform.devices):
        if sum(problem.memory(u) for u in range(problem.n)) > device.memory:
            continue
        if any(math.isinf(problem.time(u, d)) for u in range(problem.n)):
            continue
        mapping = Mapping.from_pieces(problem, [[d] * len(everything) for _ in range(problem.n)], range(problem.n))
        t = replay(problem, mapping).makespan
        if t < best_time:
            best, best_time = mapping, t
    if best is None:
        raise MappingError("no single device has the memory (or accepts the batch) for the whole graph")
    return best
