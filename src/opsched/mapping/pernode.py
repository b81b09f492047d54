"""The single-node baseline of DiviML's GPT-3 case study: cut the graph into one consecutive part per node
and map each part onto its own node's devices only, the way LLM serving is usually partitioned by hand (fit
a part on one node, then add nodes). DiviML solves one node's part and replicates its mapping; here every
part is solved (the first and last parts hold the embedding and the head, so they are not alike), which is
at least as good as replicating. The parts are cut at cut units (``modules.py``), balanced by the memory
they need; the joined mapping is replayed on the whole platform, so the transfers between nodes count.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> from opsched.mapping.problem import build_problem
>>> g = Graph([Node("a", latency=2.0), Node("b", args=("a",), latency=2.0), Node("c", args=("b",), latency=2.0),
...            Node("d", args=("c",), latency=2.0)])
>>> p = platform_from_dict({"devices": [{"name": "x", "node": "n0"}, {"name": "y", "node": "n1"}],
...                         "links": {"default": {"bandwidth": 1}}})
>>> m = per_node(build_problem(g, p), "heft", time_limit=5)
>>> [[j.unit for j in jobs] for jobs in m.order]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import time
from dataclasses import replace

from opsched.graph.ir import indices
from opsched.mapping import MappingError
from opsched.mapping.modules import decompose
from opsched.mapping.plan import Job, Mapping
from opsched.mapping.platform import Platform
from opsched.mapping.problem import Problem
from opsched.mapping.split import module_problem


def per_node(problem: Problem, method: str, time_limit: float = 60.0, symmetry: str = "none") -> Mapping:
    """Each node's part of ``problem`` mapped by ``method`` onto that node's devices (``time_limit`` shared
    out by the parts' sizes)."""
    from opsched.mapping.solve import solve

    nodes: dict[str, list[int]] = {}
    for d, device in enumerate(problem.platform.devices):
        nodes.setdefault(device.node, []).append(d)
    members = list(nodes.values())
    parts = _parts(problem, len(members))
    started = time.perf_counter()
    order: list[list[Job]] = [[] for _ in range(problem.devices)]
    position = {u: i for i, units in enumerate(parts) for u in units}
    for i, (units, devices) in enumerate(zip(parts, members, strict=True)):
        entries = sorted({a for u in units for a in indices(problem.graph.preds[u]) if position[a] < i})
        sub, back = module_problem(on_devices(problem, devices), units, entries)
        left = (time_limit - (time.perf_counter() - started)) * len(units) / sum(map(len, parts[i:]))
        solved = solve(sub, method, time_limit=max(0.05, left), symmetry=symmetry, bound=False)
        for local, jobs in enumerate(solved.mapping.order):
            d = devices[local]
            order[d].extend(Job(back[j.unit], d, j.pieces) for j in jobs if back[j.unit] is not None)
    return Mapping(order)


def _parts(problem: Problem, count: int) -> list[list[int]]:
    """``count`` consecutive runs of the graph's single-channel modules, each needing about the same memory."""
    modules = decompose(problem.graph, 1, min_size=1).modules
    if len(modules) < count:
        raise MappingError(f"the graph has {len(modules)} module(s) between cut units, too few to give each of "
                           f"{count} nodes a part")
    need = [sum(problem.memory(u) for u in m) for m in modules]
    total = sum(need)
    parts: list[list[int]] = [[] for _ in range(count)]
    done = 0.0
    for t, (units, bytes_) in enumerate(zip(modules, need, strict=True)):
        # the part whose share of the total the middle of this module falls in; every part keeps one module
        i = min(count - 1, int((done + bytes_ / 2) / total * count)) if total else t * count // len(modules)
        i = max(i, count - (len(modules) - t))
        parts[i].extend(units)
        done += bytes_
    if any(not p for p in parts):
        raise MappingError("a node's part of the graph came out empty: the graph's modules are too uneven")
    return parts


def on_devices(problem: Problem, devices: list[int]) -> Problem:
    """``problem`` on some of its platform's devices only (their costs, memory and links)."""
    platform = problem.platform
    keep = {d: i for i, d in enumerate(devices)}
    links = {(keep[a], keep[b]): link for (a, b), link in platform.links.items() if a in keep and b in keep}
    sub = Platform(f"{platform.name}/{platform.devices[devices[0]].node}", [platform.devices[d] for d in devices],
                   links, platform.source)
    times = [[row[d] for d in devices] for row in problem.times]
    return replace(problem, platform=sub, times=times)
