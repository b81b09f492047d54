import networkx as nx
import pytest
from conftest import random_dag

from opsched.graph.blocks import cut_units, split_blocks
from opsched.graph.ir import Graph, Node
from opsched.models.synthetic import independent_chains, random_layered_dag


def brute_force_cuts(g: Graph) -> list[int]:
    """Units whose removal leaves no path from any source to any sink."""
    cuts = []
    for u in range(len(g)):
        h = g.to_networkx()
        h.add_edges_from(("S", s) for s in g.sources)
        h.add_edges_from((t, "T") for t in g.sinks)
        h.remove_node(u)
        if not nx.has_path(h, "S", "T"):
            cuts.append(u)
    return cuts


@pytest.mark.parametrize("seed", range(40))
def test_cut_units_match_brute_force(seed):
    g = random_dag(9, 0.35, seed)
    assert cut_units(g) == brute_force_cuts(g)


def check_blocks(g, blocks, max_size):
    seen = [u for b in blocks for u in b.units]
    assert seen == list(range(len(g)))  # a partition, consecutive in topological order
    cuts = set(cut_units(g))
    for b in blocks:
        assert not max_size or len(b) <= max_size
        if b.exit is not None:
            assert b.exit == b.units[-1] and b.exit in cuts


@pytest.mark.parametrize("seed", range(20))
def test_split_blocks_is_a_partition_ending_at_cuts(seed):
    g = random_layered_dag(30, 8, 0.3, seed)
    for max_size in (0, 4, 7, 50):
        check_blocks(g, split_blocks(g, max_size), max_size)


def test_block_owns_its_exit_and_oversized_blocks_are_cut_into_parts():
    nodes = [Node("in")] + [Node(f"b{i}", args=("in",)) for i in range(6)]
    nodes.append(Node("out", args=tuple(f"b{i}" for i in range(6))))
    g = Graph(nodes)
    blocks = split_blocks(g, max_size=0)
    assert [len(b) for b in blocks] == [1, 7]
    assert g.nodes[blocks[1].exit].name == "out"
    parts = split_blocks(g, max_size=3)
    assert [len(b) for b in parts] == [1, 3, 2, 2]
    assert [(b.part, b.parts) for b in parts[1:]] == [(0, 3), (1, 3), (2, 3)]
    assert parts[1].exit is None and parts[3].exit == blocks[1].exit


def test_no_split_keeps_one_block_and_disconnected_graphs_have_no_cuts():
    g = independent_chains(3, 4)
    assert cut_units(g) == []
    assert [len(b) for b in split_blocks(g)] == [12]
    chain = independent_chains(1, 5)
    assert [len(b) for b in split_blocks(chain)] == [1] * 5
    assert [len(b) for b in split_blocks(chain, at_cuts=False)] == [5]
    with pytest.raises(ValueError):
        split_blocks(chain, -1)
