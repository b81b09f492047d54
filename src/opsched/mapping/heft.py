"""HEFT (Topcuoglu, Hariri and Wu, 2002): units by decreasing upward rank (mean cost over the devices plus
the longest mean-cost path to an exit, mean communication included), each on the device (for throughput:
the batch split) giving its earliest finish, inserted into the earliest idle gap that fits.

The paper's own 10-task example comes out at its published makespan, 80 (``tests/test_mapping.py``).
"""

from __future__ import annotations

import math
from statistics import fmean

from opsched.graph.ir import indices
from opsched.mapping.common import Memory, Slots, arrival, best_placement, duration, nothing_fits
from opsched.mapping.plan import Job, Mapping
from opsched.mapping.problem import Problem


def upward_ranks(problem: Problem) -> list[float]:
    """rank(u) = mean cost of u + max over successors v of (mean transfer u -> v + rank(v))."""
    k = problem.devices
    pairs = [(a, b) for a in range(k) for b in range(k) if a != b]
    rank = [0.0] * problem.n
    for u in range(problem.n - 1, -1, -1):
        w = fmean(t for t in (problem.time(u, d) for d in range(k)) if math.isfinite(t))
        tail = 0.0
        for v in indices(problem.graph.succs[u]):
            c = fmean(problem.comm(u, v, a, b) for a, b in pairs) if pairs else 0.0
            tail = max(tail, c + rank[v])
        rank[u] = w + tail
    return rank


def heft(problem: Problem, split: bool = True) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=4.0), Node("c", args=("a",), latency=4.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> [[j.unit for j in jobs] for jobs in heft(build_problem(g, p)).order]
    [[0, 1], [2]]

    With ``split`` false, every unit runs whole on one device (its weights held once).
    """
    rank = upward_ranks(problem)
    order = sorted(range(problem.n), key=lambda u: (-rank[u], u))
    slots = Slots(problem.devices)
    memory = Memory(problem)
    placed: dict[tuple[int, int], Job] = {}
    finish: dict[Job, float] = {}
    start: dict[Job, float] = {}
    def end_of(job: Job) -> float:
        return slots.earliest(job.device, arrival(problem, job, placed, finish), duration(problem, job)) + \
            duration(problem, job)

    for u in order:
        best = best_placement(problem, u, end_of, memory, split)
        if best is None:
            raise nothing_fits(problem, u)
        jobs, ends = best
        memory.take(jobs)
        for j, e in zip(jobs, ends):
            s = slots.earliest(j.device, arrival(problem, j, placed, finish), duration(problem, j))
            slots.book(j.device, s, e)
            start[j], finish[j] = s, e
            for q in j.pieces:
                placed[(u, q)] = j
    per_device: list[list[Job]] = [[] for _ in range(problem.devices)]
    for j in sorted(start, key=lambda j: (start[j], finish[j], j.unit)):
        per_device[j.device].append(j)
    return Mapping(per_device)
