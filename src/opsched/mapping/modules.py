"""Cutting a graph into modules for MILP-SPLIT and the lower bound (DiviML Section IV-B).

- Single channel: a *cut unit* is one every other unit is an ancestor or a descendant of, and whose value is
  the only one its descendants read from it or before it (a bridge of the graph once DiviML's dummy node
  splits the unit: the module owning its exit and the next module reading it). Modules run from one cut to the next, the cut
  included; consecutive small modules are joined (the join of consecutive modules is still cut-bounded).
- Several channels: the modules are the k-edge-connected components (k = channels + 1) of the undirected
  graph in which each value read by several units is first a hub node (so a value crossing a boundary is
  one edge, as DiviML counts channels), components smaller than ``min_size`` joined to the neighbour they
  share most edges with, and components on a cycle of the module graph joined, so the modules form a DAG
  taken in topological order. The components for every k come from one Gomory-Hu tree of that graph
  (``connectivity_tree``). Past a deadline the tree is abandoned and the topological order is cut where few
  values are live (``frontier_modules``, also used when the components are too large).

>>> from opsched.graph.ir import Graph, Node
>>> chain = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("a",)), Node("d", args=("b", "c")),
...                Node("e", args=("d",)), Node("f", args=("d",)), Node("g", args=("e", "f"))])
>>> cut_units(chain)
[0, 3, 6]
>>> single_channel_modules(chain, min_size=1)
[[0], [1, 2, 3], [4, 5, 6]]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import networkx as nx

from opsched.graph.ir import Graph, indices


@dataclass
class Decomposition:
    modules: list[list[int]]
    channels: int            # the most values crossing a boundary between consecutive modules
    single_channel: bool     # every boundary is a cut unit (MILP-SPLIT is then exact)
    cut_by: str = "cut units"  # or "edge-connected components", "live values" (frontier_modules)
    out_of_time: bool = False  # the deadline ended the edge-connected components: cut by live values instead


class OutOfTime(Exception):
    """The deadline passed while the edge-connected components were being found."""


def cut_units(graph: Graph) -> list[int]:
    """Units whose value is the only one crossing the boundary right after them in topological order: every
    other unit reaches them or is reached from them, and no value of their ancestors is read past them. (Every
    unit reaching a unit u and reached from it is not enough: in ``a -> b -> c`` with ``a -> c``, ``b`` is
    on every path's way in that sense, but ``a``'s value crosses the boundary after ``b`` beside ``b``'s.)

    >>> from opsched.graph.ir import Graph, Node
    >>> cut_units(Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("a", "b"))]))
    [0, 2]
    """
    n = len(graph)
    cuts = []
    for u in range(n):
        before, after = graph.ancestors[u], graph.descendants[u]
        if (before | after).bit_count() == n - 1 and not any(graph.succs[a] & after for a in indices(before)):
            cuts.append(u)
    return cuts


def single_channel_modules(graph: Graph, min_size: int = 4) -> list[list[int]]:
    """Consecutive runs of the topological order ending at cut units (see the module docstring)."""
    modules: list[list[int]] = []
    current: list[int] = []
    cuts = set(cut_units(graph))
    for u in range(len(graph)):
        current.append(u)
        if u in cuts:
            if modules and len(modules[-1]) < min_size:
                modules[-1].extend(current)
            else:
                modules.append(current)
            current = []
    if current:
        modules.append(current)
    if len(modules) > 1 and len(modules[-1]) < min_size:
        modules[-2].extend(modules.pop())
    return modules


def hub_graph(graph: Graph) -> nx.Graph:
    """The undirected graph of ``graph`` with a hub node ``("hub", u)`` for each value ``u`` read by several
    units (so a value crossing a boundary is one edge, as DiviML counts channels), unit capacities."""
    h = nx.Graph()
    h.add_nodes_from(range(len(graph)))
    for u in range(len(graph)):
        readers = list(indices(graph.succs[u]))
        if len(readers) == 1:
            h.add_edge(u, readers[0])
        elif readers:
            h.add_edges_from([(u, ("hub", u))] + [(("hub", u), v) for v in readers])
    nx.set_edge_attributes(h, 1, "capacity")
    return h


def connectivity_tree(graph: Graph, deadline: float | None = None) -> nx.Graph:
    """The Gomory-Hu tree of :func:`hub_graph`: the lightest edge on the tree's path between two nodes is how
    many edge-disjoint paths join them, so the k-edge-connected components for every k are what is left
    joined once the tree's edges under k are cut (:func:`edge_components`).

    One tree serves every channel count. networkx's ``k_edge_components`` builds a tree of its own for each k
    with a preflow-push cut per node: 5.7 s a k on a 300-unit DAG, where this tree took 0.33 s (measured on
    this 2-core machine; Edmonds-Karp suits these cuts: unit capacities, a few augmenting paths each). Raises
    :class:`OutOfTime` once ``deadline`` (``time.perf_counter()``) has passed, checked before each cut."""

    def cut(*args, **kwargs):
        if deadline is not None and time.perf_counter() > deadline:
            raise OutOfTime
        return nx.algorithms.flow.edmonds_karp(*args, **kwargs)

    return nx.gomory_hu_tree(hub_graph(graph), flow_func=cut)


def edge_components(tree: nx.Graph, k: int) -> dict[int, int]:
    """Each unit's k-edge-connected component, read off a :func:`connectivity_tree`; a component is numbered
    by its first unit (``_tidy`` breaks ties by number, which must not follow the order networkx happens to
    list components in: that order, hence the old modules, changed from run to run with Python's hashing)."""
    kept = nx.Graph()
    kept.add_nodes_from(tree)
    kept.add_edges_from((a, b) for a, b, w in tree.edges(data="weight") if w >= k)
    component = {}
    for nodes in nx.connected_components(kept):
        units = sorted(x for x in nodes if isinstance(x, int))
        component.update((u, units[0]) for u in units)
    return component


def edge_connected_modules(graph: Graph, channels: int, min_size: int = 4, tree: nx.Graph | None = None,
                           deadline: float | None = None) -> list[list[int]]:
    """Modules linked by at most ``channels`` values: k-edge-connected components, k = channels + 1, read off
    ``tree`` (default: the graph's :func:`connectivity_tree`). Raises :class:`OutOfTime` past ``deadline``."""
    tree = connectivity_tree(graph, deadline) if tree is None else tree
    return _tidy(graph, edge_components(tree, channels + 1), min_size, deadline)


def _tidy(graph: Graph, component: dict[int, int], min_size: int, deadline: float | None = None) -> list[list[int]]:
    """Join small components to their most-connected neighbour, then cycles of the module graph, and return
    the modules in topological order (units in graph order). Each join scans the edges (about 1 s of the 5.8 s
    decompose took on a 1000-unit DAG falling apart into single units): raises :class:`OutOfTime` past
    ``deadline``."""
    while True:
        if deadline is not None and time.perf_counter() > deadline:
            raise OutOfTime
        members: dict[int, list[int]] = {}
        for u, c in sorted(component.items()):
            members.setdefault(c, []).append(u)
        small = [c for c, us in members.items() if len(us) < min_size]
        if small and len(members) > 1:
            c = min(small, key=lambda c: (len(members[c]), min(members[c])))
            links: dict[int, int] = {}
            for a, b in graph.edges:
                if (component[a] == c) != (component[b] == c):
                    other = component[b] if component[a] == c else component[a]
                    links[other] = links.get(other, 0) + 1
            if links:
                target = max(links, key=lambda o: (links[o], -o))
            else:
                # linked to no other unit (isolated units): it adds no boundary wherever it goes, so it joins
                # the unit before it in graph order (stopping here left every other small component alone:
                # 286 modules, most of one unit, for a 300-unit DAG with 12 isolated units)
                first = min(members[c])
                target = component[first - 1 if first > 0 else min(u for u in component if component[u] != c)]
            for u in members[c]:
                component[u] = target
            continue
        quotient = nx.DiGraph()
        quotient.add_nodes_from(members)
        quotient.add_edges_from((component[a], component[b]) for a, b in graph.edges if component[a] != component[b])
        try:
            cycle = nx.find_cycle(quotient)
        except nx.NetworkXNoCycle:
            order = nx.lexicographical_topological_sort(quotient, key=lambda c: min(members[c]))
            return [sorted(members[c]) for c in order]
        target = cycle[0][0]
        for a, _ in cycle:
            for u in members[a]:
                component[u] = target


def frontier_modules(graph: Graph, channels: int, min_size: int = 4, max_module: int = 24) -> list[list[int]]:
    """Consecutive runs of the topological order cut where at most ``channels`` values are live (made before
    the cut, read after it): from each cut, the next is the position in the following ``min_size`` to
    ``max_module`` units with the fewest live values (the nearest among equals)."""
    n = len(graph)
    live = []
    for i in range(n):
        before = (1 << (i + 1)) - 1
        live.append(sum(1 for u in range(i + 1) if graph.succs[u] & ~before))
    modules, start = [], 0
    while n - start > max_module:
        window = range(start + min_size - 1, min(n - 1, start + max_module))
        cut = min(window, key=lambda i: (max(live[i], channels), i))
        modules.append(list(range(start, cut + 1)))
        start = cut + 1
    modules.append(list(range(start, n)))
    return modules


def crossing(graph: Graph, modules: list[list[int]]) -> list[int]:
    """For each boundary between consecutive modules, how many values cross it."""
    position = {u: t for t, units in enumerate(modules) for u in units}
    counts = []
    for t in range(len(modules) - 1):
        counts.append(sum(1 for u in range(len(graph)) if position[u] <= t
                          and any(position[v] > t for v in indices(graph.succs[u]))))
    return counts


def decompose(graph: Graph, channels: int | None = None, max_module: int = 24, min_size: int = 4,
              deadline: float | None = None) -> Decomposition:
    """The modules MILP-SPLIT solves one by one: the cut units when they give modules of at most
    ``max_module`` units (exact), else the edge-connected components for the fewest channels (2..4, or
    ``channels``) whose largest module has at most ``max_module`` units (else whichever decomposition has
    the smallest largest module). Past ``deadline`` (``time.perf_counter()``) the components are given up for
    cuts by live values, which take milliseconds (``out_of_time`` says so)."""
    single = single_channel_modules(graph, min_size)
    if channels == 1 or (channels is None and max(map(len, single)) <= max_module):
        return Decomposition(single, 1, True)
    best, best_by = single, "cut units"
    tree, out_of_time = None, False
    for c in ([channels] if channels else range(2, 5)):
        modules, by = None, "edge-connected components"
        if not out_of_time:
            try:
                tree = connectivity_tree(graph, deadline) if tree is None else tree
                modules = edge_connected_modules(graph, c, min_size, tree, deadline)
            except OutOfTime:
                out_of_time = True
        if modules is None or max(map(len, modules)) > max_module:
            # Sparse modules (ER(0.2) of 10 units has units of degree 1) are not k-edge-connected inside:
            # the components fall apart (or took too long); cut the topological order where few values are
            # live instead.
            modules, by = frontier_modules(graph, c, min_size, max_module), "live values"
        if max(map(len, modules)) < max(map(len, best)):
            best, best_by = modules, by
        if len(modules) > 1 and max(map(len, modules)) <= max_module and max(crossing(graph, modules)) <= c:
            break
    if len(best) == 1 or best_by == "cut units":  # the MILP itself, or cut units: exact
        return Decomposition(best, 1 if len(best) > 1 else 0, True, best_by, out_of_time)
    return Decomposition(best, max(crossing(graph, best)), False, best_by, out_of_time)
