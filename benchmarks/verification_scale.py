"""Why verification compares each output at its own scale: the two cases an absolute tolerance gets wrong,
measured here and recorded (docs/runtime.md quotes them).

1. Large outputs: torchvision's Inception V3 with ``init_weights=True`` (truncated-normal weights, no batch norm
   statistics to tame them) at 299 px gives logits around 1e12. Its sequential schedule, run by opsched, differs
   from eager by float32 noise that is large in absolute terms.
2. Small outputs: the next-token probabilities of two unrelated 50,257-word heads (GPT-2's vocabulary) differ
   by little in absolute terms, though one is not the other.

For each: the largest absolute difference, the scaled error of opsched.compare, and the verdict of an absolute
1e-3 and of compare_outputs.

    python benchmarks/verification_scale.py [--out docs/verification_scale.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
import torchvision
from sweep import machine

from opsched.compare import compare_outputs
from opsched.cost.simulate import SimulatedGPU
from opsched.graph.capture import capture
from opsched.runtime.module import OptimizedModule
from opsched.schedulers import make_schedule


def _row(case: str, got, want, **extra) -> dict:
    verdict = compare_outputs(got, want)
    absolute = (got.double() - want.double()).abs().max().item()
    return {"case": case, **machine(), "largest_magnitude": want.abs().max().item(), "max_abs_difference": absolute,
            "scaled_error": verdict.error, "absolute_1e-3_accepts": absolute <= 1e-3, "compare_outputs_accepts":
            verdict.ok, "tolerance": verdict.tolerance, **extra}


def large_outputs() -> dict:
    torch.manual_seed(0)
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=True).eval()
    x = torch.randn(1, 3, 299, 299)
    graph = capture(model, (x,), name="inception_v3 init_weights=True")
    sequential = make_schedule("sequential", graph, SimulatedGPU(graph, "v100"))  # the order alone matters here
    module = OptimizedModule(graph, sequential, torch.get_num_threads())
    with torch.inference_mode():
        want, got = model(x), module(x)
    return _row("inception_v3 init_weights=True, 299 px: opsched's sequential schedule against eager", got, want,
                units=len(graph))


def small_outputs() -> dict:
    torch.manual_seed(0)
    heads = [torch.nn.Sequential(torch.nn.Linear(768, 50257), torch.nn.Softmax(-1)).eval() for _ in range(2)]
    x = torch.randn(1, 768)
    with torch.inference_mode():
        want, got = heads[0](x), heads[1](x)
    return _row("next-token probabilities of two unrelated 50,257-word heads (768 features)", got, want)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/verification_scale.jsonl")
    args = parser.parse_args()
    rows = [large_outputs(), small_outputs()]
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    for r in rows:
        print(f"{r['case']}: largest magnitude {r['largest_magnitude']:.3g}, max abs difference "
              f"{r['max_abs_difference']:.3g}, scaled {r['scaled_error']:.3g}; absolute 1e-3 "
              f"{'accepts' if r['absolute_1e-3_accepts'] else 'rejects'}, compare_outputs "
              f"{'accepts' if r['compare_outputs_accepts'] else 'rejects'}")


if __name__ == "__main__":
    main()
