import itertools
import math
from functools import cache

import networkx as nx
import pytest
from conftest import random_dag
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.models.synthetic import independent_chains, random_layered_dag, randwire_stage
from opsched.schedule import validate
from opsched.schedulers import SCHEDULERS, make_schedule
from opsched.schedulers.ios import ios
from opsched.schedulers.lios import lios_streams
from opsched.schedulers.nimble import nimble_chains


def brute_force(g: Graph, capacity=0.0, sync=0.0, r=0, s=0):
    """Optimum over all staged schedules, by testing every subset of every state as its last stage.
    Returns (latency, states visited, transitions) under the pruning (r, s; 0 = none)."""
    n = len(g)
    und = nx.Graph()
    und.add_nodes_from(range(n))
    und.add_edges_from(g.edges)
    lat = [nd.latency for nd in g.nodes]
    visited = set()
    transitions = 0

    def stage(mask):
        units = [i for i in range(n) if mask >> i & 1]
        groups = list(nx.connected_components(und.subgraph(units)))
        return groups, max(max(sum(lat[u] for u in grp) for grp in groups),
                           sum(lat[u] for u in units) / capacity if capacity else 0) + sync * (len(groups) - 1)

    @cache
    def best(state):
        nonlocal transitions
        if not state:
            return 0.0
        visited.add(state)
        result = math.inf
        sub = state
        while sub:
            is_ending = all(not (g.succs[u] & (state & ~sub)) for u in range(n) if sub >> u & 1)
            if is_ending:
                groups, latency = stage(sub)
                if (not s or len(groups) <= s) and (not r or max(len(grp) for grp in groups) <= r):
                    transitions += 1
                    result = min(result, best(state & ~sub) + latency)
            sub = (sub - 1) & state
        return result

    value = best(g.all_mask)
    return value, len(visited), transitions


@pytest.mark.parametrize("seed", range(25))
def test_unpruned_ios_equals_brute_force_optimum(seed):
    n = 6 + seed % 7  # 6..12 units
    g = random_dag(n, 0.25 + 0.02 * (seed % 5), seed)
    capacity, sync = [(0, 0), (2, 0), (0, 0.5), (3, 1.0)][seed % 4]
    cost = TableCost(g, capacity=capacity, sync_overhead=sync)
    schedule = ios(g, cost, max_group_size=0, max_groups=0, split=False)
    expected, states, transitions = brute_force(g, capacity, sync)
    assert schedule.predicted_latency == pytest.approx(expected)
    assert schedule.stats["states"] == states and schedule.stats["transitions"] == transitions
    validate(schedule, g)


@pytest.mark.parametrize("seed", range(12))
def test_pruned_ios_visits_exactly_the_pruned_space(seed):
    g = random_dag(9, 0.3, seed)
    r, s = [(1, 2), (2, 2), (3, 8), (2, 1)][seed % 4]
    schedule = ios(g, TableCost(g), max_group_size=r, max_groups=s, split=False)
    expected, states, transitions = brute_force(g, r=r, s=s)
    assert schedule.predicted_latency == pytest.approx(expected)
    assert (schedule.stats["states"], schedule.stats["transitions"]) == (states, transitions)
    for stage in schedule.stages:
        assert len(stage.groups) <= s and all(len(grp) <= r for grp in stage.groups)


@pytest.mark.parametrize("d,c", [(1, 1), (1, 5), (2, 3), (3, 2), (3, 4), (4, 3)])
def test_transitions_on_independent_chains(d, c):
    g = independent_chains(d, c)
    s = ios(g, TableCost(g), max_group_size=0, max_groups=0, split=False)
    assert s.stats["transitions"] == math.comb(c + 2, 2) ** d - (c + 1) ** d
    assert s.stats["states"] == (c + 1) ** d - 1
    assert s.predicted_latency == c


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 11), p=st.floats(0.05, 0.7), seed=st.integers(0, 10**6),
       capacity=st.sampled_from([0, 1, 2, 4]), sync=st.sampled_from([0.0, 0.3, 2.0]))
