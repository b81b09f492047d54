"""Symmetry breaking for the mapping MILP (DiviML Section VI).

A mapping and the one got by swapping two interchangeable devices (or two interchangeable nodes, device r
of one for device r of the other) take the same time, so the solver need look at one of each such set.
Three criteria order the members of an orbit, as in the paper: ``batch`` (the batch pieces a device runs),
``task`` (the units it runs) and ``time`` (its busy time): the earlier device of two interchangeable ones
gets at least as much as the later, and the earlier node of two interchangeable nodes at least as much in
total. Every mapping can be permuted into one that satisfies these (sort the nodes of each node orbit by
their totals, then the devices of each device orbit), so no optimum is lost; :func:`canonical` does that
permutation, which makes a heuristic's mapping a valid starting point (hint) for the constrained model.

Devices holding pinned units are left out of every orbit, and so are their nodes: a permutation would move
the pins.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> from opsched.mapping.plan import Mapping
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
>>> prob = build_problem(Graph([Node("a", latency=1.0), Node("b", latency=2.0)]), p)
>>> m = canonical(prob, Mapping.from_devices(2, [1, 1], [0, 1], 2), "task")
>>> [[j.unit for j in jobs] for jobs in m.order]
[[0, 1], []]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from opsched.mapping.plan import Job, Mapping
from opsched.mapping.platform import Symmetry
from opsched.mapping.problem import Problem

SYMMETRIES = ("none", "batch", "task", "time")


def orbits(problem: Problem, symmetry: str, fixed: Iterable[int] = ()) -> Symmetry:
    """The orbits the constraints order (none for ``symmetry="none"``): devices and nodes interchangeable on
    the platform whose costs are also the same for every unit."""
    if symmetry == "none":
        return Symmetry([], [])
    speed = {d: i for i, members in enumerate(problem.speed_classes()) for d in members}
    return problem.platform.symmetry(sorted(set(fixed)), alike=lambda a, b: speed[a] == speed[b])


def add_constraints(model, problem: Problem, symmetry: str, fixed: Iterable[int], pieces_on: Sequence[Sequence],
                    busy: Sequence[Sequence], units_on: Sequence) -> Symmetry:
    """Order the orbits' members in the CP-SAT ``model``. Per device d: ``pieces_on[d]`` the literals of
    the pieces it runs, ``busy[d]`` (literal, duration) of its jobs, ``units_on[d]`` the linear expression
    counting the units it runs some of."""
    found = orbits(problem, symmetry, fixed)
    if not found.device_orbits and not found.node_orbits:
        return found

    def amount(d: int):
        if symmetry == "batch":
            return sum(pieces_on[d])
        if symmetry == "task":
            return units_on[d]
        return sum(lit * c for lit, c in busy[d])

    for orbit in found.device_orbits:
        for a, b in itertools.pairwise(orbit):
            model.Add(amount(a) >= amount(b))
    for orbit in found.node_orbits:
        for first, second in itertools.pairwise(orbit):
            model.Add(sum(amount(d) for d in first) >= sum(amount(d) for d in second))
    return found


def canonical(problem: Problem, mapping: Mapping, symmetry: str, fixed: Iterable[int] = ()) -> Mapping:
    """``mapping`` with interchangeable nodes and devices permuted so that it satisfies the constraints of
    :func:`add_constraints` (the same times: only the devices' names change)."""
    found = orbits(problem, symmetry, fixed)
    if not found.device_orbits and not found.node_orbits:
        return mapping
    order = [list(jobs) for jobs in mapping.order]
    for orbit in found.node_orbits:
        ranked = sorted(orbit, key=lambda members: -sum(amount_of(problem, symmetry, order[d]) for d in members))
        contents = [[order[d] for d in members] for members in ranked]
        for members, content in zip(orbit, contents, strict=True):
            for d, jobs in zip(members, content, strict=True):
                order[d] = jobs
    for orbit in found.device_orbits:
        contents = sorted((order[d] for d in orbit), key=lambda jobs: -amount_of(problem, symmetry, jobs))
        for d, jobs in zip(orbit, contents, strict=True):
            order[d] = jobs
    return Mapping([[Job(j.unit, d, j.pieces) for j in jobs] for d, jobs in enumerate(order)])


def balanced(problem: Problem, mapping: Mapping, load: Sequence[float], fixed: Iterable[int] = ()) -> Mapping:
    """``mapping`` with interchangeable nodes and devices permuted so that the busiest contents go where
    ``load`` (each device's busy time before this problem's jobs) is least. For ``problem`` alone nothing
    changes (only the devices' names do); for a chain of problems solved one after another, each blind to the
    others' jobs, it keeps the chain's work spread instead of every problem's largest share landing on the
    same first device of each orbit, which canonical forms (and solvers' tie-breaking) would do.

    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> prob = build_problem(Graph([Node("a", latency=1.0), Node("b", latency=2.0)]), p)
    >>> m = balanced(prob, Mapping.from_devices(2, [0, 0], [0, 1], 2), load=[5.0, 0.0])
    >>> [[j.unit for j in jobs] for jobs in m.order]
    [[], [0, 1]]
    """
    found = orbits(problem, "time", fixed)
    if not found.device_orbits and not found.node_orbits:
        return mapping
    order = [list(jobs) for jobs in mapping.order]

    def busy(jobs: Sequence[Job]) -> float:
        return amount_of(problem, "time", jobs)

    for orbit in found.node_orbits:
        contents = sorted(([order[d] for d in members] for members in orbit), key=lambda c: -sum(map(busy, c)))
        targets = sorted(orbit, key=lambda members: sum(load[d] for d in members))
        for members, content in zip(targets, contents, strict=True):
            for d, jobs in zip(members, content, strict=True):
                order[d] = jobs
    for orbit in found.device_orbits:
        contents = sorted((order[d] for d in orbit), key=lambda jobs: -busy(jobs))
        for d, jobs in zip(sorted(orbit, key=lambda d: load[d]), contents, strict=True):
            order[d] = jobs
    return Mapping([[Job(j.unit, d, j.pieces) for j in jobs] for d, jobs in enumerate(order)])


def amount_of(problem: Problem, symmetry: str, jobs: Sequence[Job]) -> float:
    """What ``symmetry`` counts of a device's ``jobs``."""
    if symmetry == "batch":
        return sum(len(j.pieces) for j in jobs)
    if symmetry == "task":
        return len({j.unit for j in jobs})
    return sum(problem.time(j.unit, j.device, len(j.pieces)) for j in jobs)
