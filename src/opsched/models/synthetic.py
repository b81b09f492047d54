"""Synthetic DAGs with per-unit latencies, for tests and scheduling research.

>>> g = independent_chains(2, 3)
>>> len(g), g.width
(6, 2)
"""

from __future__ import annotations

import random

from opsched.graph.ir import Graph, Node
from opsched.models.randwire import random_wiring


def independent_chains(chains: int, length: int, latency: float = 1.0) -> Graph:
    """``chains`` independent chains of ``length`` units each (unit ``c{i}_{j}``)."""
    nodes = [Node(f"c{i}_{j}", args=(f"c{i}_{j - 1}",) if j else (), latency=latency)
             for i in range(chains) for j in range(length)]
    return Graph(nodes, name=f"chains-{chains}x{length}")


def random_layered_dag(units: int, layers: int, edge_probability: float = 0.5, seed: int = 0,
                       latency_range: tuple[float, float] = (1.0, 10.0)) -> Graph:
    """Units spread over ``layers`` layers; each unit reads every unit of earlier layers with the given
    probability (and at least one unit of the layer just before, so depth is ``layers``)."""
    rng = random.Random(seed)
    layer_of = sorted(rng.randrange(layers) for _ in range(units))
    by_layer: dict[int, list[str]] = {}
    nodes = []
    for i, layer in enumerate(layer_of):
        name = f"v{i}"
        earlier = [n for l in range(layer) for n in by_layer.get(l, [])]
        args = [n for n in earlier if rng.random() < edge_probability]
        previous = by_layer.get(max((l for l in by_layer if l < layer), default=-1), [])
        if previous and not set(args) & set(previous):
            args.append(rng.choice(previous))
        nodes.append(Node(name, args=tuple(args), latency=round(rng.uniform(*latency_range), 3)))
        by_layer.setdefault(layer, []).append(name)
    return Graph(nodes, name=f"layered-{units}-{layers}-s{seed}")


def randwire_stage(nodes: int = 32, generator: str = "ws", seed: int = 0,
                   latency_range: tuple[float, float] = (1.0, 10.0)) -> Graph:
    """One RandWire stage as a DAG: the random graph (edges from lower to higher index) plus one exit unit
    that reads every sink, with random latencies. WS(32, 4, 0.75) gives the 33-unit stage IOS searched."""
    rng = random.Random(seed)
    dag = random_wiring(nodes, generator, seed)
    units = [Node(f"n{v}", args=tuple(f"n{p}" for p in sorted(dag.predecessors(v))),
                  latency=round(rng.uniform(*latency_range), 3)) for v in range(nodes)]
    sinks = tuple(f"n{v}" for v in range(nodes) if dag.out_degree(v) == 0)
    units.append(Node("exit", args=sinks, latency=round(rng.uniform(*latency_range), 3)))
    return Graph(units, name=f"randwire-stage-{generator}{nodes}-s{seed}")
