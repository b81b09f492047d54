"""Several models at once (HiveMind), MEASURED on this machine through the one runner (every model verified
against its own forward, configurations timed interleaved, medians), with SIMULATED GPU rows labelled as such.

Cases: K in {2, 4, 8, 16} copies of a small CNN at batch 1 and 16; sixteen copies of another small CNN nobody
tuned for; sixteen copies whose layers are named differently in each; ResNet-18 copies at batch 2; the
ResNet-18s of torchvision and timm; eight models sharing a feature extractor (different heads, one input);
the rewrites switched on one kind at a time (the IOS-style ablation) on sixteen copies; training eight small
CNNs at batch 4 and 16, fused against one after another and against the vmap program (``--training-only``:
just those, ``--threads`` of them);
HiveMind's scheduler on a simulated V100. Writes a JSON line per case to ``--out`` (default multi.jsonl), a
markdown table to ``--markdown`` and a bar chart to ``--plot``.

    python benchmarks/multi.py --out docs/multi.jsonl --plot docs/multi.png   (the table: multi-results.md)
    python benchmarks/multi.py --only "other small"   (the measured cases whose name holds the text)
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from pathlib import Path

import torch
from sweep import machine

from opsched.multi.optimize import MULTI_PEERS, optimize
from opsched.multi.train import compare_training


def small_cnn(classes: int = 10) -> torch.nn.Module:
    """Conv-BN-ReLU-pool, conv-ReLU, global pool, linear: the kind of model HiveMind's sweeps train."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(32, classes)).eval()


def other_cnn(classes: int = 5) -> torch.nn.Module:
    """A small CNN nobody here tuned for: 5x5 conv-ReLU-avgpool, conv-BN-ReLU, global max pool, linear."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 5, padding=2), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, classes)).eval()


def copies(make, count: int, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [make().eval() for _ in range(count)]


def renamed_copies(make, count: int, seed: int = 0) -> list[torch.nn.Module]:
    """Copies whose layers are named differently in each (fine-tuned copies from different hands): the same
    computation, no module path in common."""
    from collections import OrderedDict

    return [torch.nn.Sequential(OrderedDict((f"copy{k}_layer{j}", m) for j, m in enumerate(model))).eval()
            for k, model in enumerate(copies(make, count, seed))]


def torchvision_and_timm_resnet18() -> list[torch.nn.Module]:
    """ResNet-18 from torchvision and from timm: one architecture, two libraries' module names."""
    import timm
    import torchvision

    torch.manual_seed(0)
    return [torchvision.models.resnet18().eval(), timm.create_model("resnet18").eval()]


def shared_extractor(count: int = 8) -> list[torch.nn.Module]:
    import torchvision

    torch.manual_seed(0)
    trunk = torchvision.models.resnet18()
    extractor = torch.nn.Sequential(*list(trunk.children())[:-1], torch.nn.Flatten())
    return [torch.nn.Sequential(extractor, torch.nn.Linear(512, 10)).eval() for _ in range(count)]


def resnet18_copies(count: int = 4) -> list[torch.nn.Module]:
    import torchvision

    return copies(torchvision.models.resnet18, count)


def measure(name: str, models, x, repeats: int, **options) -> dict:
    started = time.perf_counter()
    result = optimize(models, (x,), methods=options.pop("methods", ("sequential", "lios", "hivemind")),
                      repeats=repeats, **options)
    ev = result.outcome.evaluation
    row = {"case": name, "models": len(models), "batch": int(x.shape[0]), "fused": result.fusion.fused,
           "units": [len(result.fusion.combined), len(result.fusion.graph)],
           "measured_ms": {k: round(v, 3) for k, v in ev.measured_ms.items()}, "chosen": ev.chosen,
           "dropped": ev.dropped, "max_abs_error": max(result.model_errors) if result.model_errors else None,
           "seconds": round(time.perf_counter() - started, 1)}
    best_schedule = ev.fastest("schedule")

    def speedup(over: str, of: str) -> float:
        # over the rounds both were timed in: a configuration the race left out has the median of its first rounds
        return round(ev.ratio(over, of)["ratio"], 2)

    row["best_opsched_ms"] = round(ev.measured_ms[best_schedule], 3) if best_schedule else None
    row["opsched_vs_sequential_models"] = speedup("sequential_models", best_schedule) if best_schedule else None
    row["chosen_vs_sequential_models"] = speedup("sequential_models", ev.chosen)
    if "vmap" in ev.measured_ms and best_schedule:
        row["opsched_vs_vmap"] = speedup("vmap", best_schedule)
    return row


def training(batch: int, cores: int | None = None) -> dict:
    """Eight small CNNs trained 20 SGD steps (rates 0.01 ... 0.08): the fused step (the channel-stacked program)
    against one after another and against the vmap program, the three interleaved step by step."""
    result = compare_training(copies(small_cnn, 8), (torch.randn(batch, 3, 32, 32),), steps=20, cores=cores,
                              lrs=[0.01 * (k + 1) for k in range(8)], also=("vmap",))
    return {"case": f"training small CNN x8 b{batch}", "threads": torch.get_num_threads(), **result}


