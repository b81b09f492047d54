"""The mapping MILP on HiGHS (``mapping/highs.py``): milp.py's CP-SAT model read as a MILP has the same optima
as on CP-SAT (latency and throughput, with symmetry constraints), starts from the whole of a known mapping within
the time limit, and refuses what it cannot state. Skipped when this OR-Tools has no HiGHS."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mapping import _heft_example, _random_problem

from opsched.graph.ir import Graph, Node
from opsched.mapping import MappingError
from opsched.mapping.heft import heft
from opsched.mapping.milp import milp
from opsched.mapping.platform import load_platform, platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.workloads import randwire_stack


def _highs_available() -> bool:
    from ortools.math_opt.python import mathopt

    model = mathopt.Model()
    model.add_binary_variable()
    try:
        mathopt.solve(model, mathopt.SolverType.HIGHS)
    except Exception:  # noqa: BLE001 - MathOpt's error for a solver it was built without varies by version
        return False
    return True


pytestmark = pytest.mark.skipif(not _highs_available(), reason="this OR-Tools build has no HiGHS")


def _alike_devices_problem(seed: int, n: int, objective: str, batch: int):
    """Two devices that cost every unit the same: the symmetry constraints have an orbit to order."""
    rng = random.Random(seed)
    nodes = [Node(f"u{i}", args=tuple(f"u{j}" for j in range(i) if rng.random() < 0.4),
                  latency=float(rng.randint(1, 9))) for i in range(n)]
    graph = Graph(nodes)
    platform = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}],
                                   "links": {"default": {"bandwidth": 1, "latency": 0.5}}})
    nbytes = {e: float(rng.randint(0, 4)) for e in graph.edges}
    return build_problem(graph, platform, objective, batch, edge_bytes=nbytes)


def _same_optimum(problem, symmetry: str = "none") -> None:
    cp = milp(problem, time_limit=30, symmetry=symmetry)
    hi = milp(problem, time_limit=30, symmetry=symmetry, solver="highs")
    assert cp.optimal and hi.optimal, (cp.status, hi.status)
    best = replay(problem, hi.mapping).makespan
    assert best == pytest.approx(replay(problem, cp.mapping).makespan)
    assert hi.bound <= best + 1e-9


def test_highs_proves_the_heft_example_optimum():
    problem = _heft_example()
    result = milp(problem, time_limit=30, solver="highs")
    assert result.optimal and replay(problem, result.mapping).makespan == pytest.approx(73.0)


def test_highs_solves_the_model_its_heuristic_left_off_a_row():
    # seed 492 drew three independent units on three devices: HiGHS's feasibility-jump heuristic found a point
    # 1e-6 off a row, called it optimal, then its final check called that a solve error (highs.RETRIES)
    problem = _random_problem(492, 3, 3)
    result = milp(problem, time_limit=30, solver="highs")
    assert result.optimal and replay(problem, result.mapping).makespan == pytest.approx(2.0)
    _same_optimum(problem)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 7), st.integers(2, 3), st.sampled_from(["none", "batch", "task", "time"]))
def test_highs_and_cp_sat_agree_on_latency(seed, n, devices, symmetry):
    _same_optimum(_random_problem(seed, n, devices), symmetry)
    _same_optimum(_alike_devices_problem(seed, n, "latency", 1), symmetry)


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_highs_and_cp_sat_agree_on_throughput(seed):
    # four units, two devices, the batch in four pieces; HiGHS proves these within a second (not six units)
    _same_optimum(_random_problem(seed, 4, 2, "throughput", 4))
    _same_optimum(_alike_devices_problem(seed, 4, "throughput", 4), "task")


def test_highs_starts_from_the_whole_mapping_and_keeps_the_time_limit():
    # given only the devices of HEFT's mapping, HiGHS completed it with a sub-MIP outside its time limit: a 5 s
    # limit took 8.5 s on these 110 units
    problem = build_problem(randwire_stack(10, 10, "er", links=1, seed=2), load_platform("diviml"))
    start = heft(problem)
    started = time.perf_counter()
    result = milp(problem, time_limit=2.0, hint=start, solver="highs")
    assert time.perf_counter() - started < 2.0 + 0.5
    assert replay(problem, result.mapping).makespan <= replay(problem, start).makespan + 1e-9


def test_highs_reports_no_mapping_when_memory_cannot_hold_one():
    # three units of 60 bytes on two devices of 100: together they fit (180 <= 200), on the devices they do not
    graph = Graph([Node(f"u{i}", latency=1.0, bytes_written=60) for i in range(3)])
    platform = platform_from_dict({"devices": [{"name": "x", "memory": 100}, {"name": "y", "memory": 100}],
                                   "links": {"default": {"bandwidth": 1}}})
    with pytest.raises(MappingError, match="no mapping fits"):
        milp(build_problem(graph, platform), time_limit=10, solver="highs")


def test_bad_solver_requests_are_refused():
    problem = _random_problem(1, 4, 2)
    with pytest.raises(MappingError, match="unknown MILP solver 'gurobi'"):
        milp(problem, solver="gurobi")
    with pytest.raises(MappingError, match="progress"):
        milp(problem, solver="highs", progress=print)


def test_a_constraint_without_a_linear_form_is_refused():
    from ortools.sat.python import cp_model

    from opsched.mapping.highs import solve_highs

    model = cp_model.CpModel()
    a, b, c = (model.NewIntVar(0, 5, name) for name in "abc")
    model.AddMultiplicationEquality(c, [a, b])
    model.Minimize(c)
    with pytest.raises(MappingError, match="int_prod|no linear form"):
        solve_highs(model, 1.0)
