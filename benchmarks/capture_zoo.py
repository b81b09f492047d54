"""Capture every zoo model at its full input size and print units, edges, blocks, widest block and the
capture time (median of --repeats captures, model construction not included). Measured on this machine; each
model's row, with the machine, versions, date and commit, is appended to --out (docs/models.md's table).

    python benchmarks/capture_zoo.py [--repeats 3] [--batch 1] [--out docs/capture_zoo.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import time

from sweep import appender, machine

import opsched
from opsched.graph.blocks import split_blocks
from opsched.models import load_model

MODELS = ["inception_v3", "squeezenet", "nasnet", "randwire", "torchvision:googlenet"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default="docs/capture_zoo.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    where, append = machine(), appender(args.out)
    print(f"machine: {where['machine']}, {where['versions']}; all figures measured")
    print("| model | input | units | edges | width | blocks | widest block | largest block | GFLOPs | capture s (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in MODELS:
        loaded = load_model(spec, batch=args.batch)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            graph = opsched.capture(loaded.model, loaded.inputs, name=spec)
            times.append(time.perf_counter() - start)
        blocks = split_blocks(graph)
        widest = max(graph.width_of(b.mask) for b in blocks)
        row = {"model": spec, "input": "x".join(map(str, loaded.inputs[0].shape)), "units": len(graph),
               "edges": len(graph.edges), "width": graph.width, "blocks": len(blocks), "widest_block": widest,
               "largest_block": max(len(b) for b in blocks), "gflops": round(graph.flops / 1e9, 2),
               "capture_s": [round(t, 3) for t in times], "capture_s_median": round(statistics.median(times), 3)}
        append(row)
        print(f"| {spec} | {row['input']} | {row['units']} | {row['edges']} | {row['width']} | {row['blocks']} | "
              f"{widest} | {row['largest_block']} | {row['gflops']:.2f} | {row['capture_s_median']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
