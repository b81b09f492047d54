"""The graph of schedule units that every scheduler works on.

A :class:`Graph` is a DAG of :class:`Node` s, each a *schedule unit*: one heavy operator (convolution,
matmul, pooling, concatenation) with the light single-consumer operators around it. Units are kept in a
topological order and addressed by index, so that a set of units is a Python ``int`` bitmask: bit ``i``
stands for ``graph.nodes[i]``. Schedulers work on those masks; the helpers here compute them once.

Example:

>>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=2.0),
...            Node("c", args=("a",), latency=2.0), Node("d", args=("b", "c"), latency=1.0)])
>>> [n.name for n in g.nodes], g.width
(['a', 'b', 'c', 'd'], 2)
>>> sorted(indices(g.descendants[0]))
[1, 2, 3]
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from opsched.errors import GraphError


def bit(i: int) -> int:
    """The mask holding only unit ``i``."""
    return 1 << i


def mask_of(idx: Iterable[int]) -> int:
    """The mask holding the given unit indices."""
    m = 0
    for i in idx:
        m |= 1 << i
    return m


def indices(mask: int) -> Iterator[int]:
    """The unit indices in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass(eq=False)
class Node:
    """One schedule unit.

    ``args`` are the unit's data inputs in call order: names of other units or of graph inputs.
    ``attrs`` holds the hyper-parameters that decide whether units can be merged (see :func:`can_merge`).
    ``run`` executes the unit: called with the tensors named by ``args``, it returns the unit's output.
    ``latency`` is set for graphs read from DAG JSON, where no operator is known.
    """

    name: str
    kind: str = "op"
    args: tuple[str, ...] = ()
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    attrs: Mapping[str, Any] = field(default_factory=dict)
    ops: tuple[str, ...] = ()
    latency: float | None = None
    run: Callable[..., Any] | None = field(default=None, repr=False)


class Graph:
    """A DAG of schedule units, stored in a topological order.

    ``inputs`` names the graph's inputs (tensors fed by the caller); ``outputs`` names the units (or
    inputs) whose values the graph returns, in order. ``out_spec`` (a torch pytree spec, optional) rebuilds
    the model's output structure from that flat list.
    """

    def __init__(self, nodes: Sequence[Node], inputs: Sequence[str] = (), outputs: Sequence[str] | None = None,
                 name: str = "graph", out_spec: Any = None):
        self.name = name
        self.inputs = tuple(inputs)
        self.out_spec = out_spec
        by_name: dict[str, Node] = {}
        for node in nodes:
            if node.name in by_name or node.name in self.inputs:
                raise GraphError(f"duplicate unit name {node.name!r}")
            by_name[node.name] = node
        input_set = set(self.inputs)
        for node in nodes:
            for a in node.args:
                if a not in by_name and a not in input_set:
                    raise GraphError(f"unit {node.name!r} reads {a!r}, which is neither a unit nor a graph input")
        self.nodes: tuple[Node, ...] = tuple(_topological(nodes, by_name))
        self.index: dict[str, int] = {n.name: i for i, n in enumerate(self.nodes)}
        n = len(self.nodes)
        preds = [0] * n
        succs = [0] * n
        for i, node in enumerate(self.nodes):
            for a in node.args:
                j = self.index.get(a)
                if j is not None:
                    preds[i] |= 1 << j
                    succs[j] |= 1 << i
        self.preds: tuple[int, ...] = tuple(preds)
        self.succs: tuple[int, ...] = tuple(succs)
        if outputs is None:
            outputs = [nd.name for i, nd in enumerate(self.nodes) if not succs[i]]
        for o in outputs:
            if o not in self.index and o not in input_set:
                raise GraphError(f"graph output {o!r} is neither a unit nor a graph input")
        self.outputs = tuple(outputs)

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, units={len(self.nodes)}, edges={len(self.edges)})"

    @property
    def all_mask(self) -> int:
        return (1 << len(self.nodes)) - 1

    @cached_property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Unit-to-unit edges as index pairs (duplicates from repeated arguments removed)."""
        return tuple((j, i) for i in range(len(self.nodes)) for j in indices(self.preds[i]))

    @cached_property
    def ancestors(self) -> tuple[int, ...]:
        """For each unit, the mask of units with a path to it (the transitive closure, backwards)."""
        anc = [0] * len(self.nodes)
        for i, p in enumerate(self.preds):
            m = p
            for j in indices(p):
                m |= anc[j]
            anc[i] = m
        return tuple(anc)

    @cached_property
    def descendants(self) -> tuple[int, ...]:
        """For each unit, the mask of units reachable from it."""
        desc = [0] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            m = self.succs[i]
            for j in indices(self.succs[i]):
                m |= desc[j]
            desc[i] = m
        return tuple(desc)

    @property
    def sources(self) -> list[int]:
        return [i for i, p in enumerate(self.preds) if not p]

    @property
    def sinks(self) -> list[int]:
        return [i for i, s in enumerate(self.succs) if not s]

    def is_single_source(self) -> bool:
        return len(self.sources) == 1

    def is_single_sink(self) -> bool:
        return len(self.sinks) == 1

    @cached_property
    def width(self) -> int:
        """The largest number of units no two of which are connected by a path (Dilworth)."""
        return self.width_of(self.all_mask)

    def width_of(self, mask: int) -> int:
        """Width of the subgraph induced by ``mask``.

        By Dilworth's theorem the largest antichain equals the smallest chain cover, which is the number
        of units minus a maximum matching in the bipartite graph (u -> v whenever v is reachable from u
        inside the subgraph).
        """
        members = list(indices(mask))
        if not members:
            return 0
        reach = self._reach_within(mask)
        b = nx.DiGraph()
        left = [("out", i) for i in members]
        b.add_nodes_from(left)
        b.add_nodes_from(("in", i) for i in members)
        for i in members:
            b.add_edges_from((("out", i), ("in", j)) for j in indices(reach[i]))
        matching = nx.bipartite.hopcroft_karp_matching(b.to_undirected(as_view=True), top_nodes=left)
        return len(members) - len(matching) // 2

    def _reach_within(self, mask: int) -> dict[int, int]:
        """For each unit in ``mask``, the units of ``mask`` reachable from it along paths inside ``mask``."""
        reach: dict[int, int] = {}
        for i in reversed(list(indices(mask))):
            m = self.succs[i] & mask
            for j in indices(m):
                m |= reach[j]
            reach[i] = m
        return reach

    def to_networkx(self) -> nx.DiGraph:
        """The unit graph as a networkx DiGraph on unit indices, each node carrying its :class:`Node`."""
        g = nx.DiGraph()
        g.add_nodes_from((i, {"node": n}) for i, n in enumerate(self.nodes))
        g.add_edges_from(self.edges)
        return g

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the units' names, kinds, shapes and edges: a schedule is valid only for this value."""
        payload = [[n.name, n.kind, list(n.shape) if n.shape else None, list(n.args), n.latency]
                   for n in self.nodes]
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)


