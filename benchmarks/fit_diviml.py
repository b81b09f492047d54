"""Fit the ``diviml`` platform's costs to DiviML's Table II, and check the fit. SIMULATED.

DiviML measured every operator of a model on each device through torch.fx's Interpreter (its Section V), so a
unit's cost there is its kernels plus what the framework pays per operator; Table II gives the resulting
relative speeds, averaged over the torchvision models and over the RandWire networks it evaluates:

=============  ==========  =========  =========
family         Xeon CPU    T4         A100
=============  ==========  =========  =========
torchvision    223.10 ms   12.16 ms   7.80 ms
RWNNs          183.39 ms   32.58 ms   25.84 ms
=============  ==========  =========  =========

Our devices: the simulated A100 and T4 (their datasheets, ``opsched.cost.simulate``) each plus an overhead per
operator, and the Xeon at a speed per GFLOP plus its own overhead per operator. Four unknowns, and Table II gives
four ratios to the A100 (T4 and CPU, on each family): the T4's two ratios fix both GPUs' overheads, then the CPU's
fix its speed and overhead. The families are the models of the paper's Figures 3 and 4 as this repository builds
them: GoogLeNet, Inception V3, ResNet-50, VGG-16, AlexNet at batch 1; RandWire modules WS(4, 0.75), ER(0.2),
BA(5) of 10 and 32 units (``opsched.mapping.workloads``). Only ratios are fitted: our RandWire modules are far
smaller than the paper's networks, so absolute times differ.

    python benchmarks/fit_diviml.py [--out docs/fit_diviml.jsonl]

prints the fitted figures (put them in ``opsched.mapping.platform.BUILTIN["diviml"]`` and
``opsched.cost.devices.CPUS``) and Table II as the built-in platform gives it once fitted (its four ratios match
the paper's by construction: four figures fitted to four ratios, no check); with ``--out``, the fitted figures and that
table's rows replace what is there, once the run is whole, as JSON lines, with the machine, versions, date and commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from sweep import appender

from opsched.cost.devices import CPUS
from opsched.cost.simulate import SimulatedGPU
from opsched.mapping.platform import load_platform
from opsched.mapping.problem import build_problem
from opsched.mapping.workloads import randwire_stack

# DiviML Table II (ms): family -> device -> time
TABLE_II = {"torchvision": {"cpu": 223.10, "t4": 12.16, "a100": 7.80},
            "RWNNs": {"cpu": 183.39, "t4": 32.58, "a100": 25.84}}


def families() -> dict[str, list]:
    import torch
    import torchvision

    from opsched.graph.capture import capture

    vision = []
    for name in ("googlenet", "inception_v3", "resnet50", "vgg16", "alexnet"):
        kwargs = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
        model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
        size = 299 if name == "inception_v3" else 224
        vision.append(capture(model, (torch.randn(1, 3, size, size),), name=name))
    randwire = [randwire_stack(1, nodes, generator, seed=3) for generator in ("ws", "er", "ba") for nodes in (10, 32)]
    return {"torchvision": vision, "RWNNs": randwire}


def totals(graphs) -> dict[str, float]:
    """A family's summed simulated GPU kernel times (ms), GFLOPs and operator count."""
    return {"a100": sum(sum(SimulatedGPU(g, "a100").latencies) for g in graphs),
            "t4": sum(sum(SimulatedGPU(g, "t4").latencies) for g in graphs),
            "gflops": sum(n.flops for g in graphs for n in g.nodes) / 1e9,
            "ops": sum(max(1, len(n.ops)) for g in graphs for n in g.nodes)}


def fit(sums: dict[str, dict[str, float]]) -> dict[str, float]:
    """Solve the four overheads and speeds from Table II's ratios (linear in them)."""
    f1, f2 = TABLE_II
    t4 = {f: TABLE_II[f]["t4"] / TABLE_II[f]["a100"] for f in TABLE_II}
    cpu = {f: TABLE_II[f]["cpu"] / TABLE_II[f]["a100"] for f in TABLE_II}
    # T4 + o_t * ops = r * (A100 + o_a * ops), per family: unknowns (o_a, o_t)
    a = np.array([[-t4[f] * sums[f]["ops"], sums[f]["ops"]] for f in (f1, f2)])
    b = np.array([t4[f] * sums[f]["a100"] - sums[f]["t4"] for f in (f1, f2)])
    o_a, o_t = np.linalg.solve(a, b)
    # c * gflops + o_c * ops = r * (A100 + o_a * ops): unknowns (c, o_c)
    a = np.array([[sums[f]["gflops"], sums[f]["ops"]] for f in (f1, f2)])
    b = np.array([cpu[f] * (sums[f]["a100"] + o_a * sums[f]["ops"]) for f in (f1, f2)])
    c, o_c = np.linalg.solve(a, b)
    fitted = {"a100 op_overhead": o_a, "t4 op_overhead": o_t, "xeon ms_per_gflop": c, "cpu op_overhead": o_c}
    if min(fitted.values()) < 0:  # no device runs faster for having more operators: this cost model does not fit
        raise SystemExit(f"the fit needs a negative figure, so this cost model cannot explain Table II: {fitted}")
    return fitted


def fitted_table(graphs_by_family) -> dict[str, dict[str, float]]:
    """Table II's averages as the built-in platform costs the families (ms per model, SIMULATED)."""
    platform = load_platform("diviml")
    out = {}
    for family, graphs in graphs_by_family.items():
        sums = dict.fromkeys(platform.names, 0.0)
        for graph in graphs:
            problem = build_problem(graph, platform)
            for d, name in enumerate(platform.names):
                sums[name] += sum(problem.times[u][d][0] for u in range(len(graph)))
        out[family] = {name: t / len(graphs) for name, t in sums.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON lines of the fitted figures and Table II, replaced once the run is whole")
    args = parser.parse_args()
    partial = Path(args.out + ".partial") if args.out else None  # the record is replaced only by a whole run
    if partial:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    append = appender(partial) if partial else None
    graphs = families()
    fitted = fit({f: totals(g) for f, g in graphs.items()})
    if append:
        append({"fitted": {k: float(v) for k, v in fitted.items()}, "simulated": True})
    print("fitted:", ", ".join(f"{k} {v:.5g}" + (" ms" if "overhead" in k else "") for k, v in fitted.items()))
    print(f"built in: xeon ms_per_gflop {CPUS['xeon'].ms_per_gflop}, "
          + ", ".join(f"{d.name} op_overhead {d.op_overhead} ms" for d in load_platform("diviml").devices))
    print("\n| family | device | DiviML Table II (ms) | ratio to the A100 | built-in platform, SIMULATED (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    ours = fitted_table(graphs)
    for family, row in TABLE_II.items():
        for device, ms in row.items():
            print(f"| {family} | {device} | {ms:.2f} | {ms / row['a100']:.2f}x | {ours[family][device]:.3f} | "
                  f"{ours[family][device] / ours[family]['a100']:.2f}x |")
            if append:
                append({"family": family, "device": device, "simulated": True, "table_ii_ms": ms,
                        "table_ii_ratio": ms / row["a100"], "builtin_ms": ours[family][device],
                        "builtin_ratio": ours[family][device] / ours[family]["a100"]})
    if partial:
        partial.replace(args.out)


if __name__ == "__main__":
    main()
