"""Capture every zoo model at its full input size and print units, edges, blocks, widest block and the
capture time (median of --repeats captures, model construction not included). Measured on this machine.

    python benchmarks/capture_zoo.py [--repeats 3] [--batch 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import opsched
from opsched.graph.blocks import split_blocks
from opsched.models import load_model

MODELS = ["inception_v3", "squeezenet", "nasnet", "randwire", "torchvision:googlenet"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; all figures measured")
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
        shape = "x".join(map(str, loaded.inputs[0].shape))
        print(f"| {spec} | {shape} | {len(graph)} | {len(graph.edges)} | {graph.width} | {len(blocks)} | {widest} | "
              f"{max(len(b) for b in blocks)} | {graph.flops / 1e9:.2f} | {statistics.median(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
