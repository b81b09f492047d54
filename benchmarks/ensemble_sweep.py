"""Ensembles nobody tuned for, drawn from the single-model sweep's models (benchmarks/sweep.py): copies at batch 1
and 8, pairs and quartets of different architectures, at two image sizes. Each row is ``opsched multi`` run as a
user would (``--peers``, and ``--kernels auto``, opsched multi's default, unless told), in a process of its own: every model verified
against its own forward, opsched's plans and every peer (the models one after another, threads, vmap where the
models allow it, torch.compile of the loop, ONNX Runtime sessions one after another and at the same time) timed
interleaved. Every figure is measured on this machine.

    python benchmarks/ensemble_sweep.py [--kernels auto] [--only TEXT] [--timeout 1800] [--out docs/ensembles]

Rows are appended to OUT.jsonl as they finish (an interrupted sweep resumes); OUT.md is the table.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sweep import chosen_cell, machine

from opsched.multi.optimize import COMPILED_PEERS, MULTI_PEERS

PEERS = (*MULTI_PEERS, *COMPILED_PEERS)

# (label, models, copies, batch, image size)
ENSEMBLES = [
    ("MobileNetV3-small x4", ["torchvision:mobilenet_v3_small"], 4, 1, 64),
    ("MobileNetV3-small x4", ["torchvision:mobilenet_v3_small"], 4, 8, 64),
    ("ResNet-18 x4", ["torchvision:resnet18"], 4, 1, 64),
    ("ResNet-18 x4", ["torchvision:resnet18"], 4, 8, 64),
    ("SqueezeNet 1.1 + ShuffleNet V2 1.0", ["torchvision:squeezenet1_1", "torchvision:shufflenet_v2_x1_0"], 1, 1, 64),
    ("ResNet-18 + timm ResNet-26d", ["torchvision:resnet18", "timm:resnet26d"], 1, 1, 128),
    ("SqueezeNet 1.1, MobileNetV3-small, ShuffleNet V2 1.0, MNASNet 0.5",
     ["torchvision:squeezenet1_1", "torchvision:mobilenet_v3_small", "torchvision:shufflenet_v2_x1_0",
      "torchvision:mnasnet0_5"], 1, 1, 128),
    ("GoogLeNet, ResNet-18, MobileNetV2, EfficientNet-B0",
     ["torchvision:googlenet", "torchvision:resnet18", "torchvision:mobilenet_v2", "torchvision:efficientnet_b0"],
     1, 1, 64),
]


def key(label: str, batch: int, size: int) -> str:
    return f"{label}, batch {batch}, {size} px"


def one(label: str, models: list[str], copies: int, batch: int, size: int, kernels: str, timeout: float,
        where: Path) -> dict:
    """One ensemble through ``opsched multi`` in a process of its own."""
    plan = where / "plan.json"
    plan.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "opsched", "multi", *models, "--copies", str(copies), "--batch", str(batch),
            "--image-size", str(size), "--peers", "--kernels", kernels, "--json", "--out", str(plan)]
    row: dict = {"ensemble": key(label, batch, size), "models": models, "copies": copies, "batch": batch,
                 "image_size": size, "kernels": kernels, **machine()}
    began = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:g} s"}
    row["seconds"] = round(time.perf_counter() - began, 1)
    if done.returncode:
        return {**row, "error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    try:
        out = json.loads(done.stdout)
    except json.JSONDecodeError:  # the JSON is opsched's whole stdout: anything else there is a bug to report
        return {**row, "error": f"stdout is not JSON: {done.stdout[:300]!r}"}
    measured = out["measured_ms"]
    peers = {n: ms for n, ms in measured.items() if n in PEERS}
    own = {n: ms for n, ms in measured.items() if n not in PEERS}
    best_peer, best_own = min(peers, key=peers.get), min(own, key=own.get)
    return {**row, "measured_ms": {n: round(ms, 3) for n, ms in sorted(measured.items(), key=lambda kv: kv[1])},
            "fused": out["fused"], "regions_ms": out.get("regions_ms"), "units": [out["units_before_fusion"], out["units"]],
            "best_peer": best_peer, "best_opsched": best_own, "chosen": out["chosen"],
            "opsched_vs_best_peer": round(peers[best_peer] / own[best_own], 3),
            "opsched_vs_sequential_models": round(measured["sequential_models"] / own[best_own], 2),
            "tie": out["tie"], "noise": out["noise"], "max_error": out["max_error"],
            "max_abs_error": out["max_abs_error"], "warnings": out.get("warnings", [])}


def markdown(rows: list[dict]) -> str:
    lines = [("| ensemble | units | batched (same input / same shape) | best peer | opsched's best | opsched vs best "
              "peer | vs one after another | chosen | noise | max error |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ensemble']} | | | | | | | failed: {r['error']} | | |")
            continue
        m, f = r["measured_ms"], r["fused"]
        lines.append(f"| {r['ensemble']} | {r['units'][0]} -> {r['units'][1]} | {f['same_input']} / {f['same_shape']} | "
                     f"{r['best_peer']} {m[r['best_peer']]:.2f} | {r['best_opsched']} {m[r['best_opsched']]:.2f} | "
                     f"{r['opsched_vs_best_peer']:.2f}x | {r['opsched_vs_sequential_models']:.2f}x | {chosen_cell(r)} | "
                     f"{_noise(r)} | {r.get('max_error', r['max_abs_error']):.1g} |")
    return "\n".join(lines) + "\n"


def _noise(row: dict) -> str:
    """The run's same-program spread (rows measured before it was recorded have none)."""
    noise = row.get("noise")
    return "-" if not noise else f"{100 * noise['same_program_spread']:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="auto", choices=["auto", "eager", "onnxruntime", "inductor"])
    parser.add_argument("--only", default=None, help="only the ensembles whose label holds this text")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a row may take")
    parser.add_argument("--out", default="ensembles", help="OUT.jsonl and OUT.md are written")
    args = parser.parse_args()
    jsonl, md = Path(args.out + ".jsonl"), Path(args.out + ".md")
    done = {}
    if jsonl.exists():
        done = {r["ensemble"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "ensemble" in r}
        other = {r.get("kernels") for r in done.values()} - {args.kernels}
        if other:  # a resumed sweep keeps one kernels setting: its table is labelled with one
            raise SystemExit(f"{jsonl} holds rows with --kernels {', '.join(map(str, sorted(other, key=str)))}, "
                             f"not {args.kernels}: choose another --out")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ensemble-sweep-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    for label, models, copies, batch, size in ENSEMBLES:
        name = key(label, batch, size)
        if (args.only and args.only not in name) or name in done:
            continue
        row = one(label, models, copies, batch, size, args.kernels, args.timeout, work)
        done[name] = row
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    rows = [done[key(label, batch, size)] for label, _, _, batch, size in ENSEMBLES if key(label, batch, size) in done]
    md.write_text(f"Measured on {os.cpu_count()} cores, kernels {args.kernels}; one process per row.\n\n"
                  f"<!-- source: {jsonl} -->\n" + markdown(rows))  # tests/test_figures.py checks the table


if __name__ == "__main__":
    main()
