"""The claims of ``opsched map`` against independent exact references on thousands of random cases (the checks of
tests/test_mapping_claims.py, more of them): prints, per family, how many cases ran and how many broke a claim.

- ``chains``: chains of 3-5 small modules (2-4 inner units, inner edges), 3 devices, latency: MILP-SPLIT must
  equal the whole MILP's proven optimum and say so.
- ``brute``: DAGs of 3-6 units on 2 devices (with and without a memory budget): every method against brute force
  (where no mapping fits the budget, every exact method must say so).
- ``dags``: DAGs of 9 units on 3 devices and chains, latency with and without memory, each symmetry kind: both
  exact methods' ``optimal`` and ``lower_bound`` against the proven MILP, MILP-SPLIT against the heuristics that ran.

A claim broken: ``optimal`` above the reference optimum, a ``lower_bound`` above it, a makespan below it (an
invalid mapping), MILP-SPLIT above a heuristic it ran, or MILP-SPLIT not proving a single-channel chain.

    python benchmarks/mapping_claims.py --cases 1000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.mapping_cases import brute_force, module_chain, random_dag, tolerance

from opsched.mapping import MappingError
from opsched.mapping.heuristics import HEURISTICS
from opsched.mapping.milp import milp
from opsched.mapping.replay import replay
from opsched.mapping.solve import METHODS, solve

SYMMETRIES = ("none", "batch", "task", "time")


def _claims(problem, optimum: float, methods, time_limit: float, symmetry: str = "none") -> list[str]:
    """The claims ``methods`` break on ``problem`` whose optimum is ``optimum``."""
    broken = []
    for method in methods:
        try:
            found = solve(problem, method, time_limit=time_limit, symmetry=symmetry)
        except MappingError as error:
            # a heuristic's placement may leave a unit no memory; an exact method may say so only where no
            # mapping fits the devices' memory
            if method not in HEURISTICS and math.isfinite(optimum):
                broken.append(f"{method}: {error}")
            continue
        broken += _broken(problem, optimum, method, found)
    return broken


def _broken(problem, optimum: float, method: str, found) -> list[str]:
    """The claims of ``found`` (``method``'s solve) that ``optimum`` breaks."""
    broken = []
    slack = tolerance(problem)
    if math.isinf(optimum):
        return [f"{method}: a mapping ({found.makespan}) where none fits the devices' memory"]
    if found.makespan < optimum - slack:
        broken.append(f"{method}: makespan {found.makespan} below the optimum {optimum}")
    if found.lower_bound > optimum + slack:
        broken.append(f"{method}: lower_bound {found.lower_bound} above the optimum {optimum}")
    if found.optimal and found.makespan > optimum + slack:
        broken.append(f"{method}: optimal {found.makespan} above the optimum {optimum}")
    if method == "milp-split":
        ran = [h["makespan"] for h in found.stats["heuristics"].values()]
        if found.makespan > min(ran, default=math.inf) + 1e-9:
            broken.append(f"milp-split {found.makespan} behind a heuristic it ran ({min(ran)})")
    return broken


def chains(seed: int) -> tuple[str, list[str]] | None:
    modules, inner_most = 3 + seed % 3, 3 + seed % 2
    problem = module_chain(seed, modules=modules, inner=(2, inner_most))
    whole = milp(problem, time_limit=30)
    if not whole.optimal:
        return None
    optimum = replay(problem, whole.mapping).makespan
    found = solve(problem, "milp-split", time_limit=30)
    broken = _broken(problem, optimum, "milp-split", found)
    if found.stats["single_channel"] and not found.optimal:
        broken.append("milp-split proved no optimum on a single-channel chain")
    if abs(found.makespan - optimum) > tolerance(problem):
        broken.append(f"milp-split {found.makespan} where the MILP proves {optimum}")
    return f"chain {modules} modules", broken


def brute(seed: int) -> tuple[str, list[str]] | None:
    units, memory = 3 + seed % 4, bool(seed % 2)
    problem = random_dag(seed, units=units, devices=2, memory=memory)
    return f"dag {units} units{' memory' if memory else ''}", _claims(problem, brute_force(problem), METHODS, 2)


def dags(seed: int) -> tuple[str, list[str]] | None:
    memory, symmetry = bool(seed % 2), SYMMETRIES[(seed // 2) % 4]
    problem = (module_chain(seed, modules=3, inner=(2, 3), memory=memory) if seed % 3 == 0 else
               random_dag(seed, units=9, devices=3, memory=memory))
    try:
        whole = milp(problem, time_limit=30, symmetry=symmetry)
    except MappingError:  # proven: no mapping fits the memory budget
        optimum = math.inf
    else:
        if not whole.optimal:
            return None
        optimum = replay(problem, whole.mapping).makespan
    return f"symmetry {symmetry}{' memory' if memory else ''}", _claims(problem, optimum, ["milp", "milp-split"], 10,
                                                                        symmetry)


FAMILIES = {"chains": chains, "brute": brute, "dags": dags}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases per family (default 1000)")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", help="append one JSON line per family here")
    args = parser.parse_args(argv)
    failures = 0
    for family in args.families:
        started = time.perf_counter()
        ran, unproven, broken = 0, 0, []
        for seed in tqdm(range(args.first_seed, args.first_seed + args.cases), desc=family, unit="case"):
            outcome = FAMILIES[family](seed)
            if outcome is None:
                unproven += 1
                continue
            ran += 1
            broken += [f"seed {seed} ({outcome[0]}): {claim}" for claim in outcome[1]]
        seconds = time.perf_counter() - started
        print(f"{family}: {ran} cases checked, {unproven} left out (no proven reference), {len(broken)} claims "
              f"broken, {seconds:.0f} s")
        for line in broken[:20]:
            print("  " + line)
        failures += len(broken)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps({"family": family, "cases": ran, "unproven": unproven, "broken": broken,
                                      "seconds": seconds}) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
