"""Reliability under load, faults and bad input (issue 14): the long runs behind docs/reliability.md.

    python benchmarks/reliability.py                # every suite at the documented size (docs/reliability.jsonl)
    python benchmarks/reliability.py --quick        # a smaller size of each (about a minute)
    python benchmarks/reliability.py --only load soak

Suites: ``load`` (threads calling one OptimizedModule at once, every output compared with eager on the
same input), ``soak`` (thousands of calls: resident memory, threads, file descriptors), ``faults`` (a unit
failing mid-run, then the next call), ``interrupt`` (Ctrl-C at random moments of ``opsched optimize``),
``fuzz-models`` / ``fuzz-plans`` / ``fuzz-dags`` (hypothesis). For ``opsched map`` and mapped plans:
``fuzz-platforms`` / ``fuzz-mapping-dags`` / ``fuzz-mapped-plans`` (hypothesis), ``interrupt-map`` (Ctrl-C during
a MILP solve), ``time-limit-map`` (how far each method runs past ``--time-limit``), ``load-map`` / ``soak-map``
(``load`` and ``soak`` on a plan mapped onto ``cpu2``). For the Ray engine (``opsched run --engine ray``, a plan
mapped onto two nodes): ``soak-ray`` (the driver's and the actors' memory, the actors ending, Ray's processes),
``load-ray`` (threads calling one RayModule), ``interrupt-ray`` (Ctrl-C at random moments of a run on a local Ray),
``faults-ray`` (a unit failing in an actor). Each prints one JSON line of figures.

The helpers live in tests/support/, where the fast tests in tests/test_reliability*.py import them too and run
them at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sweep import machine

from opsched.compare import compare_outputs
from opsched.runtime.module import OptimizedModule
from opsched.schedulers import SCHEDULERS

# the helpers are the tests' own (tests/support), shared with tests/test_reliability*.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.fault_trials import MODEL_FILE, fault_trial, interrupt_trial
from support.map_trials import (
    MAP_METHODS,
    MAPPED_MUTATIONS,
    check_mapped_plan_text,
    check_mapping_case,
    check_platform_document,
    map_interrupt_trial,
    mapped_module_plan,
    mapped_plans,
    mapping_case,
    mutate_mapped,
    platform_document,
    time_limit_trial,
)
from support.plan_fuzz import MUTATIONS, check_dag_document, check_plan_text, dag_documents, mutate
from support.process_watch import soak
from support.ray_trials import FORMS, RAY_MOMENTS, ray_case, ray_fault_trial, ray_interrupt_trial, ray_soak
from support.small_models import (
    branchy,
    call_with_deadline,
    check_recipe,
    fused_batch,
    hammer,
    recipes,
    schedule_all,
    seeded_input,
)

# -- the suites --------------------------------------------------------------------------------------------------

def suite_load(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy()
    results = {}
    for method in ("sequential", "ios", "lios"):
        plan = schedule_all(graph)[method]
        module = OptimizedModule(graph, plan, cores=2)
        results[method] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["threads"],
                                 calls=size["calls"])
        module.close()
    module, batch = fused_batch()
    results["multi"] = hammer(module, batch, seeded_input(batch.inputs[0].shape), threads=size["threads"],
                              calls=size["calls"])
    module.close()
    return results


def suite_soak(size: dict[str, int]) -> dict[str, Any]:
    _, graph, inputs = branchy()
    plan = schedule_all(graph)["lios"]
    return soak(lambda: OptimizedModule(graph, plan, cores=2), inputs, calls=size["soak_calls"])


def suite_faults(size: dict[str, int]) -> list[dict[str, Any]]:
    model, graph, inputs = branchy()
    out = []
    for method in ("sequential", "greedy", "ios", "lios", "nimble"):
        for unit in (graph.nodes[0].name, graph.nodes[len(graph) // 2].name, graph.nodes[-1].name):
            out.append(fault_trial(model, graph, inputs, method, unit, calls=size["fault_calls"]))
    return out


def suite_interrupt(size: dict[str, int]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    with tempfile.TemporaryDirectory() as d:
        trials = [interrupt_trial(Path(d), None)]
        trials += [interrupt_trial(Path(d), rng.uniform(0.1, 5.0)) for _ in range(size["interrupts"] - 1)]
    return trials


def suite_fuzz_models(size: dict[str, int]) -> dict[str, Any]:
    counts = {"models": 0, "schedules_run": 0}

    @settings(max_examples=size["models"], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(recipes())
    def run(recipe: dict[str, Any]) -> None:
        counts["schedules_run"] += check_recipe(recipe)
        counts["models"] += 1

    run()
    return counts


def suite_fuzz_plans(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy(width=3, depth=2, channels=4, size=6)
    with torch.inference_mode():
        want = model(*inputs)

    def execute(plan: Any) -> None:
        module = OptimizedModule(graph, plan, cores=2)
        try:
            assert compare_outputs(call_with_deadline(module, inputs), want).ok
        finally:
            module.close()

    plans = {m: s.to_dict() for m, s in schedule_all(graph).items()}
    counts: dict[str, int] = {"refused": 0, "accepted": 0}

    @settings(max_examples=size["plans"], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(plans)), st.sampled_from(MUTATIONS), st.integers(0, 2**32))
    def run(method: str, kind: str, seed: int) -> None:
        counts[check_plan_text(mutate(plans[method], random.Random(seed), kind), graph, execute)] += 1

    run()
    return counts


def suite_fuzz_dags(size: dict[str, int]) -> dict[str, Any]:
    counts = {"scheduled": 0, "refused": 0}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["dags"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(dag_documents(), st.sampled_from(sorted(SCHEDULERS)))
        def run(doc: Any, method: str) -> None:
            counts[check_dag_document(doc, method, Path(d))] += 1

        run()
    return counts


def suite_fuzz_platforms(size: dict[str, int]) -> dict[str, Any]:
    counts: dict[str, Any] = {"documents": 0, "mapped": 0, "refused": 0, "subprocess_runs": 0, "defects": {}}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["platforms"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.integers(0, 2**32))
        def run(seed: int) -> None:
            text, defect = platform_document(seed)
            real = counts["documents"] % 50 == 0  # every 50th also through the real executable
            verdict = check_platform_document(text, Path(d), subprocess_too=real)
            counts["documents"] += 1
            counts["subprocess_runs"] += real
            counts[verdict] += 1
            counts["defects"].setdefault(defect, {"mapped": 0, "refused": 0})[verdict] += 1

        run()
    return counts


def suite_fuzz_mapping_dags(size: dict[str, int]) -> dict[str, Any]:
    counts = {"cases": 0, "refused": 0, "mapped": 0, "answers": 0, "proven_optimal": 0}
    with tempfile.TemporaryDirectory() as d:
        @settings(max_examples=size["mapping_dags"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.integers(0, 2**32))
        def run(seed: int) -> None:
            for key, value in check_mapping_case(mapping_case(seed), Path(d), time_limit=1.0).items():
                counts[key] += value
            counts["cases"] += 1

        run()
    return counts


def suite_fuzz_mapped_plans(size: dict[str, int]) -> dict[str, Any]:
    counts: dict[str, Any] = {"plans": 0, "show": {"accepted": 0, "refused": 0}, "run": {"accepted": 0, "refused": 0}}
    with tempfile.TemporaryDirectory() as d, _cache_in(Path(d)):
        (Path(d) / "branches.py").write_text(MODEL_FILE)
        spec = f"{Path(d) / 'branches.py'}:make"
        plans = mapped_plans(Path(d), spec)

        @settings(max_examples=size["mapped_plans"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(sorted(plans)), st.sampled_from(MAPPED_MUTATIONS), st.integers(0, 2**32))
        def run(name: str, kind: str, seed: int) -> None:
            rng = random.Random(seed)
            verdict = check_mapped_plan_text(mutate_mapped(plans[name], rng, kind), Path(d), spec,
                                             gantt=rng.random() < 0.1)
            counts["plans"] += 1
            for command, what in verdict.items():
                counts[command][what] += 1

        run()
    return counts


@contextlib.contextmanager
def _cache_in(directory: Path) -> Any:
    """Measurements go to a cache of their own under ``directory``, never the user's."""
    previous = os.environ.get("OPSCHED_CACHE_DIR")
    os.environ["OPSCHED_CACHE_DIR"] = str(directory / "cache")
    try:
        yield
    finally:
        if previous is None:
            del os.environ["OPSCHED_CACHE_DIR"]
        else:
            os.environ["OPSCHED_CACHE_DIR"] = previous


