"""Several nodes: intra- and inter-node links, symmetry breaking (no optimum lost, the hint permuted to fit,
the search space reduction), the placement search of the list heuristics against brute force, the GPT
decode workloads (the real small model captured, mapped and run against eager; GPT-3's units), the
per-node baseline and MILP-SPLIT when memory binds."""

import itertools
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.graph.ir import Graph, Node
from opsched.mapping import MappingError
from opsched.mapping.bound import Prepared, work_bound
from opsched.mapping.common import Memory, best_placement, duration
from opsched.mapping.milp import milp
from opsched.mapping.pernode import per_node
from opsched.mapping.plan import Job, Mapping, check
from opsched.mapping.platform import load_platform, platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.solve import solve
from opsched.mapping.split import milp_split
from opsched.mapping.symmetry import SYMMETRIES, amount_of, balanced, canonical, orbits


def _two_nodes(memory: float | None = None) -> dict:
    extra = {"memory": memory} if memory else {}
    return {"devices": [{"name": f"n{n}.{kind}{k}", "node": f"n{n}", "scale": scale, **extra}
                        for n in range(2) for kind, scale in (("fast", 1), ("slow", 2)) for k in range(2)],
            "links": {"intra-node": {"bandwidth": 4, "latency": 0.1}, "inter-node": {"bandwidth": 1, "latency": 1}}}


def test_links_by_node_and_the_named_link_first():
    doc = _two_nodes()
    doc["links"]["n0.fast0-n1.fast0"] = {"bandwidth": 8, "latency": 0}
    p = platform_from_dict(doc)
    i = p.index
    assert p.transfer_time(i("n0.fast0"), i("n0.slow1"), 4) == pytest.approx(1.1)    # intra-node
    assert p.transfer_time(i("n0.fast1"), i("n1.slow0"), 4) == pytest.approx(5.0)    # inter-node
    assert p.transfer_time(i("n0.fast0"), i("n1.fast0"), 4) == pytest.approx(0.5)    # its own link


