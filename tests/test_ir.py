import itertools

import networkx as nx
import pytest
from conftest import random_dag
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.errors import GraphError
from opsched.graph.ir import Graph, Node, bit, can_merge, indices, mask_of


def test_mask_helpers():
    assert mask_of([0, 3, 5]) == 0b101001
    assert list(indices(0b101001)) == [0, 3, 5]
    assert bit(4) == 16
    assert list(indices(0)) == []


def test_order_is_topological_and_keeps_a_valid_listing():
    g = Graph([Node("b", args=("a",)), Node("a"), Node("c")])
    assert [n.name for n in g.nodes] == ["a", "b", "c"]
    g2 = Graph([Node("a"), Node("c"), Node("b", args=("a",))])
    assert [n.name for n in g2.nodes] == ["a", "c", "b"]


def test_bad_graphs_raise_graph_error():
    with pytest.raises(GraphError, match="duplicate unit name 'a'"):
        Graph([Node("a"), Node("a")])
    with pytest.raises(GraphError, match="reads 'zz'"):
        Graph([Node("a", args=("zz",))])
    with pytest.raises(GraphError, match="cycle: .*a.*b|cycle: .*b.*a"):
        Graph([Node("a", args=("b",)), Node("b", args=("a",))])
    with pytest.raises(GraphError, match="output 'q'"):
        Graph([Node("a")], outputs=["q"])


def test_masks_and_closure_match_networkx():
    for seed in range(20):
        g = random_dag(12, 0.3, seed)
        nxg = g.to_networkx()
        for i in range(len(g)):
            assert set(indices(g.preds[i])) == set(nxg.predecessors(i))
            assert set(indices(g.succs[i])) == set(nxg.successors(i))
            assert set(indices(g.ancestors[i])) == nx.ancestors(nxg, i)
            assert set(indices(g.descendants[i])) == nx.descendants(nxg, i)
        for a, b in g.edges:
            assert a < b
        assert g.sources == [i for i in range(len(g)) if nxg.in_degree(i) == 0]
        assert g.sinks == [i for i in range(len(g)) if nxg.out_degree(i) == 0]


def brute_force_width(g: Graph) -> int:
    n = len(g)
    for size in range(n, 0, -1):
        for combo in itertools.combinations(range(n), size):
            if all(not (g.descendants[a] >> b & 1) and not (g.descendants[b] >> a & 1)
                   for a, b in itertools.combinations(combo, 2)):
                return size
    return 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), p=st.floats(0.0, 0.9), seed=st.integers(0, 10**6))
def test_width_matches_brute_force(n, p, seed):
    g = random_dag(n, p, seed)
    assert g.width == brute_force_width(g)


def test_width_of_induced_subgraph_uses_paths_inside_it():
    # a -> b -> c with a -> c: inside {a, c} a still reaches c directly.
    g = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("b",))])
    assert g.width_of(mask_of([0, 2])) == 2  # no path a -> c inside {a, c}
    assert g.width_of(g.all_mask) == 1
    assert g.width_of(0) == 0


def test_single_source_and_sink():
    g = Graph([Node("a"), Node("b", args=("a",)), Node("c", args=("a",))])
    assert g.is_single_source() and not g.is_single_sink()
    assert g.outputs == ("b", "c")


def test_fingerprint_changes_with_edges():
    a = Graph([Node("a", latency=1.0), Node("b", latency=1.0)])
    b = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=1.0)])
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == Graph([Node("a", latency=1.0), Node("b", latency=1.0)]).fingerprint


def conv(name, k, p, args=("x",), **extra):
    attrs = {"kernel": (k, k), "stride": (1, 1), "padding": (p, p), "dilation": (1, 1), "groups": 1,
             "post": ("batch_norm", "relu")}
    attrs.update(extra)
    return Node(name, kind="conv", args=args, dtype="float32", attrs=attrs)


def test_can_merge_follows_the_ios_rules():
    assert can_merge([conv("a", 1, 0), conv("b", 3, 1), conv("c", 5, 2)])
    assert not can_merge([conv("a", 1, 0)])
    assert not can_merge([conv("a", 1, 0), conv("b", 3, 1, args=("y",))])  # different input
    assert not can_merge([conv("a", 1, 0), conv("b", 3, 0)])  # padding would change the output
    assert not can_merge([conv("a", 1, 0), conv("b", 3, 1, stride=(2, 2))])
    assert not can_merge([conv("a", 1, 0), conv("b", 3, 1, groups=2)])
    assert not can_merge([conv("a", 1, 0), conv("b", 3, 1, post=("batch_norm",))])  # activation differs
    assert not can_merge([conv("a", 2, 0), conv("b", 3, 1)])  # even kernel cannot be centred
    assert can_merge([conv("a", 1, 0, post=("relu",)), conv("b", 3, 1)])  # batch norm folds away
    pool = Node("p", kind="pool", args=("x",), attrs={})
    assert not can_merge([conv("a", 1, 0), pool])
