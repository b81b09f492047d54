"""Mapping onto several devices: HEFT's published example, the MILP against brute force, the bound, the
heuristics against the optimum, MILP-SPLIT against the MILP, the replay simulator, bad input, the command."""

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.mapping_cases import brute_force

from opsched.graph.ir import Graph, Node
from opsched.mapping import MappingError
from opsched.mapping.bound import lower_bound
from opsched.mapping.milp import milp
from opsched.mapping.plan import Mapping, check
from opsched.mapping.platform import platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.solve import METHODS, solve
from opsched.mapping.split import milp_split

EXAMPLES = Path(__file__).parent.parent / "examples"


def _heft_example():
    from opsched.mapping import graphfile
    from opsched.mapping.platform import load_platform

    graph, latencies, nbytes = graphfile.read(EXAMPLES / "heft_topcuoglu.json")
    return build_problem(graph, load_platform(str(EXAMPLES / "heft_platform.json")), device_latencies=latencies,
                         edge_bytes=nbytes)


def test_heft_reproduces_its_paper_example():
    problem = _heft_example()
    assert solve(problem, "heft").makespan == 80.0  # Topcuoglu et al. 2002, Fig. 2
    best = solve(problem, "milp", time_limit=20)
    assert best.optimal and best.makespan == pytest.approx(73.0)
    assert best.lower_bound <= best.makespan
    assert lower_bound(problem) <= 73.0


def _random_problem(seed: int, n: int, devices: int, objective: str = "latency", batch: int = 1):
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        preds = [f"u{j}" for j in range(i) if rng.random() < 0.4]
        nodes.append(Node(f"u{i}", args=tuple(preds)))
    graph = Graph(nodes)
    names = [f"d{k}" for k in range(devices)]
    latencies = {f"u{i}": {d: float(rng.randint(1, 9)) for d in names} for i in range(n)}
    platform = platform_from_dict({"devices": [{"name": d} for d in names],
                                   "links": {"default": {"bandwidth": 1, "latency": 0.5}}})
    nbytes = {e: float(rng.randint(0, 4)) for e in graph.edges}
    return build_problem(graph, platform, objective, batch, device_latencies=latencies, edge_bytes=nbytes)


@pytest.mark.parametrize("seed,n,devices", [(0, 5, 2), (1, 5, 3), (2, 6, 2), (3, 4, 3)])
def test_milp_equals_brute_force_and_bounds_and_heuristics_hold(seed, n, devices):
    problem = _random_problem(seed, n, devices)
    optimum = brute_force(problem)
    result = milp(problem, time_limit=10)
    assert result.optimal
    assert replay(problem, result.mapping).makespan == pytest.approx(optimum)
    assert lower_bound(problem) <= optimum + 1e-9
    for method in METHODS:
        found = solve(problem, method, time_limit=0.5)
        assert found.makespan >= optimum - 1e-9, method
        assert found.lower_bound <= optimum + 1e-9, method


def test_throughput_milp_splits_the_batch_and_beats_one_device():
    problem = _random_problem(4, 4, 2, "throughput", batch=8)
    assert problem.pieces == 4
    best = solve(problem, "milp", time_limit=5)
    single = solve(problem, "best-device")
    assert best.makespan <= single.makespan
    assert best.lower_bound <= best.makespan
    assert problem.objective_value(best.makespan) == pytest.approx(8 / best.makespan)


def _chain_of_modules(modules: int, seed: int) -> Graph:
    rng = random.Random(seed)
    nodes = [Node("in", latency=1.0)]
    entry = "in"
    for m in range(modules):
        width = rng.randint(2, 3)
        branch = [Node(f"m{m}b{k}", args=(entry,)) for k in range(width)]
        exit_node = Node(f"m{m}out", args=tuple(b.name for b in branch))
        nodes += branch + [exit_node]
        entry = exit_node.name
    return Graph(nodes)


def test_milp_split_is_optimal_on_single_channel_chains():
    graph = _chain_of_modules(4, seed=3)
    rng = random.Random(5)
    latencies = {n.name: {"a": float(rng.randint(1, 6)), "b": float(rng.randint(1, 6))} for n in graph.nodes}
    platform = platform_from_dict({"devices": [{"name": "a"}, {"name": "b"}],
                                   "links": {"default": {"bandwidth": 1, "latency": 0.5}}})
    problem = build_problem(graph, platform, device_latencies=latencies,
                            edge_bytes={e: 1.0 for e in graph.edges})
    whole = milp(problem, time_limit=20)
    split = milp_split(problem, time_limit=20, min_module=1)
    assert whole.optimal and split.optimal and split.decomposition.single_channel
    assert len(split.decomposition.modules) > 1
    assert replay(problem, split.mapping).makespan == pytest.approx(replay(problem, whole.mapping).makespan)
    assert lower_bound(problem) <= replay(problem, whole.mapping).makespan + 1e-9