def test_symmetry_orbits_and_what_breaks_them():
    p = platform_from_dict(_two_nodes())
    s = p.symmetry()
    assert sorted(map(sorted, s.device_orbits)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.node_orbits == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert s.factor == 2 ** 4 * 2  # (2!)^4 within nodes, 2! for the nodes
    # a faster link of its own makes n0.fast0 unlike n0.fast1 and n1.slow0 unlike n1.slow1, and the nodes
    # unlike each other (swapped, that link would join n1.fast0 and n0.slow0)
    doc = _two_nodes()
    doc["links"]["n0.fast0-n1.slow0"] = {"bandwidth": 8, "latency": 0}
    s = platform_from_dict(doc).symmetry()
    assert sorted(map(sorted, s.device_orbits)) == [[2, 3], [4, 5]] and not s.node_orbits
    # one between the two nodes' first devices is its own image when the nodes are swapped
    doc["links"] = dict(_two_nodes()["links"], **{"n0.fast0-n1.fast0": {"bandwidth": 8, "latency": 0}})
    assert platform_from_dict(doc).symmetry().node_orbits
    # a pinned device leaves its orbit, and its node leaves the node orbit
    s = p.symmetry(fixed=[0])
    assert all(0 not in o for o in s.device_orbits) and not s.node_orbits
    cluster = load_platform("gpt3-cluster").symmetry()
    assert cluster.factor == 4 ** 6 * math.factorial(6)  # DiviML Section VI: 4^6 6! = 2.9e6


def _problem(seed: int, n: int, objective: str = "latency", batch: int = 1, memory: float | None = None):
    rng = random.Random(seed)
    nodes = [Node(f"u{i}", args=tuple(f"u{j}" for j in range(i) if rng.random() < 0.35),
                  latency=float(rng.randint(1, 6)), bytes_written=rng.randint(0, 3), param_bytes=rng.randint(1, 4))
             for i in range(n)]
    return build_problem(Graph(nodes), platform_from_dict(_two_nodes(memory)), objective, batch)


@pytest.mark.parametrize("seed,n,objective", [(0, 5, "latency"), (1, 5, "latency"), (2, 2, "throughput")])
def test_symmetry_breaking_keeps_the_optimum(seed, n, objective):
    problem = _problem(seed, n, objective, batch=4)
    plain = milp(problem, time_limit=20)
    assert plain.optimal
    optimum = replay(problem, plain.mapping).makespan
    for symmetry in SYMMETRIES[1:]:
        broken = milp(problem, time_limit=20, symmetry=symmetry)
        assert broken.optimal, symmetry
        assert replay(problem, broken.mapping).makespan == pytest.approx(optimum), symmetry
        assert broken.symmetry_factor == 32


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(SYMMETRIES[1:]))
def test_canonical_mapping_takes_the_same_time_and_is_ordered(seed, symmetry):
    problem = _problem(seed, 6, "throughput", batch=4)
    rng = random.Random(seed)
    genes = [[rng.randrange(problem.devices)] * problem.pieces for _ in range(problem.n)]
    mapping = Mapping.from_pieces(problem, genes, range(problem.n))
    ordered = canonical(problem, mapping, symmetry)
    check(problem, ordered)
    assert replay(problem, ordered).makespan == pytest.approx(replay(problem, mapping).makespan)
    found = orbits(problem, symmetry)

    def amount(d):
        return amount_of(problem, symmetry, ordered.order[d])

    for orbit in found.device_orbits:
        assert all(amount(a) >= amount(b) - 1e-9 for a, b in itertools.pairwise(orbit))
    for orbit in found.node_orbits:
        totals = [sum(amount(d) for d in members) for members in orbit]
        assert all(a >= b - 1e-9 for a, b in itertools.pairwise(totals))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_a_balanced_mapping_takes_the_same_time_and_puts_the_busiest_where_load_is_least(seed):
    problem = _problem(seed, 6, "throughput", batch=4)
    rng = random.Random(seed)
    genes = [[rng.randrange(problem.devices)] * problem.pieces for _ in range(problem.n)]
    mapping = Mapping.from_pieces(problem, genes, range(problem.n))
    load = [rng.uniform(0, 10) for _ in range(problem.devices)]
    spread = balanced(problem, mapping, load)
    check(problem, spread)
    assert replay(problem, spread).makespan == pytest.approx(replay(problem, mapping).makespan)

    def busy(d):
        return amount_of(problem, "time", spread.order[d])

    for orbit in orbits(problem, "time").device_orbits:  # the less loaded of two devices has the more work
        for a, b in itertools.combinations(orbit, 2):
            if load[a] < load[b]:
                assert busy(a) >= busy(b) - 1e-9


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5))
def test_best_placement_matches_every_pattern(seed, devices):
    rng = random.Random(seed)
    platform = platform_from_dict({"devices": [{"name": f"d{k}", "scale": rng.choice([1, 2, 3]),
                                                "memory": rng.choice([3.0, 6.0, 100.0])} for k in range(devices)],
                                   "links": {"default": {"bandwidth": 1}}})
    problem = build_problem(Graph([Node("a", latency=4.0, param_bytes=2, bytes_written=2)]), platform,
                            "throughput", 4)
    busy = [rng.uniform(0, 5) for _ in range(devices)]

    def end_of(job):
        return busy[job.device] + duration(problem, job)

    memory = Memory(problem)
    brute = None
    for pattern in itertools.product(range(devices), repeat=problem.pieces):
        runs = [list(g) for _, g in itertools.groupby(pattern)]
        if len(set(pattern)) != len(runs):
            continue  # the pieces on one device must be consecutive, each device one run
        jobs = [Job(0, d, tuple(q for q, on in enumerate(pattern) if on == d)) for d in sorted(set(pattern))]
        if not memory.fits(jobs):
            continue
        key = (max(end_of(j) for j in jobs), len(jobs))
        brute = key if brute is None else min(brute, key)
    found = best_placement(problem, 0, end_of, memory)
    if brute is None:
        assert found is None
    else:
        jobs, ends = found
        assert (max(ends), len(jobs)) == pytest.approx(brute)


