"""Whether a plan's oneDNN-reordered convolution weights could serve other batch sizes (measured): a model's
sequential plan at batch ``B``, its weights reordered for ``B`` (what opsched does) against reordered for batch
``R`` (what one set of reordered weights shared by every batch size's plan would do), timed interleaved in one
process, medians.

oneDNN picks a weight layout for the convolution's input shape, batch included; a weight in another layout is
reordered again inside the call. Every row goes to ``--out`` as a JSON line with the machine, versions, date and
commit.

    python benchmarks/packed_batch.py --cases torchvision:resnet18:64:8:1 torchvision:inception_v3:128:8:1 --out docs/packed_batch.jsonl
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from sweep import appender


def plan_of(model: torch.nn.Module, x: torch.Tensor, reordered_for: int | None) -> torch.nn.Module:
    """The sequential plan of ``model`` at ``x``, its convolution weights reordered for batch ``reordered_for``
    (None: for ``x``'s own)."""
    import opsched
    from opsched.runtime import packed

    real = packed._REORDER
    if reordered_for is not None:
        packed._REORDER = lambda w, p, s, d, g, size: real(w, p, s, d, g, [reordered_for, *size[1:]])
    try:
        result = opsched.optimize(copy.deepcopy(model), (x,), kernels="eager", method="sequential", repeats=3,
                                  cache=False)
        plan = result.evaluation.modules["sequential"]
        with torch.no_grad():
            plan(x)  # the weights are reordered at the first call
    finally:
        packed._REORDER = real
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["torchvision:resnet18:64:8:1", "torchvision:inception_v3:128:8:1"],
                        help="MODEL:PX:B:R (a model as opsched optimize takes it, image size, batch, batch reordered for)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default="docs/packed_batch.jsonl")
    args = parser.parse_args()
    from opsched.models import load_model

    torch.set_num_threads(2)
    append = appender(args.out)
    for case in args.cases:
        name, px, batch, other = case.rsplit(":", 3)
        model = load_model(name).model
        x = torch.randn(int(batch), 3, int(px), int(px))
        own, shared = plan_of(model, x, None), plan_of(model, x, int(other))
        times: dict[str, list[float]] = {"own_ms": [], "reordered_for_other_ms": []}
        with torch.no_grad():
            for _ in range(args.rounds):
                for key, plan in (("own_ms", own), ("reordered_for_other_ms", shared)):
                    began = time.perf_counter()
                    plan(x)
                    times[key].append((time.perf_counter() - began) * 1000)
        row = {"model": name, "image_size": int(px), "batch": int(batch), "reordered_for": int(other),
               "rounds": args.rounds, **{k: round(statistics.median(v), 3) for k, v in times.items()}}
        row["ratio"] = round(row["reordered_for_other_ms"] / row["own_ms"], 3)
        print(append(row), flush=True)


if __name__ == "__main__":
    main()
