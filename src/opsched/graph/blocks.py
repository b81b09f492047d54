"""Split a graph into blocks that can be scheduled one after another.

A *cut unit* is one that every path from an input to an output passes through (in Inception, the
concatenation that ends each module). Each block ends at a cut unit (the block owns its exit, not its
entry); units after the last cut form a final block. A block larger than ``max_size`` units is cut into
consecutive parts of its topological order, each at most ``max_size`` units, which keeps IOS's search small
at the price of not overlapping units across a part boundary.

Example:

>>> from opsched.graph.ir import Graph, Node
>>> g = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("a",)), Node("d", args=("b", "c")),
...            Node("e", args=("d",))])
>>> [g.nodes[i].name for i in cut_units(g)]
['a', 'd', 'e']
>>> [[g.nodes[i].name for i in b.units] for b in split_blocks(g)]
[['a'], ['b', 'c', 'd'], ['e']]
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from opsched.graph.ir import Graph, mask_of

# Blocks larger than this are cut into parts. IOS's experiments used 50; with the correct enumeration of
# every ending, a 48-unit NASNet-A block of width 13 takes hours at r=3, s=8, while parts of 20 units keep
# the whole NASNet search under a minute (simulated V100 speedup 1.45x at 20 against 1.43x at 16).
DEFAULT_MAX_SIZE = 20


@dataclass(frozen=True)
class Block:
    """Consecutive units of a graph's topological order, scheduled on their own.

    ``exit`` is the cut unit that ends the block (None for a final block without one, and for every
    part of an oversized block but the last). ``part`` counts from 0 among the ``parts`` of one block.
    """

    units: tuple[int, ...]
    exit: int | None
    part: int = 0
    parts: int = 1

    @property
    def mask(self) -> int:
        return mask_of(self.units)

    def __len__(self) -> int:
        return len(self.units)


def cut_units(graph: Graph) -> list[int]:
    """Units that every input-to-output path passes through, in topological order.

    They are the dominators of a virtual sink that follows every sink, seen from a virtual source that
    precedes every source.
    """
    n = len(graph)
    if n == 0:
        return []
    source, sink = -1, n
    g = nx.DiGraph(graph.edges)
    g.add_nodes_from(range(n))
    g.add_edges_from((source, i) for i in graph.sources)
    g.add_edges_from((i, sink) for i in graph.sinks)
    idom = nx.immediate_dominators(g, source)
    cuts = []
    v = idom[sink]
    while v != source:
        cuts.append(v)
        v = idom[v]
    return sorted(cuts)


def split_blocks(graph: Graph, max_size: int = DEFAULT_MAX_SIZE, at_cuts: bool = True) -> list[Block]:
    """The blocks of ``graph``: split at cut units (unless ``at_cuts`` is False, which keeps the whole
    graph as one block), then cut into parts of at most ``max_size`` units (0: no limit)."""
    if max_size < 0:
        raise ValueError(f"max_size must be 0 (no limit) or positive, got {max_size}")
    order = list(range(len(graph)))
    blocks: list[tuple[list[int], int | None]] = []
    start = 0
    for cut in cut_units(graph) if at_cuts else []:
        blocks.append((order[start:cut + 1], cut))
        start = cut + 1
    if start < len(order):
        blocks.append((order[start:], None))
    result = []
    for units, exit_unit in blocks:
        if not max_size or len(units) <= max_size:
            result.append(Block(tuple(units), exit_unit))
            continue
        parts = -(-len(units) // max_size)
        size, extra = divmod(len(units), parts)
        pos = 0
        for p in range(parts):
            step = size + (p < extra)
            result.append(Block(tuple(units[pos:pos + step]), exit_unit if p == parts - 1 else None, p, parts))
            pos += step
    return result