def test_ios_is_never_worse_than_sequential_or_greedy(n, p, seed, capacity, sync):
    g = random_dag(n, p, seed)
    cost = TableCost(g, capacity=capacity, sync_overhead=sync)
    best = ios(g, cost, max_group_size=0, max_groups=0, split=False).predicted_latency
    assert best <= make_schedule("sequential", g, cost).predicted_latency + 1e-9
    assert best <= make_schedule("greedy", g, cost).predicted_latency + 1e-9
    pruned = ios(g, cost).predicted_latency  # default r=3, s=8, block by block
    assert pruned <= make_schedule("sequential", g, cost).predicted_latency + 1e-9


OPTIONS = {"sequential": {}, "greedy": {"max_streams": 2}, "lios": {"streams": 3}, "nimble": {"streams": 2},
           "ios": {}, "exact": {"streams": 2, "time_limit": 10}, "hivemind": {"streams": 2}}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 14), p=st.floats(0.0, 0.6), seed=st.integers(0, 10**6),
       method=st.sampled_from(sorted(SCHEDULERS)), sync=st.sampled_from([0.0, 0.5]))
def test_every_scheduler_returns_a_valid_schedule(n, p, seed, method, sync):
    g = random_dag(n, p, seed)
    cost = TableCost(g, sync_overhead=sync)
    schedule = make_schedule(method, g, cost, **OPTIONS[method])
    validate(schedule, g)
    assert schedule.predicted_latency >= schedule.bounds["lower_bound"] - 1e-9
    assert schedule.predicted_latency == pytest.approx(max(o.finish for o in schedule.ops)) or method == "ios"


def lios_paper_graph() -> Graph:
    """LIOS Fig. 3: 10 operators, 12 edges, sequential latency 73."""
    lat = {1: 3, 2: 5, 3: 5, 4: 5, 5: 8, 6: 15, 7: 10, 8: 7, 9: 13, 10: 2}
    preds = {2: [1], 3: [1], 4: [1], 5: [1], 6: [2, 3], 7: [4], 8: [5], 9: [6, 7, 8], 10: [9]}
    return Graph([Node(f"v{i}", args=tuple(f"v{j}" for j in preds.get(i, [])), latency=lat[i]) for i in range(1, 11)])


def test_lios_reproduces_the_papers_worked_example():
    g = lios_paper_graph()
    cost = TableCost(g)
    assert make_schedule("sequential", g, cost).predicted_latency == 73
    s = make_schedule("lios", g, cost, streams=3)
    assert s.predicted_latency == 38
    placed = {o.name: (o.stream + 1, o.start, o.finish) for o in s.ops}
    assert placed == {"v1": (1, 0, 3), "v5": (1, 3, 11), "v8": (1, 11, 18), "v2": (2, 3, 8), "v3": (3, 3, 8),
                      "v6": (2, 8, 23), "v4": (3, 8, 13), "v7": (3, 13, 23), "v9": (1, 23, 36), "v10": (1, 36, 38)}
    assert lios_streams(g, cost, 3) == [[0, 4, 7, 8, 9], [1, 5], [2, 3, 6]]


