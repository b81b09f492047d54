"""Random mapping problems for the claims MILP-SPLIT, the MILP and the bound make (optimal, a bound, never behind
a heuristic), shared by tests/test_mapping_claims.py (hundreds of cases) and benchmarks/mapping_claims.py
(thousands): chains of small modules joined by one edge, and DAGs with several channels."""

from __future__ import annotations

import itertools
import random

import networkx as nx

from opsched.graph.ir import Graph, Node
from opsched.mapping.milp import rounding_slack
from opsched.mapping.plan import Mapping
from opsched.mapping.platform import platform_from_dict
from opsched.mapping.problem import Problem, build_problem
from opsched.mapping.replay import replay


def _platform(devices: int, memory: float | None) -> dict:
    return {"devices": [{"name": f"d{k}", **({"memory": memory} if memory else {})} for k in range(devices)],
            "links": {"default": {"bandwidth": 4, "latency": 0.5}}}


def _problem(rng: random.Random, nodes: list[Node], devices: int, objective: str, memory: bool) -> Problem:
    """Per-device latencies 1..20, edge bytes 1..40, a unit's bytes 1..9 and, with ``memory``, devices that
    hold about half of them, so that the budget binds."""
    graph = Graph(nodes)
    names = [f"d{k}" for k in range(devices)]
    latencies = {n.name: {d: float(rng.randint(1, 20)) for d in names} for n in graph.nodes}
    for node in graph.nodes:
        node.param_bytes = rng.randint(1, 9)
    budget = max(sum(n.param_bytes for n in graph.nodes) * 0.6, 10) if memory else None  # a unit holds <= 9
    nbytes = {e: float(rng.randint(1, 40)) for e in graph.edges}
    return build_problem(graph, platform_from_dict(_platform(devices, budget)), objective,
                         4 if objective == "throughput" else 1, latencies, nbytes)


def module_chain(seed: int, modules: int = 3, inner: tuple[int, int] = (2, 4), devices: int = 3,
                 objective: str = "latency", memory: bool = False) -> Problem:
    """``modules`` modules joined by one edge, each an entry unit, ``inner`` (least, most) units reading it
    (each also reading the one before it with probability 0.3) and an exit unit reading every inner unit: the
    chains on which MILP-SPLIT once claimed false optima (a boundary after an inner unit that its siblings'
    values crossed)."""
    rng = random.Random(seed)
    nodes, before = [], ()
    for m in range(modules):
        entry, units = f"m{m}e", [f"m{m}i{i}" for i in range(rng.randint(*inner))]
        nodes.append(Node(entry, args=before))
        for i, name in enumerate(units):
            nodes.append(Node(name, args=(entry,) + ((units[i - 1],) if i and rng.random() < 0.3 else ())))
        nodes.append(Node(f"m{m}x", args=tuple(units)))
        before = (f"m{m}x",)
    return _problem(rng, nodes, devices, objective, memory)


def random_dag(seed: int, units: int = 6, devices: int = 2, objective: str = "latency",
               memory: bool = False) -> Problem:
    """``units`` units, each reading each earlier one with probability 0.35."""
    rng = random.Random(seed)
    nodes = [Node(f"u{i}", args=tuple(f"u{j}" for j in range(i) if rng.random() < 0.35)) for i in range(units)]
    return _problem(rng, nodes, devices, objective, memory)


def brute_force(problem: Problem) -> float:
    """The optimum of a latency problem: every assignment with every topological order as the devices' order (an
    optimal schedule's units sorted by start give such an order, and replaying it is no slower); mappings that
    break a memory budget left out."""
    from opsched.mapping import MappingError
    from opsched.mapping.plan import check

    g = nx.DiGraph()
    g.add_nodes_from(range(problem.n))
    g.add_edges_from(problem.graph.edges)
    orders = list(nx.all_topological_sorts(g))
    best = float("inf")
    for devices in itertools.product(range(problem.devices), repeat=problem.n):
        try:
            check(problem, Mapping.from_devices(problem.n, devices, orders[0], problem.devices))
        except MappingError:
            continue
        for order in orders:
            best = min(best, replay(problem, Mapping.from_devices(problem.n, devices, order, problem.devices)).makespan)
    return best


def tolerance(problem: Problem) -> float:
    """How far two proven optima (or a proof and a true optimum) may differ: the MILP's rounding of times, twice
    (once per side), and float noise."""
    return 2 * rounding_slack(problem) + 1e-9


def dag_json(problem: Problem) -> dict:
    """``problem`` as the DAG JSON ``opsched map`` reads (per-device latencies, edge bytes, unit bytes), beside
    its platform's JSON: ``{"dag": ..., "platform": ...}``."""
    names = problem.platform.names
    nodes = [{"name": n.name, "latency": {d: problem.times[u][k][-1] for k, d in enumerate(names)},
              "bytes": int(problem.weight_bytes[u])} for u, n in enumerate(problem.graph.nodes)]
    edges = [[problem.graph.nodes[a].name, problem.graph.nodes[b].name, nbytes]
             for (a, b), nbytes in problem.edge_bytes.items()]
    memory = problem.platform.devices[0].memory
    return {"dag": {"nodes": nodes, "edges": edges},
            "platform": _platform(problem.devices, memory if memory != float("inf") else None)}
