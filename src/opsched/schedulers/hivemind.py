"""HiveMind's stream assignment: a depth-first walk of the graph puts the units it explores one after
another on one stream, and every backtrack starts the next stream.

The walk visits a unit only once all its inputs have been visited (so each stream's order, and the order of
the walk as a whole, is topological), goes down to the first ready successor (the earliest in the graph's
order), and when the unit it just placed has no ready successor, backtracks to the most recent unit that
still has one: the units after a backtrack go on a new stream. With ``streams`` K > 0, stream ``s`` is
folded onto ``s mod K``; :func:`hivemind` folds them onto the count the cost model predicts fastest.

Over a model batch, each model is one depth-first path and gets its own stream, which is what HiveMind
wants: the models run side by side.
"""

from __future__ import annotations

from typing import Any

from opsched.cost.base import CostModel
from opsched.graph.ir import Graph, indices
from opsched.schedule import Schedule, from_streams


def hivemind_streams(graph: Graph, streams: int = 0) -> list[list[int]]:
    """The units of each stream, in order.

    >>> from opsched.graph.ir import Node
    >>> g = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("b",)), Node("d", args=("a",)),
    ...            Node("e", args=("c", "d"))])
    >>> hivemind_streams(g)
    [[0, 1, 2], [3, 4]]
    >>> hivemind_streams(g, streams=1)
    [[0, 1, 2, 3, 4]]
    """
    waiting = [p.bit_count() for p in graph.preds]
    placed: list[list[int]] = []
    path: list[int] = []          # the walk's stack: units whose successors may still become ready
    new_stream = True
    roots = [u for u in range(len(graph)) if not waiting[u]]
    while roots or path:
        if path:
            ready = [v for v in indices(graph.succs[path[-1]]) if not waiting[v]]
            if not ready:
                path.pop()
                new_stream = True
                continue
            unit = ready[0]
        else:
            unit = roots.pop(0)
        if new_stream:
            placed.append([])
            new_stream = False
        placed[-1].append(unit)
        waiting[unit] = -1  # visited
        for v in indices(graph.succs[unit]):
            waiting[v] -= 1
        path.append(unit)
    return _folded(placed, streams) if streams > 0 else placed


def _counts(most: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (each about 1.5x the last, so a walk of hundreds of streams is costed
    some twenty times, not hundreds: NASNet-A's 159 took 10 s on a simulated GPU) up to ``most``, and ``most``.

    >>> _counts(20)
    [1, 2, 3, 4, 6, 8, 12, 16, 20]
    """
    counts = [1, 2, 3, 4]
    while counts[-1] < most:
        counts.append(counts[-2] * 2)
    return sorted({c for c in counts if c < most} | {most})


def _folded(placed: list[list[int]], streams: int) -> list[list[int]]:
    """Stream ``s`` of ``placed`` folded onto ``s mod streams``."""
    if len(placed) <= streams:
        return placed
    folded: list[list[int]] = [[] for _ in range(streams)]
    for s, units in enumerate(placed):
        folded[s % streams] += units
    return folded


def hivemind(graph: Graph, cost: CostModel, streams: int = 0, each_part: bool = False) -> Schedule:
    """HiveMind's streams folded onto the number of streams, at most ``streams`` (0: as many as the walk
    makes), whose schedule ``cost`` predicts fastest; the fewest streams among equals. Each stream of its
    own has a price (threads split between streams, the hand-off): on this 2-core CPU, sixteen small CNNs
    on sixteen streams ran 1.46x slower than on one, so the plan keeps the streams only where they pay.
    ``each_part``: every independent part on a stream of its own, whatever the prediction (on a model batch,
    each model on its own stream, as a pool of one thread per model runs them: the evaluation measures it).

    The graph's independent parts (on a model batch with nothing fused, its models) are candidates too, each
    whole on one stream, spread over the streams by their predicted work: the walk cuts a branchy model into
    a stream per branch, where one stream per model is what running models side by side means.

    >>> from opsched.cost.table import TableCost
    >>> from opsched.graph.ir import Node
    >>> g = Graph([Node("a", latency=1.0), Node("b", latency=1.0), Node("c", args=("a", "b"), latency=1.0)])
    >>> hivemind(g, TableCost(g, capacity=2)).streams()
    [['a'], ['b', 'c']]
    >>> hivemind(g, TableCost(g, capacity=1)).streams()  # one unit at a time: a second stream cannot pay
    [['a', 'b', 'c']]
    >>> two = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=1.0), Node("c", args=("a",), latency=1.0),
    ...              Node("d", latency=3.0)])
    >>> hivemind(two, TableCost(two, capacity=2)).streams()  # a and its two readers beside d
    [['a', 'b', 'c'], ['d']]
    >>> hivemind(two, TableCost(two, capacity=1), each_part=True).streams()  # kept apart, whatever it predicts
    [['a', 'b', 'c'], ['d']]
    """
    walked = hivemind_streams(graph)
    parts = independent_parts(graph)
    if each_part:
        return from_streams(graph, cost, "hivemind", parts, options={"streams": streams, "each_part": True})
    candidates = [_folded(walked, count) for count in _counts(_at_most(streams, len(walked)))]
    if len(parts) > 1:
        candidates += [_balanced(parts, count, cost.op_latency) for count in _counts(_at_most(streams, len(parts)))]
    best, best_key = None, None
    for order in candidates:
        schedule = from_streams(graph, cost, "hivemind", order, options={"streams": streams})
        key = (schedule.predicted_latency, len(order))
        if best_key is None or key < best_key:
            best, best_key = schedule, key
    return best


def independent_parts(graph: Graph) -> list[list[int]]:
    """The units of each weakly connected part of the graph (units joined by the values they pass; graph
    inputs join nothing), in graph order.

    >>> from opsched.graph.ir import Node
    >>> independent_parts(Graph([Node("a", args=("x",)), Node("b", args=("x",)), Node("c", args=("b",))],
    ...                         inputs=["x"]))
    [[0], [1, 2]]
    """
    import networkx as nx

    joined = nx.Graph()
    joined.add_nodes_from(range(len(graph)))
    joined.add_edges_from((p, u) for u in range(len(graph)) for p in indices(graph.preds[u]))
    return sorted((sorted(part) for part in nx.connected_components(joined)), key=lambda part: part[0])


def _at_most(streams: int, available: int) -> int:
    return max(1, min(streams, available) if streams > 0 else available)


def _balanced(parts: list[list[int]], count: int, latency: Any) -> list[list[int]]:
    """``parts`` spread over ``count`` streams, the largest predicted first onto the least loaded stream; each
    stream's units in graph order."""
    loads = [0.0] * count
    placed: list[list[int]] = [[] for _ in range(count)]
    for part in sorted(parts, key=lambda part: -sum(latency(u) for u in part)):
        k = loads.index(min(loads))
        placed[k] += part
        loads[k] += sum(latency(u) for u in part)
    return [sorted(units) for units in placed if units]