def suite_interrupt_map(size: dict[str, int]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    trials = []
    with tempfile.TemporaryDirectory() as d:
        for method in ("milp", "milp-split"):
            for _ in range(size["map_interrupts"]):
                trials.append(map_interrupt_trial(Path(d), method, rng.uniform(0.1, 7.0), time_limit=5.0))
    return trials


def suite_time_limit_map(size: dict[str, int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        return [time_limit_trial(Path(d), method, 2.0, units) for units in size["time_limit_units"]
                for method in MAP_METHODS]


def suite_load_map(size: dict[str, int]) -> dict[str, Any]:
    model, graph, inputs = branchy()
    results = {}
    for method in ("heft", "milp"):
        plan = mapped_module_plan(graph, method)
        module = OptimizedModule(graph, plan, cores=2)
        results[method] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["threads"],
                                 calls=size["calls"])
        results[method]["units_per_device"] = [sum(op.stream == k for op in plan.ops) for k in range(2)]
        module.close()
    return results


def suite_soak_map(size: dict[str, int]) -> dict[str, Any]:
    _, graph, inputs = branchy()
    plan = mapped_module_plan(graph, "heft")
    return soak(lambda: OptimizedModule(graph, plan, cores=2), inputs, calls=size["soak_calls"])


def suite_soak_ray(size: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        model, graph, inputs, plan, _ = ray_case(Path(d), size["ray_model"])
    return ray_soak(model, graph, inputs, plan, size["ray_soak_calls"], size["ray_warmup"], size["ray_modules"])


def suite_load_ray(size: dict[str, Any]) -> dict[str, Any]:
    from opsched.runtime.ray import RayModule, ray_cluster

    with tempfile.TemporaryDirectory() as d:
        model, graph, inputs, plan, _ = ray_case(Path(d), size["ray_model"])
    results = {}
    with ray_cluster(["n0", "n1"], cpus=4):
        for form, compiled in FORMS.items():
            with RayModule(graph, plan, compiled=compiled) as module:
                results[form] = hammer(module, model, seeded_input(inputs[0].shape), threads=size["ray_threads"],
                                       calls=size["ray_calls"])
                one = hammer(module, model, seeded_input(inputs[0].shape), threads=1, calls=size["ray_calls"])
                results[form]["one_thread_calls_per_second"] = one["calls_per_second"]
    return results


def suite_interrupt_ray(size: dict[str, Any]) -> list[dict[str, Any]]:
    rng = random.Random(14)
    with tempfile.TemporaryDirectory() as d:
        *_, run_args = ray_case(Path(d), size["ray_model"])
        trials = [ray_interrupt_trial(Path(d), run_args, None)]  # not signalled: how long a run takes
        span = trials[0]["seconds"]
        trials += [ray_interrupt_trial(Path(d), run_args, rng.uniform(0.3, span)) for _ in range(size["ray_interrupts"])]
        trials += [ray_interrupt_trial(Path(d), run_args, moment) for moment in RAY_MOMENTS]
    return trials


def suite_faults_ray(size: dict[str, Any]) -> list[dict[str, Any]]:
    from opsched.runtime.ray import ray_cluster

    with tempfile.TemporaryDirectory() as d:  # every unit of the small CNN: each trial starts two modules
        model, graph, inputs, plan, _ = ray_case(Path(d), "branches")
    with ray_cluster(["n0", "n1"], cpus=4):
        return [ray_fault_trial(model, graph, inputs, plan, node.name, compiled, on_call)
                for compiled in FORMS.values() for node in graph.nodes for on_call in size["ray_fault_calls"]]


SUITES = {"load": suite_load, "soak": suite_soak, "faults": suite_faults, "interrupt": suite_interrupt,
          "fuzz-models": suite_fuzz_models, "fuzz-plans": suite_fuzz_plans, "fuzz-dags": suite_fuzz_dags,
          "fuzz-platforms": suite_fuzz_platforms, "fuzz-mapping-dags": suite_fuzz_mapping_dags,
          "fuzz-mapped-plans": suite_fuzz_mapped_plans, "interrupt-map": suite_interrupt_map,
          "time-limit-map": suite_time_limit_map, "load-map": suite_load_map, "soak-map": suite_soak_map,
          "soak-ray": suite_soak_ray, "load-ray": suite_load_ray, "interrupt-ray": suite_interrupt_ray,
          "faults-ray": suite_faults_ray}
FULL = {"threads": 8, "calls": 200, "soak_calls": 2000, "fault_calls": 30, "interrupts": 30, "models": 400,
        "plans": 5000, "dags": 3000, "platforms": 2000, "mapping_dags": 300, "mapped_plans": 1500,
        "map_interrupts": 15, "time_limit_units": [150, 300], "ray_model": "googlenet", "ray_soak_calls": 1500,
        "ray_warmup": 300, "ray_modules": 20, "ray_threads": 4, "ray_calls": 50, "ray_interrupts": 20,
        "ray_fault_calls": [1, 3]}
QUICK = {"threads": 8, "calls": 25, "soak_calls": 300, "fault_calls": 9, "interrupts": 2, "models": 15,
         "plans": 200, "dags": 200, "platforms": 200, "mapping_dags": 20, "mapped_plans": 100, "map_interrupts": 1,
         "time_limit_units": [60], "ray_model": "branches", "ray_soak_calls": 300, "ray_warmup": 20, "ray_modules": 3,
         "ray_threads": 4, "ray_calls": 25, "ray_interrupts": 2, "ray_fault_calls": [3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller size of every suite")
    parser.add_argument("--only", nargs="+", choices=sorted(SUITES), help="run these suites only")
    parser.add_argument("--out", default="docs/reliability.jsonl",
                        help="each suite's line is appended here too (with the machine, versions, date, commit)")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    where = {**machine(), "threads_torch": torch.get_num_threads(), "size": "quick" if args.quick else "full"}
    print(json.dumps({**where, "sizes": size}), flush=True)
    for name in args.only or SUITES:
        started = time.perf_counter()
        result = SUITES[name](size)
        row = {"suite": name, "seconds": round(time.perf_counter() - started, 1), "result": result}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:  # as each suite ends: a long run interrupted keeps what it found
            f.write(json.dumps({**row, **where}) + "\n")


if __name__ == "__main__":
    main()