def test_work_bound_with_device_classes_equals_the_device_by_device_lp():
    problem = _problem(3, 7, "throughput", batch=4)
    units = list(range(problem.n))
    merged = work_bound(problem, units, Prepared(problem).classes)
    assert len(Prepared(problem).classes) == 2
    assert merged == pytest.approx(work_bound(problem, units, [[d] for d in range(problem.devices)]))


def test_milp_split_when_memory_binds_leaves_room_for_the_modules_after():
    # eight modules of two heavy branches; splitting the batch copies weights onto several devices, which
    # the first modules could do until nothing is left for the last ones
    nodes, entry = [Node("in", latency=0.1)], "in"
    for m in range(8):
        branch = [Node(f"m{m}b{k}", args=(entry,), latency=2.0, param_bytes=10, bytes_written=1) for k in range(2)]
        nodes += branch + [Node(f"m{m}out", args=tuple(b.name for b in branch), latency=0.1, bytes_written=1)]
        entry = nodes[-1].name
    platform = platform_from_dict({"devices": [{"name": f"d{k}", "memory": 60} for k in range(4)],
                                   "links": {"default": {"bandwidth": 4, "latency": 0.1}}})
    problem = build_problem(Graph(nodes), platform, "throughput", 4)
    result = milp_split(problem, time_limit=10, min_module=1)
    check(problem, result.mapping)  # every unit placed, every device within its memory
    assert not result.optimal and math.isfinite(replay(problem, result.mapping).makespan)


@pytest.mark.parametrize(("fast_memory", "makespan"), [(35, 6.0), (12, 18.0)])
def test_milp_split_when_memory_binds_shares_out_the_fast_devices(fast_memory, makespan):
    # six modules of one unit; splitting a unit's batch over the two fast devices halves its time and copies
    # its weights, so modules free to fill them (the first three) leave the last three the slow device: 13.5.
    # Each module's share of the fast devices' memory keeps every unit whole on a fast one: 6. With room for
    # one unit a fast device, the first module's share is smaller than a unit; raised to the unit whole (not
    # to a share of all memory, which let it split over both: 20.5), two units run fast: 18.
    nodes = [Node(f"u{i}", args=(f"u{i - 1}",) if i else (), latency=1.0, param_bytes=10, bytes_written=1)
             for i in range(6)]
    platform = platform_from_dict({"devices": [{"name": "f0", "memory": fast_memory},
                                               {"name": "f1", "memory": fast_memory},
                                               {"name": "slow", "scale": 4, "memory": 1000}],
                                   "links": {"default": {"bandwidth": 100, "latency": 0.0}}})
    problem = build_problem(Graph(nodes), platform, "throughput", 4)
    result = milp_split(problem, time_limit=10, min_module=1)
    check(problem, result.mapping)
    assert result.decomposition.modules == [[u] for u in range(6)]
    assert replay(problem, result.mapping).makespan == pytest.approx(makespan, abs=0.01)


def test_milp_memory_caps_cap_what_the_mapping_holds():
    problem = _problem(4, 4, "throughput", batch=4)
    free = milp(problem, time_limit=10)
    need = sum(problem.memory(u) for u in range(problem.n))
    capped = milp(problem, time_limit=10, memory_caps=[(range(problem.devices), need)])
    held = sum(problem.memory(j.unit, len(j.pieces)) for j in capped.mapping.jobs())
    assert held <= need + 1e-9
    assert replay(problem, capped.mapping).makespan >= replay(problem, free.mapping).makespan - 1e-9


