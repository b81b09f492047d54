"""The biased (1+1) evolutionary algorithm over DiviML's device string (random hill climbing): one gene per
unit (per batch piece, for throughput) in breadth-first topological order; "biased" because it starts from
every unit on its fastest device rather than at random.

Parameters, and why: each generation flips every gene with probability 1/L (L genes) to another device, at
least one gene (the standard mutation of the (1+1) EA: one change expected, several possible, so it can
leave a local optimum that single moves cannot); the child replaces the parent when it is no worse (equal
fitness lets it drift across plateaus). ``iterations`` (default 4000, as for annealing, so the two get the
same number of replays) or ``time_limit``, whichever comes first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from opsched.mapping.common import fastest_start, fitness
from opsched.mapping.plan import Mapping
from opsched.mapping.problem import Problem

ITERATIONS = 4000


def evolve(problem: Problem, seed: int = 0, time_limit: float = 10.0, iterations: int = ITERATIONS,
           progress: Callable[[int, int], None] | None = None) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=2.0), Node("b", latency=2.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> sorted(len(jobs) for jobs in evolve(build_problem(g, p), iterations=200).order)
    [1, 1]
    """
    rng = random.Random(seed)
    order, genes, current = fastest_start(problem)
    length = problem.n * problem.pieces
    k = problem.devices
    deadline = time.perf_counter() + time_limit
    for step in range(iterations):
        if k < 2 or time.perf_counter() > deadline:
            break
        flips = [i for i in range(length) if rng.random() < 1.0 / length] or [rng.randrange(length)]
        child = [list(g) for g in genes]
        for i in flips:
            u, q = divmod(i, problem.pieces)
            child[u][q] = (child[u][q] + rng.randrange(1, k)) % k
        candidate = fitness(problem, child, order)
        if candidate <= current:
            genes, current = child, candidate
        if progress and step % 100 == 0:
            progress(step, iterations)
    return Mapping.from_pieces(problem, genes, order)
