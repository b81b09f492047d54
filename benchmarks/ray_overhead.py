"""What the Ray engine costs over the local engine, on this machine (measured).

One local Ray is started with two nodes, n0 and n1, and every plan puts one 1-thread CPU device on each. Each
plan runs on the local engine (the devices as threads of this process) and on Ray in four forms, every output
checked against the local engine's:

- ``compiled graph``: a call per segment (a device's units between values crossing devices), bound once into a
  Ray Compiled Graph: the engine's default;
- ``remote calls``: the same calls as Ray remote calls, submitted for each inference;
- ``... per unit``: the same, but a call per unit.

Each form is timed interleaved with the local engine (medians of ``--repeats`` rounds), one form alive at a
time: an actor waiting in a Compiled Graph polls, and would slow down what is timed beside it.

GoogLeNet's plan is also run with both devices on node n0, where the engine's default is one actor running
both devices as the local engine does, an inference one call: as remote calls (the default there), as a
Compiled Graph, and, for comparison, as actors per device.

Plans: GoogLeNet (torchvision, random weights, ``--image-size``) and a chain of convolutions, both mapped with
HEFT onto the two devices; and two synthetic plans of ``--units`` trivial units (each adds 1 to a one-element
tensor) in a chain, all on one device (no value crosses devices) or alternating between the two (every value
crosses). From those two, per form: the overhead per inference, per unit and per value crossing devices.

    python benchmarks/ray_overhead.py [--repeats 15] [--units 50] [--image-size 64] [--out docs/ray_overhead.jsonl]

Every plan's figures, and the overheads derived from them, are appended to --out as JSON lines with the machine,
versions, date and commit (docs/ray.md's tables).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch
from sweep import appender

from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.runtime.module import OptimizedModule
from opsched.runtime.program import compile_program
from opsched.runtime.ray import RayModule, cut_segments, ray_cluster
from opsched.schedule import DevicesSection, OpTiming, Schedule
from opsched.timing import interleaved_samples

PLATFORM = {"name": "two-nodes", "devices": [{"name": "cpu0", "kind": "cpu", "node": "n0", "threads": 1},
                                             {"name": "cpu1", "kind": "cpu", "node": "n1", "threads": 1}],
            "links": {"default": {"bandwidth": "inf", "latency": 0.0}}}
ONE_NODE = {**PLATFORM, "name": "one-node", "devices": [{**d, "node": "n0"} for d in PLATFORM["devices"]]}
FORMS = {"compiled graph": {"compiled": True}, "remote calls": {"compiled": False},
         "compiled graph per unit": {"compiled": True, "per_unit": True},
         "remote calls per unit": {"compiled": False, "per_unit": True}}
NODE_FORMS = {"node's actor, remote calls": {}, "node's actor, compiled": {"compiled": True},
              "actors per device, compiled": {"actors": "device", "compiled": True}}


def add_one(x):
    return x + 1.0


def synthetic(units: int, alternate: bool) -> tuple[Graph, Schedule]:
    """A chain of ``units`` trivial units, all on device 0 or alternating between the two devices."""
    graph = Graph([Node(f"u{i}", args=("x",) if i == 0 else (f"u{i - 1}",), latency=1.0, run=add_one)
                   for i in range(units)], inputs=["x"], name=f"chain-{units}")
    ops = [OpTiming(f"u{i}", i % 2 if alternate else 0, float(i), float(i + 1)) for i in range(units)]
    return graph, Schedule("synthetic", graph.name, graph.fingerprint, ops, float(units), cost="measured",
                           device="platform:two-nodes", batch=1, bounds={"lower_bound": 0.0},
                           devices=DevicesSection(PLATFORM))


def heft_plan(model: torch.nn.Module, x: torch.Tensor, name: str, platform: dict = PLATFORM) -> tuple[Graph, Schedule]:
    """``model`` captured and mapped with HEFT onto the two devices, its units measured at 1 thread."""
    from opsched.mapping.plan import to_schedule
    from opsched.mapping.platform import platform_from_dict
    from opsched.mapping.problem import build_problem
    from opsched.mapping.solve import solve
    from opsched.runtime.profile import measured_cost

    graph = capture(model, (x,), name=name)

    def measure(device, threads):
        cost = measured_cost(graph, (x,), cores=threads, repeats=5)
        return [cost.latency[threads][u] for u in range(len(graph))]

    problem = build_problem(graph, platform_from_dict(platform, platform["name"]), measure=measure)
    solved = solve(problem, "heft")
    return graph, to_schedule(problem, solved.mapping, solved.timeline, "heft", solved.lower_bound, solved.optimal, {})


def conv_chain() -> torch.nn.Module:
    layers = [torch.nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(12):
        layers += [torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1)]
    return torch.nn.Sequential(*layers).eval()


def compare(graph: Graph, plan: Schedule, x: torch.Tensor, repeats: int,
            forms: dict[str, dict] = FORMS) -> dict[str, tuple[float, float, float, int]]:
    """For each form on Ray: (its median milliseconds, the local engine's median interleaved with it, the
    seconds it took to set up: actors started, units loaded, graph compiled; the calls an inference makes). One
    form is alive at a time: an actor waiting in a Compiled Graph polls, and would slow down whatever else is
    timed beside it."""
    local = OptimizedModule(graph, plan, cores=2)
    with torch.inference_mode():
        want = local(x)

    def runner(module):
        def run():
            with torch.inference_mode():
                module(x)
        return run

    measured = {}
    for name, options in forms.items():
        started = time.perf_counter()
        with RayModule(graph, plan, **options) as module:
            setup = time.perf_counter() - started
            if not torch.allclose(module(x), want, atol=1e-5):
                raise SystemExit(f"{name}: the outputs differ from the local engine's")
            on_ray, on_local = interleaved_samples([runner(module), runner(local)], repeats, warmup=3)
        measured[name] = (statistics.median(on_ray), statistics.median(on_local), setup,
                          len(graph) if options.get("per_unit") else len(module.segments))
    local.close()
    return measured


def report(label: str, graph: Graph, plan: Schedule, measured: dict[str, tuple[float, float, float, int]],
           record: Any) -> None:
    program = compile_program(plan, graph, 1)
    segments = cut_segments(program)
    crossing = sum(1 for s in segments for slot in s.imports if slot >= len(graph.inputs))
    print(f"\n{label}: {len(graph)} units, {crossing} values crossing devices, {len(segments)} segments")
    record({"plan": label, "units": len(graph), "crossing": crossing, "segments": len(segments),
            "forms": {name: {"ray_ms": round(ms, 4), "local_ms": round(local, 4), "setup_s": round(setup, 2),
                             "calls": calls} for name, (ms, local, setup, calls) in measured.items()}})
    for name, (ms, local, setup, calls) in measured.items():
        print(f"  {name:<28} {ms:8.2f} ms against local {local:6.2f} ms ({ms / local:4.1f}x), {calls} calls, "
              f"set up in {setup:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--units", type=int, default=50)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--out", default="docs/ray_overhead.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    append = appender(args.out)

    def record(row: dict) -> None:
        append({**row, "repeats": args.repeats})

    torch.manual_seed(0)
    torch.set_num_threads(2)
    import torchvision

    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; every figure measured, the "
          f"median of {args.repeats} interleaved runs")
    started = time.perf_counter()
    with ray_cluster(["n0", "n1"], cpus=2) as where:
        import ray

        print(f"ray {ray.__version__}: {where}, started in {time.perf_counter() - started:.1f} s")
        size = args.image_size
        image, small = torch.randn(1, 3, size, size), torch.randn(1, 3, 32, 32)
        googlenet = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
        cases = [(f"GoogLeNet {size}x{size}, HEFT", *heft_plan(googlenet, image, "googlenet"), image),
                 ("conv chain 32x32, HEFT", *heft_plan(conv_chain(), small, "conv-chain"), small),
                 (f"{args.units} trivial units on one device", *synthetic(args.units, False), torch.zeros(1)),
                 (f"{args.units} trivial units alternating", *synthetic(args.units, True), torch.zeros(1))]
        measured = []
        for label, graph, plan, x in cases:
            measured.append(compare(graph, plan, x, args.repeats))
            report(label, graph, plan, measured[-1], record)
        graph, plan = heft_plan(googlenet, image, "googlenet", ONE_NODE)
        report(f"GoogLeNet {size}x{size}, HEFT, both devices on node n0", graph, plan,
               compare(graph, plan, image, args.repeats, NODE_FORMS), record)
    n = args.units
    one, alternating = measured[2], measured[3]
    print(f"\nRay's overhead over the local engine, from the synthetic plans ({n} units; measured):")
    print(f"  {'form':<24} {'per inference':>14} {'per unit':>10} {'per value crossing':>19}")
    for name in FORMS:
        on_one = one[name][0] - one[name][1]
        crossing = (alternating[name][0] - alternating[name][1] - on_one) / (n - 1) * 1000.0
        record({"overhead": name, "units": n, "per_inference_ms": round(on_one, 4),
                "per_unit_us": round(on_one / n * 1000.0, 1), "per_crossing_us": round(crossing, 1)})
        print(f"  {name:<24} {on_one:11.2f} ms {on_one / n * 1000.0:7.0f} us {crossing:16.0f} us")


if __name__ == "__main__":
    main()