WITH_COMPILE = {"peers": (*MULTI_PEERS, "torch_compile")}  # torch.compile of the loop: minutes to compile


def cases(quick: bool):
    counts = (2, 16) if quick else (2, 4, 8, 16)
    for batch in (1, 16):
        for k in counts:
            yield f"small CNN x{k}", lambda k=k: copies(small_cnn, k), torch.randn(batch, 3, 32, 32), \
                WITH_COMPILE if k == 16 else {}
    yield "other small CNN x16", lambda: copies(other_cnn, 16, seed=1), torch.randn(1, 3, 32, 32), {}
    yield "small CNN x16, layers renamed in every copy", lambda: renamed_copies(small_cnn, 16), \
        torch.randn(1, 3, 32, 32), {}
    yield "ResNet-18 x2", lambda: resnet18_copies(2), torch.randn(2, 3, 224, 224), {}
    yield "ResNet-18 of torchvision and of timm", torchvision_and_timm_resnet18, torch.randn(2, 3, 112, 112), {}
    yield "8 heads on one ResNet-18 trunk", shared_extractor, torch.randn(1, 3, 224, 224), WITH_COMPILE
    for rewrites in ((), ("same_input",), ("same_shape",), ("same_input", "same_shape")):
        label = "+".join(rewrites) or "no rewrite"
        yield f"ablation x16 b1: {label}", lambda: copies(small_cnn, 16), torch.randn(1, 3, 32, 32), \
            {"rewrites": ("shared", *rewrites)}


def simulated_rows() -> list[dict]:
    rows = []
    for k in (4, 16):
        result = optimize(copies(small_cnn, k), (torch.randn(16, 3, 32, 32),), methods=("sequential", "hivemind"),
                          cost="sim:v100", cache=False)
        predicted = {m: s.predicted_latency for m, s in result.outcome.schedules.items()}
        rows.append({"case": f"SIMULATED v100: small CNN x{k} b16", "predicted_ms": {
            "sequential_models": round(result.predicted_sequential_ms, 4),
            **{m: round(v, 4) for m, v in predicted.items()}}, "fused": result.fusion.fused,
            "hivemind_vs_sequential_models": round(result.predicted_sequential_ms / predicted["hivemind"], 2)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [("| case | batch | units | fused (shared / same input / same shape) | sequential_models ms | threads ms | "
              "vmap ms | torch.compile of the loop ms | best opsched ms | opsched vs sequential | opsched vs vmap | "
              "chosen | max error |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "measured_ms" not in r:
            continue
        m = r["measured_ms"]
        f = r["fused"]
        lines.append(f"| {r['case']} | {r['batch']} | {r['units'][0]} -> {r['units'][1]} | {f['shared']} / "
                     f"{f['same_input']} / {f['same_shape']} | {m.get('sequential_models', '-')} | "
                     f"{m.get('threads', '-')} | {m.get('vmap', '-')} | {m.get('torch_compile', '-')} | "
                     f"{round(r['best_opsched_ms'], 3)} | "
                     f"{r['opsched_vs_sequential_models']}x | {r.get('opsched_vs_vmap', '-')}"
                     f"{'x' if 'opsched_vs_vmap' in r else ''} | {r['chosen']} | {r['max_abs_error']:.1g} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "measured_ms" in r and not r["case"].startswith("ablation")]
    names = [f"{textwrap.fill(r['case'], 16)}\nb{r['batch']}" for r in measured]
    series = ["threads", "vmap", "torch_compile", "opsched"]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 1.1), 4.5))
    width = 0.8 / len(series)
    for j, s in enumerate(series):
        values = []
        for r in measured:
            m = r["measured_ms"]
            ms = r["best_opsched_ms"] if s == "opsched" else m.get(s)
            values.append(m["sequential_models"] / ms if ms else 0)
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(names))], values, width, label=s)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("speedup over sequential_models (measured)")
    ax.set_title(f"Several models at once, MEASURED on this CPU ({os.cpu_count()} cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="multi.jsonl")
    parser.add_argument("--markdown", default="multi-results.md")
    parser.add_argument("--plot", default="multi.png")
    parser.add_argument("--only", default=None, help="only the measured cases whose name holds this text")
    parser.add_argument("--training-only", action="store_true",
                        help="only the training case, appended to --out")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads for --training-only")
    args = parser.parse_args()
    where = machine()
    if args.training_only:  # appended to --out: runs at 1 and 2 threads go to one record
        with open(args.out, "a") as out:
            for batch in (16, 4):
                row = {**training(batch, args.threads), **where}
                out.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
        return
    rows = []
    with open(args.out, "w") as out:
        def emit(row: dict) -> None:
            row = {**row, **where}
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

        emit({"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "threads": torch.get_num_threads()})
        for name, make, x, options in cases(args.quick):
            if args.only is None or args.only in name:
                emit(measure(name, make(), x, args.repeats, cache=False, **options))
        if args.only is not None:
            return
        for batch in (4, 16):
            emit(training(batch))
        for row in simulated_rows():
            emit(row)
    Path(args.markdown).write_text(markdown(rows))
    plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