def test_per_node_keeps_each_part_on_its_node():
    problem = build_problem(Graph([Node(f"u{i}", args=(f"u{i - 1}",) if i else (), latency=1.0, param_bytes=1)
                                   for i in range(8)]), platform_from_dict(_two_nodes()))
    mapping = per_node(problem, "heft", time_limit=5)
    check(problem, mapping)
    node_of = {j.unit: problem.platform.devices[j.device].node for j in mapping.jobs()}
    assert [node_of[u] for u in range(8)] == ["n0"] * 4 + ["n1"] * 4
    with pytest.raises(MappingError, match="too few"):
        per_node(build_problem(Graph([Node("a", latency=1.0)]), platform_from_dict(_two_nodes())), "heft")


def test_gpt3_decode_on_the_cluster_fits_only_spread_and_bounds_hold():
    from dataclasses import replace

    from opsched.models.gpt import GPT3, gpt3_decode

    full = gpt3_decode(batch=16)
    assert len(full) == 1 + 96 * 10 + 1 and 349e9 < sum(n.param_bytes for n in full.nodes) < 352e9
    # a quarter of GPT-3's layers (87 GB of weights) on the cluster: it fits only spread over several devices
    problem = build_problem(gpt3_decode(16, replace(GPT3, layers=24)), load_platform("gpt3-cluster"), "latency", 16)
    assert problem.simulated
    assert sum(problem.weight_bytes) > 2 * max(d.memory for d in problem.platform.devices)
    heft = solve(problem, "heft", bound=True)
    check(problem, heft.mapping)
    assert 0 < heft.lower_bound <= heft.makespan
    assert len({j.device for j in heft.mapping.jobs()}) >= 3


def test_gpt_small_decode_is_captured_mapped_and_runs_like_eager():
    from opsched.graph.capture import capture
    from opsched.mapping.plan import to_schedule
    from opsched.models.spec import load_model
    from opsched.runtime.module import OptimizedModule

    loaded = load_model("gpt-small-decode", batch=2)
    graph = capture(loaded.model, loaded.inputs)
    assert graph.width >= 2  # the head slices are branches
    platform = platform_from_dict({"devices": [{"name": "c0", "kind": "cpu", "node": "n0"},
                                               {"name": "c1", "kind": "cpu", "node": "n1"}],
                                   "links": {"default": {"bandwidth": math.inf, "latency": 0}}})
    rng = random.Random(0)
    problem = build_problem(graph, platform, measure=lambda device, threads: [rng.uniform(0.1, 1) for _ in graph.nodes])
    solved = solve(problem, "heft", bound=False)
    plan = to_schedule(problem, solved.mapping, solved.timeline, "heft", 0.0, False, {})
    assert len({op.stream for op in plan.ops}) == 2
    module = OptimizedModule(graph, plan, cores=2)
    with torch.inference_mode():
        assert torch.allclose(module(*loaded.inputs), loaded.model(*loaded.inputs), atol=1e-5)
    module.close()


@pytest.mark.parametrize("symmetry", SYMMETRIES[1:])
def test_devices_of_one_kind_with_different_latencies_are_not_interchangeable(symmetry):
    # HEFT's example gives three kind-less devices their own latencies: ordering them as if interchangeable
    # made the MILP prove 74 "optimal" against the true 73
    from opsched.mapping import graphfile

    examples = Path(__file__).parent.parent / "examples"
    graph, latencies, nbytes = graphfile.read(examples / "heft_topcuoglu.json")
    problem = build_problem(graph, load_platform(str(examples / "heft_platform.json")), device_latencies=latencies,
                            edge_bytes=nbytes)
    assert not orbits(problem, symmetry).device_orbits
    result = milp(problem, time_limit=20, symmetry=symmetry)
    assert result.optimal and replay(problem, result.mapping).makespan == pytest.approx(73.0)
