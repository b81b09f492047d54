"""What the list-scheduling heuristics and the searches share: the best way to place a unit's batch
(``best_placement``), the breadth-first topological order, the time a job's inputs arrive, a device's free slots,
and the memory left on each device.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> g = Graph([Node("a", latency=1.0), Node("b", latency=1.0), Node("c", args=("a", "b"), latency=1.0)])
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
>>> prob = build_problem(g, p)
>>> breadth_first_order(prob)
[0, 1, 2]
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

import networkx as nx

from opsched.graph.ir import indices
from opsched.mapping import MappingError
from opsched.mapping.plan import Job
from opsched.mapping.problem import Problem


def best_placement(problem: Problem, unit: int, end_of: Callable[[Job], float], memory: Memory,
                   split: bool = True) -> tuple[list[Job], list[float]] | None:
    """The placement of ``unit`` whose last job ends first, ``end_of(job)`` giving a job's end: its batch
    pieces cut into consecutive runs, each run a job on its own device (for 4 pieces on 3 devices: whole on
    one, 3+1, 1+3, 2+2, 2+1+1, ... 39 ways; with ``split`` false, whole on one device only). Ties go to
    fewer jobs, then to the smaller device string.
    Returns (jobs, their ends), or None when no placement fits the memory left.

    Each cut into p runs is a bottleneck assignment of runs to distinct devices, and some best assignment
    gives every run one of its own p best devices (were a run elsewhere, one of those p would be free, and no
    later), so only those are tried: at most p^p per cut instead of devices! / (devices - p)!.

    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y", "scale": 2}],
    ...                         "links": {"default": {"bandwidth": 1}}})
    >>> prob = build_problem(Graph([Node("a", latency=4.0)]), p, objective="throughput", batch=4)
    >>> jobs, ends = best_placement(prob, 0, lambda j: duration(prob, j), Memory(prob))
    >>> [(j.device, j.pieces) for j in jobs], ends
    ([(0, (0, 1, 2)), (1, (3,))], [3.0, 2.0])
    """
    pieces, k = problem.pieces, problem.devices
    ends: dict[tuple[int, int, int], float] = {}  # (first piece, last piece + 1, device) -> end

    def end(first: int, stop: int, d: int) -> float:
        key = (first, stop, d)
        if key not in ends:
            job = Job(unit, d, tuple(range(first, stop)))
            fits = math.isfinite(duration(problem, job)) and memory.fits([job])
            ends[key] = end_of(job) if fits else math.inf
        return ends[key]

    best = None
    for parts in range(1, min(pieces, k) + 1 if split else 2):
        for cuts in itertools.combinations(range(1, pieces), parts - 1):
            runs = list(zip((0, *cuts), (*cuts, pieces), strict=True))
            candidates = [sorted(range(k), key=lambda d, r=r: (end(*r, d), d))[:parts] for r in runs]
            for devices in itertools.product(*candidates):
                if len(set(devices)) < parts:
                    continue
                finish = [end(*r, d) for r, d in zip(runs, devices, strict=True)]
                if math.isinf(max(finish)):
                    continue
                pattern = tuple(d for (a, b), d in zip(runs, devices, strict=True) for _ in range(a, b))
                key = (max(finish), parts, pattern)
                if best is None or key < best[0]:
                    best = (key, runs, devices, finish)
    if best is None:
        return None
    _, runs, devices, finish = best
    jobs = [Job(unit, d, tuple(range(a, b))) for (a, b), d in zip(runs, devices, strict=True)]
    return jobs, finish


def breadth_first_order(problem: Problem) -> list[int]:
    """Units by topological generation (all sources, then what depends only on them, ...), each generation
    in graph order: the order of DiviML's device strings."""
    g = nx.DiGraph()
    g.add_nodes_from(range(problem.n))
    g.add_edges_from(problem.graph.edges)
    return [u for generation in nx.topological_generations(g) for u in sorted(generation)]


def arrival(problem: Problem, job: Job, placed: dict[tuple[int, int], Job], finish: dict[Job, float]) -> float:
    """When every input of ``job`` is on its device, its producers' jobs placed (``placed[(unit, piece)]``)
    and timed (``finish``)."""
    ready = 0.0
    for a in indices(problem.graph.preds[job.unit]):
        for q in job.pieces:
            src = placed[(a, q)]
            ready = max(ready, finish[src] + problem.comm(a, job.unit, src.device, job.device, 1))
    return ready


class Slots:
    """The busy intervals of each device, for insertion-based list scheduling (HEFT)."""

    def __init__(self, devices: int):
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(devices)]

    def earliest(self, d: int, ready: float, duration: float) -> float:
        """The earliest start >= ``ready`` of an idle gap of ``duration`` on device ``d``."""
        t = ready
        for s, f in self.busy[d]:
            if t + duration <= s + 1e-12:
                return t
            t = max(t, f)
        return t

    def book(self, d: int, start: float, finish: float) -> None:
        bisect.insort(self.busy[d], (start, finish))


class Memory:
    """Bytes left on each device as units are placed."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.left = [d.memory for d in problem.platform.devices]

    def fits(self, jobs: Sequence[Job]) -> bool:
        need: dict[int, float] = {}
        for j in jobs:
            need[j.device] = need.get(j.device, 0.0) + self.problem.memory(j.unit, len(j.pieces))
        return all(v <= self.left[d] * (1 + 1e-9) for d, v in need.items())

    def take(self, jobs: Sequence[Job]) -> None:
        for j in jobs:
            self.left[j.device] -= self.problem.memory(j.unit, len(j.pieces))


def duration(problem: Problem, job: Job) -> float:
    return problem.time(job.unit, job.device, len(job.pieces))


def nothing_fits(problem: Problem, unit: int) -> MappingError:
    return MappingError(f"unit {problem.graph.nodes[unit].name!r} fits in no device's remaining memory: the memory "
                        "budget is too small for this mapping")


def fastest_start(problem: Problem) -> tuple[list[int], list[list[int]], float]:
    """Where SA and EA start: the breadth-first order, the device string with every piece of every unit on
    its fastest device, and that string's makespan."""
    order = breadth_first_order(problem)
    genes = [[problem.fastest(u)] * problem.pieces for u in range(problem.n)]
    return order, genes, fitness(problem, genes, order)


def fitness(problem: Problem, device_of: Sequence[Sequence[int]], order: Sequence[int]) -> float:
    """The replayed makespan of a device string (``inf`` when it breaks a memory budget)."""
    from opsched.mapping.plan import Mapping
    from opsched.mapping.replay import replay

    mapping = Mapping.from_pieces(problem, device_of, order)
    used = [0.0] * problem.devices
    for j in mapping.jobs():
        used[j.device] += problem.memory(j.unit, len(j.pieces))
        if math.isinf(duration(problem, j)):
            return math.inf
    if any(u > d.memory * (1 + 1e-9) for u, d in zip(used, problem.platform.devices)):
        return math.inf
    return replay(problem, mapping).makespan
