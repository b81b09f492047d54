"""The README's "Measured on this machine" table: `opsched optimize MODEL --kernels K` (which adds the peers:
eager, torch.compile with freezing, ONNX Runtime) for GoogLeNet and Inception V3, each configuration verified
against eager and timed interleaved in one run, with the run's noise. Every figure is measured here.

    python benchmarks/readme_table.py [--models torchvision:googlenet inception_v3] [--kernels onnxruntime]
                                      [--out docs/readme_table.jsonl]

Appends one JSON line per model to OUT (with the machine, versions and date) and prints the markdown table the
README quotes; tests/test_figures.py checks that every number in the README's tables is in a committed record.
"""

import argparse
import json
import time
from pathlib import Path

from sweep import chosen_cell, machine

import opsched
from opsched.models import load_model


def one(spec: str, kernels: str, repeats: int) -> dict:
    loaded = load_model(spec, batch=1)
    began = time.perf_counter()
    outcome = opsched.optimize(loaded.model.eval(), tuple(loaded.inputs), kernels=kernels, peers=True,
                               repeats=repeats, name=loaded.name)
    ev = outcome.evaluation
    plan, peer = ev.fastest("schedule"), ev.fastest("peer")
    return {"model": spec, "input_shape": list(loaded.inputs[0].shape), "kernels": kernels, **machine(),
            "measured_ms": {k: round(v, 1) for k, v in ev.measured_ms.items()},
            "predicted_ms": {k: round(s.predicted_latency, 1) for k, s in outcome.schedules.items()},
            "chosen": ev.chosen, "tie": ev.tie, "noise": ev.noise(), "best_plan": plan, "best_peer": peer,
            "plan_over_peer": ev.ratio(plan, peer), "errors": ev.errors, "dropped": ev.dropped,
            "seconds": round(time.perf_counter() - began, 1)}


def table(rows: list[dict]) -> str:
    lines = [("| | eager | torch.compile (freezing) | ONNX Runtime | opsched's best plan | plan time / fastest peer's "
              "(99% interval) | chosen |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, ratio = r["measured_ms"], r["plan_over_peer"]
        lines.append(
            f"| {r['model']} | {ms.get('eager', '-')} ms | {ms.get('torch_compile', '-')} ms | "
            f"{ms.get('onnxruntime', '-')} ms | {ms[r['best_plan']]} ms ({r['best_plan']}; predicted "
            f"{r['predicted_ms'][r['best_plan']]}) | {ratio['ratio']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}] "
            f"{r['best_peer']} | {chosen_cell(r)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["torchvision:googlenet", "inception_v3"])
    parser.add_argument("--kernels", default="onnxruntime")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="docs/readme_table.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    rows = []
    for spec in args.models:
        row = one(spec, args.kernels, args.repeats)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
    print(table(rows))


if __name__ == "__main__":
    main()
