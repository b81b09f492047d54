"""DiviML's comparisons on its platform (a Xeon CPU, a T4 and an A100 on PCIe 4.0 x16), SIMULATED.

Sections (``--sections``): ``stacks`` (10-module RandWire ER(0.2) stacks, 1 and 4 channels: every algorithm's
latency, and throughput at batch 16: DiviML Tables I and IV), ``speedup`` (MILP-SPLIT against the whole MILP on
5, 10, 20 modules: Table III), ``modules`` (single RandWire modules WS(4, 0.75), ER(0.2), BA(5), N 10 and 32),
``torchvision`` (GoogLeNet, Inception V3, ResNet-50, VGG-16, AlexNet at batch 1). Writes markdown tables to
``--out`` (default mapping_diviml.md), appends them with the machine, versions, date and commit to its ``.jsonl``
beside it, and prints them. "Ceiling": the best single device's latency over the work
bound (every unit's work spread over the devices as an LP, transfers and order free): no mapping gains more.

    python benchmarks/mapping_diviml.py --sections stacks speedup
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sweep import appender

from opsched.mapping.bound import work_bound
from opsched.mapping.platform import load_platform
from opsched.mapping.problem import build_problem
from opsched.mapping.solve import METHODS, solve
from opsched.mapping.workloads import randwire_stack

HEURISTICS = ("best-device", "met", "greedy", "heft", "sa", "ea")


def run_all(problem, methods, limits) -> dict[str, dict]:
    rows = {}
    for method in methods:
        started = time.perf_counter()
        s = solve(problem, method, time_limit=limits.get(method, 5.0), bound=False)
        rows[method] = {"makespan": s.makespan, "value": problem.objective_value(s.makespan), "optimal": s.optimal,
                        "seconds": time.perf_counter() - started, "stats": s.stats}
    return rows


TABLES: list[dict] = []  # every table made, as written to --out's JSON-lines record


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    TABLES.append({"table": title, "header": header, "rows": rows})
    out = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def stacks(args) -> str:
    from opsched.mapping.bound import lower_bound
    from opsched.mapping.modules import decompose

    platform = load_platform("diviml")
    parts = []
    for objective, batch in (("latency", 1), ("throughput", 16)):
        rows = []
        for links in (1, 4):
            graph = randwire_stack(10, 10, "er", links=links, seed=1, batch=1)
            problem = build_problem(graph, platform, objective, batch)
            methods = list(HEURISTICS) + (["milp"] if objective == "latency" else []) + ["milp-split"]
            found = run_all(problem, methods, {"sa": args.search, "ea": args.search, "milp": args.milp,
                                               "milp-split": args.split})
            lb = lower_bound(problem, decompose(graph))
            work = work_bound(problem, range(len(graph)), problem.speed_classes())
            best_makespan = min(r["makespan"] for r in found.values())
            if any(r["optimal"] for r in found.values()):
                lb = max(lb, best_makespan)
            fmt = (lambda r: f"{r['makespan']:.3f}") if objective == "latency" else (
                lambda r: f"{1000 * r['value']:.0f}")
            bound = f"{lb:.3f}" if objective == "latency" else f"{1000 * problem.objective_value(lb):.0f}"
            best_heuristic = min(found[m]["makespan"] for m in HEURISTICS if m != "best-device")
            split = found["milp-split"]["makespan"]
            rows.append([f"ER(0.2) N=10, {links}-chan"] + [fmt(found[m]) for m in methods] + [bound,
                         f"{found['best-device']['makespan'] / split:.2f}x", f"{best_heuristic / split:.2f}x",
                         f"{found['best-device']['makespan'] / work:.2f}x", f"{best_heuristic / work:.2f}x",
                         f"{found['milp-split']['seconds']:.1f}"])
        unit = "ms" if objective == "latency" else f"inputs/s, batch {batch}"
        header = ["model"] + methods + ["LB" if objective == "latency" else "UB", "split vs best device",
                                        "split vs best heuristic", "ceiling vs best device",
                                        "ceiling vs best heuristic", "split s"]
        parts.append(table(f"10-module RandWire, {objective} ({unit}), SIMULATED", header, rows))
    return "\n".join(parts)


def speedup(args) -> str:
    platform = load_platform("diviml")
    rows = []
    for modules in args.modules:
        for links in (1, 4):
            graph = randwire_stack(modules, 10, "er", links=links, seed=2)
            problem = build_problem(graph, platform)
            found = run_all(problem, ["milp", "milp-split"], {"milp": args.milp_whole, "milp-split": args.split})
            whole, split = found["milp"], found["milp-split"]
            rows.append([str(modules), str(links), str(len(graph)),
                         f"{whole['seconds']:.1f}" + ("" if whole["optimal"] else " (limit)"),
                         f"{whole['makespan']:.3f}", f"{split['seconds']:.1f}", f"{split['makespan']:.3f}",
                         "yes" if split["optimal"] else "no", f"{whole['seconds'] / split['seconds']:.0f}x"])
    return table("MILP-SPLIT against the whole MILP, latency, SIMULATED", [
        "modules", "channels", "units", "MILP s", "MILP ms", "SPLIT s", "SPLIT ms", "SPLIT proven", "speedup"], rows)


def single_modules(args) -> str:
    from opsched.mapping.bound import lower_bound

    platform = load_platform("diviml")
    rows = []
    for generator in ("ws", "er", "ba"):
        for nodes in (10, 32):
            graph = randwire_stack(1, nodes, generator, seed=3)
            problem = build_problem(graph, platform)
            found = run_all(problem, METHODS, {"sa": args.search, "ea": args.search, "milp": args.milp,
                                               "milp-split": args.split})
            lb = lower_bound(problem)
            rows.append([f"{generator.upper()} N={nodes}"] + [f"{found[m]['makespan']:.3f}" for m in METHODS]
                        + [f"{lb:.3f}", "yes" if found["milp"]["optimal"] else "no"])
    return table("Single RandWire modules, latency (ms), SIMULATED", ["module", *METHODS, "LB", "MILP proven"], rows)


def torchvision_models(args) -> str:
    import torch
    import torchvision

    from opsched.graph.capture import capture
    from opsched.mapping.bound import lower_bound

    platform = load_platform("diviml")
    rows = []
    for name in ("googlenet", "inception_v3", "resnet50", "vgg16", "alexnet"):
        kwargs = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
        model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
        size = 299 if name == "inception_v3" else 224
        graph = capture(model, (torch.randn(1, 3, size, size),), name=name)
        problem = build_problem(graph, platform)
        found = run_all(problem, METHODS, {"sa": args.search, "ea": args.search, "milp": args.milp,
                                           "milp-split": args.split})
        lb = lower_bound(problem)
        work = work_bound(problem, range(len(graph)), problem.speed_classes())
        best = min(found[m]["makespan"] for m in METHODS)
        rows.append([f"{name} ({len(graph)} units)"] + [f"{found[m]['makespan']:.3f}" for m in METHODS]
                    + [f"{lb:.3f}", f"{found['best-device']['makespan'] / best:.2f}x",
                       f"{found['best-device']['makespan'] / work:.2f}x", f"{found['milp-split']['seconds']:.1f}"])
    return table("torchvision models, latency (ms), batch 1, SIMULATED",
                 ["model", *METHODS, "LB", "best vs best device", "ceiling vs best device", "SPLIT s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["stacks", "speedup"],
                        choices=["stacks", "speedup", "modules", "torchvision"])
    parser.add_argument("--search", type=float, default=5.0, help="seconds for SA and EA")
    parser.add_argument("--milp", type=float, default=20.0, help="seconds for the whole MILP beside the heuristics")
    parser.add_argument("--milp-whole", type=float, default=60.0, help="seconds for the whole MILP in speedup")
    parser.add_argument("--split", type=float, default=60.0, help="seconds for MILP-SPLIT")
    parser.add_argument("--modules", nargs="+", type=int, default=[5, 10])
    parser.add_argument("--out", default="mapping_diviml.md", help="where to write the tables")
    args = parser.parse_args()
    sections = {"stacks": stacks, "speedup": speedup, "modules": single_modules, "torchvision": torchvision_models}
    text = "\n".join(sections[s](args) for s in args.sections)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(f"<!-- python benchmarks/mapping_diviml.py --sections {' '.join(args.sections)} -->\n"
                              + text)
    append = appender(Path(args.out).with_suffix(".jsonl"))  # the same tables, with where and when
    for made in TABLES:
        append({**made, "sections": args.sections})
    print(text)


if __name__ == "__main__":
    main()
