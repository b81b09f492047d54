"""The mapping MILP on CP-SAT and on HiGHS: the same model (``milp.py``, read as a MILP for HiGHS by
``highs.py``), the same instances, the same starting mapping (HEFT's) and time limit, the solvers taken in turn
on each instance (interleaved). Per run: the status, the time to the proven optimum, the best makespan at the
limit, the bound proved and the gap. Solve times are measured on this machine; the makespans of the ``diviml``
platform's RandWire stacks are SIMULATED (its analytical device model), the others the graphs' given costs.

    python benchmarks/mapping_solvers.py --time-limit 20 --out docs/mapping_solvers.jsonl

OUT is replaced once the run is whole; each line records the machine, the versions, the date and the commit.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from sweep import appender

from opsched.graph.ir import Graph, Node
from opsched.mapping.heft import heft
from opsched.mapping.milp import milp
from opsched.mapping.platform import load_platform, platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.replay import replay
from opsched.mapping.workloads import randwire_stack

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SOLVERS = {"cp-sat (2 workers)": {"solver": "cp-sat", "workers": 2},
           "cp-sat (1 worker)": {"solver": "cp-sat", "workers": 1},
           "highs": {"solver": "highs"}}


def random_dag(seed: int, n: int, devices: int, objective: str = "latency", batch: int = 1):
    """Each unit reads each earlier one with probability 0.4; costs 1-9 per device, 0-4 bytes an edge."""
    rng = random.Random(seed)
    graph = Graph([Node(f"u{i}", args=tuple(f"u{j}" for j in range(i) if rng.random() < 0.4)) for i in range(n)])
    names = [f"d{k}" for k in range(devices)]
    latencies = {f"u{i}": {d: float(rng.randint(1, 9)) for d in names} for i in range(n)}
    platform = platform_from_dict({"devices": [{"name": d} for d in names],
                                   "links": {"default": {"bandwidth": 1, "latency": 0.5}}})
    return build_problem(graph, platform, objective, batch, device_latencies=latencies,
                         edge_bytes={e: float(rng.randint(0, 4)) for e in graph.edges})


def heft_example():
    from opsched.mapping import graphfile

    graph, latencies, nbytes = graphfile.read(EXAMPLES / "heft_topcuoglu.json")
    return build_problem(graph, load_platform(str(EXAMPLES / "heft_platform.json")), device_latencies=latencies,
                         edge_bytes=nbytes)


def instances():
    diviml = load_platform("diviml")
    yield "HEFT's 10 tasks, 3 devices", "latency", "given", heft_example
    yield "random DAG, 10 units, 3 devices", "latency", "given", lambda: random_dag(1, 10, 3)
    yield "random DAG, 14 units, 3 devices", "latency", "given", lambda: random_dag(2, 14, 3)
    yield "random DAG, 6 units, 2 devices, batch 8", "throughput", "given", lambda: random_dag(3, 6, 2, "throughput", 8)
    for modules in (1, 5, 10):
        graph = randwire_stack(modules, 10, "er", links=1, seed=2)
        yield (f"RandWire ER(0.2) {modules} module{'s' * (modules > 1)} ({len(graph)} units), diviml", "latency",
               "SIMULATED", lambda g=graph: build_problem(g, diviml))
    graph = randwire_stack(1, 10, "er", links=1, seed=2)
    yield (f"RandWire ER(0.2) 1 module ({len(graph)} units), diviml, batch 16", "throughput", "SIMULATED",
           lambda: build_problem(graph, diviml, "throughput", 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve (model building included)")
    parser.add_argument("--out", default="mapping_solvers.jsonl", help="one JSON line per run")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # the record is replaced only by a whole run
    partial.write_text("")
    append = appender(partial)
    for options in SOLVERS.values():  # untimed: the first solve of each pays for imports and thread start-up
        milp(heft_example(), time_limit=1.0, **options)
    for i, (name, objective, costs, make) in enumerate(instances()):
        problem = make()
        start = heft(problem)
        names = list(SOLVERS)
        for label in names[i % len(names):] + names[:i % len(names)]:  # interleaved: a different first solver each time
            started = time.perf_counter()
            result = milp(problem, time_limit=args.time_limit, hint=start, **SOLVERS[label])
            seconds = time.perf_counter() - started
            best = replay(problem, result.mapping).makespan
            line = {"instance": name, "objective": objective, "costs": costs, "units": problem.n,
                    "solver": label, "status": result.status, "optimal": result.optimal, "seconds": round(seconds, 2),
                    "makespan": best, "heft": replay(problem, start).makespan, "bound": result.bound,
                    "gap": (best - result.bound) / best if best > 0 else 0.0, "time_limit": args.time_limit}
            print(json.dumps(append(line)), flush=True)
    partial.replace(out)


if __name__ == "__main__":
    main()