def _topological(nodes: Sequence[Node], by_name: Mapping[str, Node]) -> list[Node]:
    """Kahn's algorithm, taking the lowest original position first so a valid order is kept as given."""
    position = {n.name: i for i, n in enumerate(nodes)}
    indegree = {n.name: 0 for n in nodes}
    users: dict[str, list[str]] = {n.name: [] for n in nodes}
    for n in nodes:
        for a in set(n.args):
            if a in by_name:
                indegree[n.name] += 1
                users[a].append(n.name)
    heap = [position[name] for name, d in indegree.items() if d == 0]
    heapq.heapify(heap)
    order: list[Node] = []
    while heap:
        node = nodes[heapq.heappop(heap)]
        order.append(node)
        for u in users[node.name]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(heap, position[u])
    if len(order) != len(nodes):
        g = nx.DiGraph((a, n.name) for n in nodes for a in n.args if a in by_name)
        cycle = [u for u, _ in nx.find_cycle(g)]
        raise GraphError("the graph has a cycle: " + " -> ".join(cycle + cycle[:1]))
    return order


# Light operators that may sit between a convolution and its consumers without changing which
# units can be merged: batch norm is folded into the merged convolution's weights first.
_FOLDABLE = {"batch_norm", "_native_batch_norm_legit_no_training", "getitem", "dropout", "identity"}


def activation_of(node: Node) -> tuple[tuple[str, str], ...]:
    """The operators after a unit's heavy op that a merged unit must apply identically, each with its
    constant arguments (an upsampling by 2 is not an upsampling by 4)."""
    post = node.attrs.get("post", ())
    args = node.attrs.get("post_args", ("",) * len(post))
    return tuple((op, a) for op, a in zip(post, args) if op not in _FOLDABLE)


def can_merge(nodes: Sequence[Node]) -> bool:
    """Whether the units can run as one convolution stacked along output channels (IOS operator merge).

    They must be plain convolutions (groups 1, dilation 1, not transposed) reading the same input
    through the same operators, with the same stride, dtype and activation, and paddings that keep
    each output when its kernel is zero-padded and centred in the largest kernel.

    >>> a = Node("a", kind="conv", args=("x",), attrs={"kernel": (1, 1), "stride": (1, 1), "padding": (0, 0)})
    >>> b = Node("b", kind="conv", args=("x",), attrs={"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1)})
    >>> can_merge([a, b])
    True
    """
    if len(nodes) < 2:
        return False
    first = nodes[0]
    for n in nodes:
        a = n.attrs
        if (n.kind != "conv" or a.get("groups", 1) != 1 or a.get("transposed", False)
                or any(d != 1 for d in a.get("dilation", (1,))) or "kernel" not in a):
            return False
        if (n.args != first.args or n.dtype != first.dtype or a.get("pre", ()) != first.attrs.get("pre", ())
                or a.get("pre_args", ()) != first.attrs.get("pre_args", ())
                or tuple(a["stride"]) != tuple(first.attrs["stride"]) or activation_of(n) != activation_of(first)
                or len(a["kernel"]) != len(first.attrs["kernel"])):
            return False
    # A kernel k with padding p, centred in a kernel K with padding P = p + (K - k) / 2, gives the same
    # output, so every unit must agree on k - 2p and K - k must be even.
    for d in range(len(first.attrs["kernel"])):
        ks = [n.attrs["kernel"][d] for n in nodes]
        ps = [n.attrs["padding"][d] for n in nodes]
        if len({k - 2 * p for k, p in zip(ks, ps)}) != 1 or len({k % 2 for k in ks}) != 1:
            return False
    return True


def components(graph: Graph, mask: int) -> list[list[int]]:
    """Connected components (edges taken both ways) of the subgraph ``mask`` induces, each as unit indices
    in topological order, ordered by their first unit: the *groups* of an IOS stage.

    >>> g = Graph([Node("a"), Node("b", args=("a",)), Node("c")])
    >>> components(g, g.all_mask)
    [[0, 1], [2]]
    """
    groups = []
    left = mask
    while left:
        low = left & -left
        comp = frontier = low
        while frontier:
            reach = 0
            for u in indices(frontier):
                reach |= graph.preds[u] | graph.succs[u]
            frontier = reach & left & ~comp
            comp |= frontier
        groups.append(list(indices(comp)))
        left &= ~comp
    return groups
