"""Cutting a graph into MILP-SPLIT's modules (``mapping/modules.py``): the edge-connected components against
networkx's, units linked to nothing, the same modules whatever Python's hashing, the deadline, and MILP-SPLIT
within ``--time-limit`` on a large multi-channel graph."""

import os
import random
import subprocess
import sys
import time

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.graph.ir import Graph, Node
from opsched.mapping.modules import connectivity_tree, decompose, edge_components, edge_connected_modules, hub_graph
from opsched.mapping.platform import platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.solve import solve


def _sparse_dag(units: int, seed: int, isolated: tuple[int, ...] = ()) -> Graph:
    """Each unit reads some of the six before it (the reliability suite's large DAGs); ``isolated`` units read
    nothing and nothing reads them."""
    rng = random.Random(seed)
    nodes = []
    for i in range(units):
        args = [] if i in isolated else [f"v{j}" for j in range(max(0, i - 6), i)
                                         if j not in isolated and rng.random() < 0.3]
        nodes.append(Node(f"v{i}", args=tuple(args)))
    return Graph(nodes)


def _problem(graph: Graph, seed: int = 1):
    rng = random.Random(seed)
    devices = ("a", "b", "c")
    latencies = {n.name: {d: float(rng.randint(1, 20)) for d in devices} for n in graph.nodes}
    platform = platform_from_dict({"devices": [{"name": d} for d in devices],
                                   "links": {"default": {"bandwidth": 1, "latency": 1}}})
    return build_problem(graph, platform, device_latencies=latencies,
                         edge_bytes={e: float(rng.randint(0, 10)) for e in graph.edges})


def _in_topological_order(graph: Graph, modules: list[list[int]]) -> bool:
    position = {u: t for t, units in enumerate(modules) for u in units}
    return sorted(position) == list(range(len(graph))) and all(position[a] <= position[b] for a, b in graph.edges)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.integers(5, 60))
def test_edge_components_from_one_tree_are_networkx_k_edge_components(seed, units):
    graph = _sparse_dag(units, seed)
    tree = connectivity_tree(graph)
    for k in (3, 4, 5):
        expected = sorted(sorted(x for x in c if isinstance(x, int)) for c in nx.k_edge_components(hub_graph(graph), k))
        found: dict[int, list[int]] = {}
        for u, c in edge_components(tree, k).items():
            found.setdefault(c, []).append(u)
        assert sorted(found.values()) == [c for c in expected if c], (seed, units, k)


def test_a_unit_linked_to_nothing_does_not_stop_small_components_joining():
    # v0 reads nothing and nothing reads it: it was the first small component tried, had no neighbour to join,
    # and ended the joining, every other small component left as it was (286 modules for 300 units)
    graph = _sparse_dag(120, seed=4, isolated=(0, 50))
    for channels in (2, 3, 4):
        modules = edge_connected_modules(graph, channels)
        assert min(map(len, modules)) >= 4, (channels, sorted(map(len, modules)))
        assert _in_topological_order(graph, modules)


def test_modules_do_not_depend_on_python_hashing():
    # the hub nodes are ("hub", u) tuples, whose hash changes from run to run: the old modules did with it
    script = ("from opsched.mapping.modules import decompose; from opsched.mapping.workloads import randwire_stack; "
              "print([decompose(randwire_stack(m, 10, 'er', links=2, seed=1)).modules for m in (5, 10)])")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(outputs) == 1


def test_past_its_deadline_decompose_cuts_by_live_values_and_says_so():
    graph = _sparse_dag(300, seed=1)
    started = time.perf_counter()
    parts = decompose(graph, deadline=started)
    assert time.perf_counter() - started < 1.0
    assert parts.out_of_time and parts.cut_by == "live values" and not parts.single_channel
    assert max(map(len, parts.modules)) <= 24 and _in_topological_order(graph, parts.modules)
    on_time = decompose(graph)
    assert not on_time.out_of_time and _in_topological_order(graph, on_time.modules)


def test_milp_split_holds_a_small_time_limit_on_a_large_multi_channel_graph():
    # 300 units, no cut unit: cutting it into modules took 17 s (networkx's k_edge_components for 2, 3 and 4
    # channels), outside the limit; now within it, and the modules' solves within what is left
    problem = _problem(_sparse_dag(300, seed=1, isolated=(14, 120, 200)))
    found = solve(problem, "milp-split", time_limit=1.0, bound=False)
    assert found.seconds < 1.0 + 0.6, found.seconds
    assert not found.stats["single_channel"] and found.stats["modules"] > 1
    assert found.stats["cut_by"] in ("edge-connected components", "live values")
