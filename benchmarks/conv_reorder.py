"""What reordering the convolutions' weights for oneDNN once (the ``packed`` kernel, opsched/runtime/packed.py)
gains on this CPU, measured: each model's sequential plan (every unit in order) run with its units on eager
kernels (``plain``) and with the convolutions reordered (``reordered``, the default choice), beside eager PyTorch,
all verified against the model and timed interleaved (medians of --repeats rounds, the run's noise floor
beside them), at --threads intra-op threads. One JSON line per model, with the machine, versions, date and
commit, is appended to --out (docs/runtime.md's table).

    python benchmarks/conv_reorder.py [--threads 2] [--repeats 9] [--out docs/conv_reorder.jsonl]
"""

from __future__ import annotations

import argparse

import torch
from sweep import appender

from opsched.cost.simulate import SimulatedGPU
from opsched.evaluation import Candidate, evaluate, module_runner, reference_outputs
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.peers import eager
from opsched.runtime.kernels import ChosenKernels, kernels_for
from opsched.runtime.module import OptimizedModule
from opsched.schedulers import make_schedule

# (model, batch, image size): torchvision unless timm:
MODELS = [("torchvision:resnet18", 2, 112), ("torchvision:googlenet", 1, 224), ("inception_v3", 1, 299),
          ("torchvision:mobilenet_v2", 1, 224), ("torchvision:mobilenet_v3_small", 1, 224),
          ("torchvision:efficientnet_b0", 1, 224), ("torchvision:regnet_x_400mf", 1, 224),
          ("torchvision:shufflenet_v2_x1_0", 1, 224), ("torchvision:densenet121", 1, 224),
          ("torchvision:squeezenet1_1", 1, 224), ("torchvision:resnet50", 1, 224),
          ("torchvision:convnext_tiny", 1, 224), ("timm:resnet26d", 1, 128), ("timm:mixnet_s", 1, 224),
          ("torchvision:vit_b_16", 1, 224)]


def one(spec: str, batch: int, size: int, threads: int, repeats: int) -> dict:
    torch.manual_seed(0)
    loaded = load_model(spec, batch=batch, image_size=size)
    model, inputs = loaded.model.eval(), tuple(loaded.inputs)
    graph = capture(model, inputs, name=spec)
    schedule = make_schedule("sequential", graph, SimulatedGPU(graph, "v100"))  # the order alone: costs unused
    reordered = kernels_for(graph)
    plain = ChosenKernels({name: "eager" for name in reordered.choice})
    candidates = [*eager(model, inputs, threads)]
    for name, kernels in (("plain", plain), ("reordered", reordered)):
        module = OptimizedModule(graph, schedule, threads, kernels)
        candidates.append(Candidate(name, module_runner(module, inputs, threads)))
    verified = evaluate(candidates, reference_outputs(model, inputs, threads), repeats=repeats)
    ms = verified.measured_ms
    return {"model": spec, "batch": batch, "image": size, "threads": threads, "units": len(graph),
            "packed_units": sum(kernel == "packed" for kernel in reordered.choice.values()),
            "measured_ms": {k: round(v, 4) for k, v in ms.items()}, "errors": verified.errors,
            "dropped": verified.dropped, "noise_floor": verified.noise_floor,
            "reordered_over_plain": verified.ratio("plain", "reordered") if {"plain", "reordered"} <= set(ms) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", nargs="+", help="model specs among the defaults (default: all)")
    parser.add_argument("--out", default="docs/conv_reorder.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    append = appender(args.out)
    print("| model | batch, image | eager ms | plain ms | reordered ms | plain / reordered [99% interval] | noise |")
    print("|---|---|---|---|---|---|---|")
    for spec, batch, size in MODELS:
        if args.models and spec not in args.models:
            continue
        row = append(one(spec, batch, size, args.threads, args.repeats))
        ms, ratio = row["measured_ms"], row["reordered_over_plain"] or {}
        print(f"| {spec} | {batch}, {size} px | {ms.get('eager', float('nan')):.2f} | {ms.get('plain', float('nan')):.2f} "
              f"| {ms.get('reordered', float('nan')):.2f} | {ratio.get('ratio', float('nan')):.2f}x "
              f"[{ratio.get('low', float('nan')):.2f}, {ratio.get('high', float('nan')):.2f}] "
              f"| {100 * (row['noise_floor'] or 0):.1f}% |", flush=True)


if __name__ == "__main__":
    main()
