"""Simulated annealing over DiviML's device string: one gene per unit (per batch piece, for throughput)
in breadth-first topological order, the order each device runs its units in; the fitness is the replayed
makespan. It starts from every unit on its fastest device.

Parameters, and why: a move changes one random gene to another device (the smallest change, so the
search can walk through near-equal mappings). The start temperature accepts a move 5% worse than the start
with probability 1/e (``T0 = 0.05 * start makespan``): DiviML's mappings differ by a few percent per move.
The temperature falls geometrically to T0/1000 over ``iterations`` moves (default 4000: 2-6 s of replays on
the benchmark graphs), the best mapping seen is kept, and the search stops early at ``time_limit``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from opsched.mapping.common import fastest_start, fitness
from opsched.mapping.plan import Mapping
from opsched.mapping.problem import Problem

START_TEMPERATURE = 0.05   # of the starting makespan
END_TEMPERATURE = 1e-3     # of the start temperature
ITERATIONS = 4000


def anneal(problem: Problem, seed: int = 0, time_limit: float = 10.0, iterations: int = ITERATIONS,
           progress: Callable[[int, int], None] | None = None) -> Mapping:
    """
    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=2.0), Node("b", latency=2.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> sorted(len(jobs) for jobs in anneal(build_problem(g, p), iterations=200).order)
    [1, 1]
    """
    rng = random.Random(seed)
    order, genes, current = fastest_start(problem)
    best, best_genes = current, [list(g) for g in genes]
    temperature = START_TEMPERATURE * (current if math.isfinite(current) else 1.0)
    cooling = END_TEMPERATURE ** (1.0 / max(1, iterations))
    deadline = time.perf_counter() + time_limit
    k = problem.devices
    for step in range(iterations):
        if k < 2 or time.perf_counter() > deadline:
            break
        u, q = rng.randrange(problem.n), rng.randrange(problem.pieces)
        old = genes[u][q]
        genes[u][q] = (old + rng.randrange(1, k)) % k
        candidate = fitness(problem, genes, order)
        delta = candidate - current
        if delta <= 0 or (math.isfinite(delta) and rng.random() < math.exp(-delta / max(temperature, 1e-300))):
            current = candidate
            if current < best:
                best, best_genes = current, [list(g) for g in genes]
        else:
            genes[u][q] = old
        temperature *= cooling
        if progress and step % 100 == 0:
            progress(step, iterations)
    return Mapping.from_pieces(problem, best_genes, order)
