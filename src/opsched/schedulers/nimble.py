"""Nimble's stream assignment: chains from a minimum path cover, one stream per chain.

The graph is reduced to its minimum equivalent graph (transitive reduction), a maximum bipartite matching
on it (u's "out" side to v's "in" side for each remaining edge u -> v) links units into chains (a minimum
path cover), and each chain becomes a stream, so that events are needed only on edges that cross streams.
With ``streams`` K > 0 and more chains than K, chains are packed onto K streams longest first, each to
the stream with the least work so far.
"""

from __future__ import annotations

import networkx as nx

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph
from opsched.schedule import Schedule, from_streams


def nimble_chains(graph: Graph) -> list[list[int]]:
    """Chains of a minimum path cover of the transitive reduction, each in topological order.

    >>> from opsched.graph.ir import Node
    >>> g = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("a",)), Node("d", args=("b", "c"))])
    >>> nimble_chains(g)
    [[0, 1, 3], [2]]
    """
    reduced = nx.transitive_reduction(graph.to_networkx())
    # Integer labels (unit u's "out" side is u, its "in" side n + u) keep the matching, and so the chains,
    # the same from run to run; tuples of strings would hash differently in every process.
    n = len(graph)
    bipartite = nx.Graph()
    bipartite.add_nodes_from(range(2 * n))
    bipartite.add_edges_from((u, n + v) for u, v in sorted(reduced.edges))
    matching = nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=range(n))
    nxt = {u: matching[u] - n for u in range(n) if u in matching}
    has_prev = set(nxt.values())
    chains = []
    for u in range(len(graph)):
        if u in has_prev:
            continue
        chain = [u]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        chains.append(chain)
    return chains


def nimble(graph: Graph, cost: CostModel, streams: int = 0) -> Schedule:
    chains = nimble_chains(graph)
    options = {"streams": streams, "chains": len(chains)}
    if streams and len(chains) > streams:
        work = [0.0] * streams
        packed: list[list[int]] = [[] for _ in range(streams)]
        for chain in sorted(chains, key=lambda c: -sum(cost.op_latency(u) for u in c)):
            k = min(range(streams), key=lambda i: (work[i], i))
            packed[k].extend(chain)
            work[k] += sum(cost.op_latency(u) for u in chain)
        chains = [sorted(units) for units in packed]  # index order is topological
    return from_streams(graph, cost, "nimble", chains, options=options)