@settings(max_examples=6, deadline=None)
@given(st.integers(0, 10_000))
def test_milp_split_skips_only_solves_that_cannot_win(seed):
    # a slow third device (as the Xeon beside two GPUs): a chain whose exit is on it is longer than moving the
    # next module's inputs costs, so its solves are skipped; the DP must still reach the whole MILP's optimum
    graph = _chain_of_modules(4, seed=seed)
    rng = random.Random(seed)
    latencies = {n.name: {"a": float(rng.randint(1, 6)), "b": float(rng.randint(1, 6)), "slow": 40.0}
                 for n in graph.nodes}
    platform = platform_from_dict({"devices": [{"name": "a"}, {"name": "b"}, {"name": "slow"}],
                                   "links": {"default": {"bandwidth": 1, "latency": 0.5}}})
    problem = build_problem(graph, platform, device_latencies=latencies, edge_bytes={e: 1.0 for e in graph.edges})
    whole = milp(problem, time_limit=20)
    split = milp_split(problem, time_limit=20, min_module=1)
    pairs = 3 + 9 * (len(split.decomposition.modules) - 2) + 3  # every (input, output) device pair of every module
    assert whole.optimal and split.optimal and split.solves < pairs
    assert replay(problem, split.mapping).makespan == pytest.approx(replay(problem, whole.mapping).makespan)

def test_replay_hand_checked_with_transfers_and_pieces():
    graph = Graph([Node("a", latency=4.0), Node("b", args=("a",), latency=4.0)])
    platform = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}],
                                   "links": {"default": {"bandwidth": 2, "latency": 1}}})
    problem = build_problem(graph, platform, "throughput", batch=4, edge_bytes={(0, 1): 8.0})
    # a: pieces 0,1 on x (2.0), 2,3 on y (2.0); b: everything on x (4.0): piece 2 and 3 move y -> x,
    # each 1 + (8 / 4) / 2 = 2 -> they arrive at 4.0, b starts at 4.0 and ends at 8.0.
    mapping = Mapping.from_pieces(problem, [[0, 0, 1, 1], [0, 0, 0, 0]], [0, 1])
    timeline = replay(problem, mapping)
    assert timeline.makespan == pytest.approx(8.0)
    assert sorted((t.pieces, t.start, t.finish) for t in timeline.transfers) == [((2,), 2.0, 4.0), ((3,), 2.0, 4.0)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 7), st.integers(1, 3))
def test_replay_places_every_unit_once_and_respects_precedence_and_transfers(seed, n, devices):
    problem = _random_problem(seed, n, devices)
    rng = random.Random(seed)
    mapping = Mapping.from_devices(n, [rng.randrange(devices) for _ in range(n)], range(n), devices)
    check(problem, mapping)
    timeline = replay(problem, mapping)
    placed = {j.unit: j for j in timeline.start}
    assert sorted(placed) == list(range(n))
    for a, b in problem.graph.edges:
        ja, jb = placed[a], placed[b]
        assert timeline.start[jb] >= timeline.finish[ja] + problem.comm(a, b, ja.device, jb.device) - 1e-9
    for jobs in mapping.order:
        for x, y in itertools.pairwise(jobs):
            assert timeline.start[y] >= timeline.finish[x] - 1e-9


def _opsched(*args):
    return subprocess.run([sys.executable, "-m", "opsched", *map(str, args)], capture_output=True, text=True,
                          check=False)


