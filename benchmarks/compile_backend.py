"""``torch.compile(model, backend="opsched")`` against the model itself, with and without ``freeze``.

For each configuration: the first call (capture, profile, schedule, verify, time against the graph), then 30
rounds alternating the model, the compiled model and the model again (the same program timed twice: the run's
noise), medians. One JSON line per configuration appended to ``--out``.

    python benchmarks/compile_backend.py [--models resnet18 googlenet] [--size 64] [--out docs/compile_backend.jsonl]
"""

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torchvision
from sweep import machine


def measure(name: str, size: int, freeze: bool) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    extra = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **extra).eval()
    x = torch.randn(1, 3, size, size)
    fast = torch.compile(model, backend="opsched", options={"freeze": freeze})
    started = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fast(x)
    first = time.perf_counter() - started
    samples = {"model": [], "compiled": [], "model again": []}
    with torch.no_grad():
        want = model(x)
        for _ in range(30):
            for label, run in (("model", model), ("compiled", fast), ("model again", model)):
                began = time.perf_counter()
                run(x)
                samples[label].append((time.perf_counter() - began) * 1e3)
    ms = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    return {"model": name, "size": size, "freeze": freeze, **machine(), "first_call_s": round(first, 2),
            "median_ms": ms, "compiled_vs_model": round(ms["model"] / ms["compiled"], 3),
            "same_program_spread": round(abs(ms["model"] - ms["model again"]) / ms["model"], 4),
            "max_error": float((got - want).abs().max() / want.abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "googlenet"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default="docs/compile_backend.jsonl")
    args = parser.parse_args()
    for name in args.models:
        for freeze in (False, True):
            row = measure(name, args.size, freeze)
            with Path(args.out).open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
