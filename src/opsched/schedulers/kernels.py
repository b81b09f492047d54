"""Which of two kernels runs each part of a graph: the labelling that costs least, found exactly by one minimum
s-t cut (:func:`cheapest_kernels`).

Each node ``u`` (a unit, or a block of units) costs ``first[u]`` milliseconds on the first kernel and
``second[u]`` on the second (``inf`` where that kernel cannot run it), and every edge whose two ends run on
different kernels costs its ``crossing`` attribute (a layout conversion, a session started). Minimising the sum
over all 2^n labellings is a binary labelling with non-negative pairwise costs that are zero when both ends
agree: such an energy is submodular, and the minimum cut of the graph below is its minimum (Kolmogorov and
Zabih, "What energy functions can be minimized via graph cuts?", 2004). Source side means the first kernel:

- source -> u with capacity ``second[u]`` (cut when u takes the second kernel),
- u -> sink with capacity ``first[u]`` (cut when u takes the first),
- u <-> v with capacity ``crossing`` both ways for every edge (cut when they differ).

A node's two costs are first lowered by the smaller of them (the same for both labels: the argmin holds),
so capacities are never negative. networkx's preflow-push finds the cut.

>>> import networkx as nx
>>> graph = nx.DiGraph([("a", "b"), ("b", "c")])
>>> nx.set_edge_attributes(graph, 0.1, "crossing")
>>> cheapest_kernels(graph, {"a": 1.0, "b": 5.0, "c": 1.0}, {"a": 2.0, "b": 1.0, "c": 2.0})
{'a': 0, 'b': 1, 'c': 0}
>>> nx.set_edge_attributes(graph, 3.0, "crossing")  # crossing twice costs more than b saves
>>> cheapest_kernels(graph, {"a": 1.0, "b": 5.0, "c": 1.0}, {"a": 4.0, "b": 1.0, "c": 4.0})
{'a': 0, 'b': 0, 'c': 0}
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

import networkx as nx

_SOURCE, _SINK = object(), object()


def cheapest_kernels(graph: nx.DiGraph, first: Mapping[Hashable, float],
                     second: Mapping[Hashable, float]) -> dict[Hashable, int]:
    """Each node of ``graph`` labelled 0 (the first kernel) or 1 (the second) so that the sum of the labels'
    costs and of the ``crossing`` of every edge whose ends differ (0 where an edge has none) is least (see the
    module docstring). Every node needs one finite cost. Where two labellings cost the same, nodes stay on the
    first kernel."""
    flow = nx.DiGraph()
    flow.add_nodes_from((_SOURCE, _SINK))
    for u in graph.nodes:
        if math.isinf(first[u]) and math.isinf(second[u]):
            raise ValueError(f"no kernel can run {u!r}")
        floor = min(first[u], second[u])
        # an edge without a capacity is one of infinite capacity to networkx: the label it forbids is never taken
        _add(flow, _SOURCE, u, second[u] - floor)
        _add(flow, u, _SINK, first[u] - floor)
    for u, v, crossing in graph.edges(data="crossing", default=0.0):
        if crossing > 0:
            for a, b in ((u, v), (v, u)):
                flow.add_edge(a, b, capacity=flow.get_edge_data(a, b, {}).get("capacity", 0.0) + crossing)
    _, (source_side, _) = nx.minimum_cut(flow, _SOURCE, _SINK)
    labels = {u: 0 if u in source_side else 1 for u in graph.nodes}
    # the residual graph's source side is the smallest minimum cut's: a node whose kernels cost the same, with
    # nothing to tip it, lands on the sink's side; moved back, the cost does not rise (checked, not assumed)
    moved = True
    while moved:  # (a move changes its neighbours' gains: until none moves; each node moves at most once)
        moved = False
        for u in graph.nodes:
            if labels[u] == 1 and not math.isinf(first[u]) and _gain_of_first(graph, labels, u, first, second) >= 0:
                labels[u], moved = 0, True
    return labels


def labelling_cost(graph: nx.DiGraph, labels: Mapping[Hashable, int], first: Mapping[Hashable, float],
                   second: Mapping[Hashable, float]) -> float:
    """What ``labels`` costs: each node on its kernel, and each edge whose ends differ, its crossing."""
    nodes = sum(second[u] if labels[u] else first[u] for u in graph.nodes)
    return nodes + sum(c for u, v, c in graph.edges(data="crossing", default=0.0) if labels[u] != labels[v])


def _gain_of_first(graph: nx.DiGraph, labels: dict, u: Hashable, first: Mapping, second: Mapping) -> float:
    """What moving ``u`` from the second kernel to the first saves (negative: what it costs)."""
    gain = second[u] - first[u]
    for _, v, c in graph.out_edges(u, data="crossing", default=0.0):
        gain += -c if labels[v] == 1 else c
    for p, _, c in graph.in_edges(u, data="crossing", default=0.0):
        gain += -c if labels[p] == 1 else c
    return gain


def _add(flow: nx.DiGraph, a: object, b: object, capacity: float) -> None:
    if math.isinf(capacity):
        flow.add_edge(a, b)
    elif capacity > 0:
        flow.add_edge(a, b, capacity=capacity)