def test_map_command_on_a_dag_json_prints_the_design_fields(tmp_path):
    out = tmp_path / "plan.json"
    done = _opsched("map", EXAMPLES / "heft_topcuoglu.json", "--platform", EXAMPLES / "heft_platform.json",
                    "--method", "milp-split", "--time-limit", "5", "--out", out, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for key in ("method", "objective", "platform", "predicted", "lower_bound", "optimal", "solve_seconds",
                "placements", "transfers"):
        assert key in result
    assert result["predicted"] == pytest.approx(73.0) and result["optimal"]
    assert {"name", "device", "start", "finish", "inputs"} <= set(result["placements"][0])
    assert {"value", "from_device", "to_device", "start", "finish"} <= set(result["transfers"][0])
    from opsched.schedule import load

    plan = load(out)
    assert [d.name for d in plan.devices.devices] == ["p1", "p2", "p3"] and plan.form == "stream"


BAD = {
    "unknown kind": ({"devices": [{"name": "a", "kind": "sim:zz"}], "links": {}}, "unknown device kind"),
    "disconnected": ({"devices": [{"name": "a"}, {"name": "b"}], "links": {}}, "disconnected"),
    "bad link": ({"devices": [{"name": "a"}, {"name": "b"}], "links": {"a-c": {"bandwidth": 1}}}, "does not name"),
    "no cost": ({"devices": [{"name": "p1"}, {"name": "p9"}], "links": {"default": {"bandwidth": 1}}},
                "no latency on device 'p9'"),
    "memory": ({"devices": [{"name": "p1", "memory": 1}], "links": {}}, "nothing fits"),
    "negative overhead": ({"devices": [{"name": "p1", "kind": "sim:t4", "op_overhead": -1}], "links": {}},
                          "op_overhead must be"),
    "overhead on a real device": ({"devices": [{"name": "p1", "kind": "cpu", "op_overhead": 0.1}], "links": {}},
                                  "applies to simulated devices"),
    "overhead too large for a float": ({"devices": [{"name": "p1", "kind": "sim:t4", "op_overhead": 10**400}],
                                        "links": {}}, "op_overhead must be"),
}


def _in_process(capsys, *args) -> tuple[int, str]:
    """The command's entry in this process (the executable's own is tested once below): status and stderr."""
    from opsched.cli import main

    status = main([str(a) for a in args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_platforms_are_one_line_and_exit_2(tmp_path, capsys, case):
    doc, expected = BAD[case]
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps({"nodes": [{"name": "a", "latency": {"p1": 1}, "bytes": 100}], "edges": []}))
    argv = ("map", graph, "--platform", platform, "--method", "heft")
    status, err = _in_process(capsys, *argv)
    if case == "disconnected":
        done = _opsched(*argv)
        assert (done.returncode, done.stderr) == (status, err)
    assert status == 2
    assert expected in err and len(err.strip().splitlines()) == 1


def test_bad_graph_and_unknown_platform_are_one_line(tmp_path, capsys):
    graph = tmp_path / "g.json"
    graph.write_text('{"nodes": [{"name": "a", "latency": {"x": -1}}], "edges": []}')
    status, err = _in_process(capsys, "map", graph, "--platform", "diviml", "--method", "heft")
    assert status == 2 and "latency on 'x'" in err
    status, err = _in_process(capsys, "map", graph, "--platform", "nowhere", "--method", "heft")
    assert status == 2 and "unknown platform" in err


def test_simulated_plan_is_refused_by_check_runnable():
    from opsched.mapping.execute import check_runnable
    from opsched.mapping.plan import to_schedule
    from opsched.mapping.platform import load_platform
    from opsched.mapping.workloads import randwire_stack

    problem = build_problem(randwire_stack(1, 6, "er", seed=1), load_platform("diviml"))
    solved = solve(problem, "heft")
    plan = to_schedule(problem, solved.mapping, solved.timeline, "heft", solved.lower_bound, False, {})
    with pytest.raises(MappingError, match="simulated"):
        check_runnable(plan)


def test_the_latency_milp_proves_the_true_optimum_where_presolve_once_proved_a_wrong_one():
    """A 6-unit DAG (HiGHS agreement test, seed 390) on which CP-SAT's presolve proved 17.0 optimal while
    16.5 is feasible, when the redundant device no-overlap was stated over intervals sharing their unit's start."""
    from test_mapping_highs import _random_problem

    problem = _random_problem(390, 6, 2)
    for workers in (1, 2, 8):
        result = milp(problem, time_limit=30, workers=workers)
        assert result.optimal and replay(problem, result.mapping).makespan == pytest.approx(16.5)


def test_the_diviml_platform_keeps_table_ii_ratios_on_randwire_and_pays_per_operator():
    """The built-in platform is fitted to DiviML's Table II (benchmarks/fit_diviml.py): on the RandWire family
    the T4 costs 1.26x and the Xeon 7.10x the A100. A device's op_overhead is paid once per operator of a unit,
    whatever its share of the batch, and the Xeon's cost is its FLOPs at its speed."""
    from opsched.cost.devices import CPUS
    from opsched.mapping.platform import load_platform
    from opsched.mapping.workloads import randwire_stack

    platform = load_platform("diviml")
    totals = dict.fromkeys(platform.names, 0.0)
    for generator in ("ws", "er", "ba"):
        for nodes in (10, 32):
            graph = randwire_stack(1, nodes, generator, seed=3)
            problem = build_problem(graph, platform)
            for d, name in enumerate(platform.names):
                totals[name] += sum(problem.times[u][d][0] for u in range(len(graph)))
    assert totals["t4"] / totals["a100"] == pytest.approx(32.58 / 25.84, rel=0.01)
    assert totals["cpu"] / totals["a100"] == pytest.approx(183.39 / 25.84, rel=0.01)

    graph = randwire_stack(1, 4, "er", seed=1)
    doc = {"devices": [{"name": "g", "kind": "sim:a100", "op_overhead": 0.5}, {"name": "x", "kind": "sim:xeon"}],
           "links": {"default": {"bandwidth": 1e9, "latency": 0}}}
    problem = build_problem(graph, platform_from_dict(doc), "throughput", 8)
    plain = build_problem(graph, platform_from_dict({**doc, "devices": [{"name": "g", "kind": "sim:a100"},
                                                                         {"name": "x", "kind": "sim:xeon"}]}),
                          "throughput", 8)
    for u, node in enumerate(graph.nodes):
        for k in range(problem.pieces):
            assert problem.times[u][0][k] == pytest.approx(plain.times[u][0][k] + 0.5 * len(node.ops))
        assert problem.times[u][1][-1] == pytest.approx(node.flops / 1e9 * CPUS["xeon"].ms_per_gflop)
        assert problem.times[u][1][0] == pytest.approx(problem.times[u][1][-1] / problem.pieces, rel=1e-3)
