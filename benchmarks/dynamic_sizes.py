"""A plan per size along a dimension declared dynamic (issue 36): how long each new size's plan takes to make,
with ``dynamic_shapes`` (the first schedule captured, compiled, verified and timed at the new size; no cost
measurement, no search) and without (a plan made whole, as for any new call signature), and what each chose.

For each model, two optimized modules are made from the same first call, one with ``dynamic_shapes`` and one
without, both with the persistent cost cache off (``cache=False``: a size never seen has no unit costs cached,
which is the case a new size meets). Then for each new size, in turn for the two modules (the order alternating),
``module.prepare(inputs)`` is timed (wall seconds), and the answers of both are compared with the model's.

Models: Hugging Face BERT (4 layers, hidden 256, random weights; sequence lengths) and torchvision's GoogLeNet
(image sizes, batch 1). BERT needs ``transformers`` (left out without it).

    python benchmarks/dynamic_sizes.py [--repeats 5] [--out docs/dynamic_sizes.jsonl]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torchvision
from sweep import machine
from torch.export import Dim

import opsched
from opsched.compare import compare_outputs


def cases():
    """(name, model, first inputs, dynamic_shapes, [inputs of each new size, ...])."""
    torch.manual_seed(0)
    try:
        import transformers

        bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=4, hidden_size=256,
                                                              num_attention_heads=4, intermediate_size=1024)).eval()
        ids = lambda n: (torch.randint(0, 1000, (1, n)),)
        yield "BERT (4 layers, hidden 256), sequence length", bert, ids(32), \
            ({1: Dim("length", min=8, max=256)},), [ids(n) for n in (48, 64, 96, 128)]
    except ImportError:
        print("transformers is not installed: BERT left out")
    image = lambda s: (torch.randn(1, 3, s, s),)
    side = Dim("side", min=64, max=320)
    googlenet = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True).eval()
    yield "GoogLeNet, image size", googlenet, image(96), ({2: side, 3: side},), [image(s) for s in (128, 160, 192)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/dynamic_sizes.jsonl")
    args = parser.parse_args()
    rows = []
    for name, model, first, spec, sizes in cases():
        modules = {}
        for label, options in (("dynamic_shapes", {"dynamic_shapes": spec}), ("a plan made whole", {})):
            started = time.perf_counter()
            modules[label] = opsched.optimize(model, first, repeats=args.repeats, cache=False, **options).module
            modules[label].say = lambda text: None
            print(f"{name}: optimize ({label}) {time.perf_counter() - started:.1f} s", flush=True)
        row = {"model": name, **machine(), "repeats": args.repeats, "sizes": []}
        for k, inputs in enumerate(sizes):
            entry = {"inputs": [list(x.shape) for x in inputs]}
            order = list(modules) if k % 2 == 0 else list(reversed(modules))
            for label in order:
                fast = modules[label]
                started = time.perf_counter()
                plan = fast.prepare(*inputs)
                seconds = time.perf_counter() - started
                with torch.no_grad():
                    verdict = compare_outputs(fast(*inputs), model(*inputs))
                entry[label] = {"build_seconds": round(seconds, 2), "chosen": plan.chosen,
                                "measured_ms": {n: round(ms, 3) for n, ms in plan.measured_ms.items()},
                                "ok": verdict.ok, "error": verdict.error, "note": plan.note}
            row["sizes"].append(entry)
            print(f"  {entry['inputs']}: " + "; ".join(
                f"{label} {entry[label]['build_seconds']} s, {entry[label]['chosen']}"
                f"{'' if entry[label]['ok'] else ' WRONG'}" for label in modules), flush=True)
        for label, fast in modules.items():
            row[f"median_build_seconds ({label})"] = statistics.median(e[label]["build_seconds"] for e in row["sizes"])
            fast.close()
        rows.append(row)
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
