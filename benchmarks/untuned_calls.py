"""Optimized modules on models nobody here tuned for, called as users call them (issue 36): each model optimized
at one call, then called at another batch, another sequence length or image size, after a weight update, and
again at the first call; every answer compared with the model's own (opsched.compare), with the configuration
that answered (a plan, or the model itself) and how long each new plan took to build.

Models: Hugging Face BERT and GPT-2 (4 layers, random weights, GPT-2 with ``use_cache=False``: its cache object is
no pytree torch.export can return; other batch, other sequence length), torchvision's
DeepLabV3 (MobileNetV3-Large; another image size), and a model whose forward flattens by the batch it is called
with (``x.view(x.shape[0], -1)``). Plans are built before answering (``wait=True``), through the same runner as
the first. Needs ``transformers`` for the first two (left out without it).

    python benchmarks/untuned_calls.py [--repeats 5] [--out docs/untuned_calls.jsonl]
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torchvision
from sweep import machine

import opsched
from opsched.compare import compare_outputs
from opsched.runtime.guards import call_signature


class Flatten(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                            torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.side = torch.nn.Conv2d(3, 16, 2, stride=2)
        self.fc = torch.nn.Linear(16 * 16 * 16, 10)

    def forward(self, x):
        y = self.features(x) + self.side(x)
        return self.fc(y.view(y.shape[0], -1))


def cases():
    """(name, model, first inputs, [(label, inputs), ...])."""
    torch.manual_seed(0)
    ids = lambda b, n: (torch.randint(0, 1000, (b, n)),)
    try:
        import transformers

        bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=4, hidden_size=256,
                                                              num_attention_heads=4, intermediate_size=1024)).eval()
        yield "BERT (4 layers, hidden 256)", bert, ids(1, 32), [("batch 4", ids(4, 32)), ("sequence 48", ids(1, 48))]
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, use_cache=False)).eval()
        yield "GPT-2 (4 layers, 256)", gpt2, ids(1, 32), [("batch 2", ids(2, 32)), ("sequence 40", ids(1, 40))]
    except ImportError:
        print("transformers is not installed: BERT and GPT-2 left out")
    deeplab = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                           aux_loss=False).eval()
    image = lambda b, s: (torch.randn(b, 3, s, s),)
    yield "DeepLabV3 MobileNetV3-Large", deeplab, image(1, 96), [("batch 2", image(2, 96)), ("128 px", image(1, 128))]
    yield "flatten by batch", Flatten().eval(), image(2, 32), [("batch 5", image(5, 32)), ("batch 1", image(1, 32))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/untuned_calls.jsonl")
    args = parser.parse_args()
    rows = []
    for name, model, first, others in cases():
        started = time.perf_counter()
        result = opsched.optimize(model, first, repeats=args.repeats, wait=True)
        fast = result.module
        fast.say = lambda text: None
        calls = [("first call", first), *others, ("after load_state_dict", first), ("after it, " + others[0][0],
                                                                                       others[0][1])]
        row = {"model": name, **machine(), "optimize_seconds": round(time.perf_counter() - started, 1),
               "chosen": result.chosen, "calls": []}
        for label, inputs in calls:
            if label == "after load_state_dict":
                with torch.no_grad():
                    model.load_state_dict({k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
                                           for k, v in model.state_dict().items()})
            began = time.perf_counter()
            with torch.no_grad():
                got = fast(*inputs)
                seconds = time.perf_counter() - began
                want = model(*inputs)
            verdict = compare_outputs(got, want)
            plan = fast.plans.get(call_signature(tuple(inputs)))
            row["calls"].append({"call": label, "error": verdict.error, "ok": verdict.ok, "why": verdict.why,
                                 "answered_by": plan.chosen if plan is not None and plan.module is not None
                                 else "the model itself", "call_seconds": round(seconds, 2),
                                 "note": plan.note if plan is not None else ""})
        fast.close()
        rows.append(row)
        print(f"{name}: optimize {row['optimize_seconds']} s, chosen {row['chosen']}; " + "; ".join(
            f"{c['call']}: {'ok' if c['ok'] else 'WRONG'} ({c['error']:.2g}, {c['answered_by']}, {c['call_seconds']} s)"
            for c in row["calls"]), flush=True)
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