def test_nimble_streams_are_chains_of_the_transitive_reduction():
    for seed in range(10):
        g = random_layered_dag(25, 6, 0.3, seed)
        reduced = nx.transitive_reduction(g.to_networkx())
        chains = nimble_chains(g)
        assert sorted(u for c in chains for u in c) == list(range(len(g)))
        for chain in chains:
            assert all(reduced.has_edge(a, b) for a, b in itertools.pairwise(chain))
        assert len(chains) >= g.width  # a path cover never has fewer chains than the width
    assert nimble_chains(independent_chains(3, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_exact_is_optimal_and_beats_or_ties_lios():
    g = lios_paper_graph()
    cost = TableCost(g)
    s = make_schedule("exact", g, cost, streams=3, time_limit=20)
    assert s.stats["status"] == "OPTIMAL" and s.stats["optimal"]
    assert s.predicted_latency == pytest.approx(38)  # the critical path v1 v2 v6 v9 v10 is 38
    assert s.bounds["critical_path"] == 38
    h = randwire_stage(12, "ws", seed=3)
    c = TableCost(h)
    assert make_schedule("exact", h, c, streams=2).predicted_latency <= make_schedule("lios", h, c, streams=2).predicted_latency + 1e-9


def test_exact_claims_optimality_only_for_the_latency_it_proved():
    from opsched.cost.simulate import SimulatedGPU
    from opsched.models import load_model

    m = load_model("squeezenet", image_size=32)
    g = capture(m.model.eval(), m.inputs)
    # (proven in 2-4 s here, once in over 10 s: the limit only stops a solver that cannot prove)
    s = make_schedule("exact", g, SimulatedGPU(g, "sim:v100"), streams=2, time_limit=60)
    # CP-SAT proved its own timeline optimal, but the simulated GPU prices streams sharing SMs, which that
    # timeline does not model: the schedule's latency is another figure, and nothing was proven for it
    assert s.stats["status"] == "OPTIMAL" and s.predicted_latency > s.stats["solver_makespan"] + 1e-3
    assert s.stats["optimal"] is False


def test_exact_with_sync_overhead_waits_only_across_streams():
    g = Graph([Node("a", latency=1), Node("b", args=("a",), latency=1), Node("c", args=("a",), latency=1)])
    s = make_schedule("exact", g, TableCost(g, sync_overhead=5), streams=2)
    assert s.predicted_latency == 3  # all on one stream beats paying the 5-unit wait


def test_ios_with_more_stages_splits_blocks_and_stays_valid():
    g = randwire_stage(32, "ws", seed=1)
    s = make_schedule("ios", g, TableCost(g), max_group_size=2, max_groups=4)
    validate(s, g)
    assert s.stats["transitions"] > 0 and s.bounds["lower_bound"] <= s.predicted_latency


# up to 12 units: the unbudgeted search of 14 units without an edge makes 4.7 million transitions (1.5 s), and
# the draws that hit it took this test from 1.4 s to 22 s of the suite; every budget here is below a 10-unit one's
@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 12), p=st.floats(0.0, 0.5), seed=st.integers(0, 10_000),
       budget=st.integers(1, 400))
def test_ios_halves_a_block_over_its_transitions_and_stays_valid(n, p, seed, budget):
    # a part of 16 models fused side by side did not finish its search in 15 minutes: a block over budget is
    # searched as its halves, which can only give up overlap, never claim better than the whole block's optimum
    g = random_dag(n, p, seed)
    cost = TableCost(g, capacity=2.0)
    whole = ios(g, cost, split=False, max_transitions=0)
    budgeted = ios(g, cost, split=False, max_transitions=budget)
    validate(budgeted, g)
    assert budgeted.predicted_latency >= whole.predicted_latency - 1e-9
    if budgeted.stats["halved"] == 0:
        assert budgeted.stats["transitions"] == whole.stats["transitions"] <= budget
        assert budgeted.predicted_latency == pytest.approx(whole.predicted_latency)
    else:
        assert whole.stats["transitions"] > budget


def test_bad_options():
    g = independent_chains(1, 2)
    with pytest.raises(ValueError):
        ios(g, TableCost(g), max_group_size=-1)
    with pytest.raises(ValueError):
        ios(g, TableCost(g), max_transitions=-1)
    with pytest.raises(ValueError):
        lios_streams(g, TableCost(g), streams=0)
    from opsched.errors import OpschedError
    with pytest.raises(OpschedError, match="unknown method"):
        make_schedule("magic", g, TableCost(g))
    with pytest.raises(OpschedError, match="capacity"):
        TableCost(g, capacity=0.5)
    with pytest.raises(OpschedError, match="latency"):
        TableCost(Graph([Node("a")]))


def test_the_lower_bound_holds_for_schedules_with_merges_priced_below_their_longest_unit():
    from opsched.graph.ir import Graph as G

    conv = {"kernel": (1, 1), "stride": (1, 1), "padding": (0, 0)}
    g = G([Node("a", kind="conv", args=("x",), attrs=conv, latency=4.0),
           Node("b", kind="conv", args=("x",), attrs=conv, latency=4.0),
           Node("c", args=("a", "b"), latency=1.0)], inputs=["x"])

    class CheapMerges(TableCost):
        def merge_latency(self, units):
            return 3.0  # the merged convolution runs faster than either alone

    cost = CheapMerges(g)
    s = make_schedule("ios", g, cost)
    assert any(st.strategy == "merge" for st in s.stages) and s.predicted_latency == pytest.approx(4.0)
    assert s.bounds["lower_bound"] <= s.predicted_latency  # was 5 (4 + 1) against a 4 schedule
