"""Optimized modules of models nobody here tuned for, called as users call them, every answer compared with the
model's own: a sweep of torchvision and timm models, each wrapped as ``opsched.optimize`` wraps it (a
:class:`~opsched.runtime.guarded.GuardedModule`) over plans made by the call fuzzer's builder (captured, a random
scheduler under random costs, compiled, verified against the model: no timing, so that many models fit in
minutes), then called:

- with new values, at batch 2, with a ``channels_last`` input, twice in grad mode (the outputs must require
  gradients as the model's do; the model itself answers a plan's first call in grad mode, to see which do);
- after ``load_state_dict`` with changed weights, after the first norm layer's ``eps`` set to 0.5 (a setting of
  one of PyTorch's layers; models without one skip this call), under bfloat16 autocast;
- after ``fast.train()`` (the model answers, with its dropout: both called from the same random state) and
  ``fast.eval()``;
- after ``fast.double()``, with a float64 input.

Counts per model: calls, wrong answers (values beyond the dtype's tolerance, another shape, dtype or structure,
or outputs that do not require gradients where the model's do), tracebacks (an exception the model itself does
not raise), plans made, and plans that could not be made with why (the model answers those calls itself). Appends one JSON line per model to ``--out`` and prints a line per model.

    python benchmarks/zoo_calls.py [--models timm:ghostnet_100 ...] [--image-size 64] [--out docs/zoo_calls.jsonl]
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch
from sweep import appender

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.call_fuzz import QuickBuilder, differs

from opsched.models import load_model
from opsched.runtime.guarded import GuardedModule

MODELS = ["torchvision:resnet18", "torchvision:mobilenet_v3_small", "torchvision:efficientnet_b0",
          "torchvision:regnet_x_400mf", "torchvision:shufflenet_v2_x0_5", "torchvision:squeezenet1_1",
          "torchvision:googlenet", "torchvision:densenet121", "torchvision:mnasnet0_5", "torchvision:convnext_tiny",
          "timm:ghostnet_100", "timm:mixnet_s", "timm:rexnet_100", "timm:dla34", "timm:hrnet_w18_small",
          "timm:vit_tiny_patch16_224", "timm:deit_tiny_patch16_224", "timm:levit_128s", "timm:mobilevit_xxs",
          "timm:poolformer_s12", "timm:efficientformer_l1", "timm:tinynet_a", "timm:resmlp_12_224",
          "timm:pit_ti_224", "timm:edgenext_xx_small", "timm:convmixer_768_32", "timm:cspresnet50",
          "timm:nf_resnet26", "timm:gcresnet33ts", "timm:selecsls42b"]


class Recorded(QuickBuilder):
    """The fuzzer's builder, keeping why each plan it could not make failed (the model then answers that call,
    which compares equal to itself: those calls test the guards, not a plan)."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.failures: list[str] = []

    def _recorded(self, make, *args):
        try:
            return make(*args)
        except Exception as e:
            self.failures.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            raise

    def build(self, model, inputs):
        return self._recorded(super().build, model, inputs)

    def rebuild(self, model, plan):
        return self._recorded(super().rebuild, model, plan)

    def resize(self, model, plan, inputs):
        return self._recorded(super().resize, model, plan, inputs)


def one(spec: str, image_size: int) -> dict:
    """Every call of the sweep on one model."""
    loaded = load_model(spec, batch=1, image_size=image_size)
    try:
        with torch.no_grad():
            loaded.model.eval()(*loaded.inputs)
    except Exception:  # noqa: BLE001 - a model made for its own size only (a ViT's position embedding)
        loaded = load_model(spec, batch=1)
    model, (x,) = loaded.model.eval(), tuple(loaded.inputs)
    builder = Recorded(0)
    fast = GuardedModule(model, builder, wait=True, say=lambda line: None)
    wrong, failed, calls = [], [], 0

    def call(label: str, inputs: tuple, grad: bool = False, autocast: bool = False, seed: int | None = None) -> None:
        nonlocal calls
        calls += 1
        context = torch.enable_grad() if grad else torch.no_grad()
        results = []
        for who in (fast, model):
            if seed is not None:
                torch.manual_seed(seed)
            try:
                with context, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    results.append(("ok", who(*inputs)))
            except Exception as e:  # noqa: BLE001 - compared with what the model does
                results.append(("raised", e))
        (got_kind, got), (want_kind, want) = results
        if want_kind == "raised":
            if got_kind != "raised":
                wrong.append(f"{label}: answered where the model raises {type(want).__name__}")
            return
        if got_kind == "raised":
            failed.append(f"{label}: {type(got).__name__}: {str(got).splitlines()[0][:200] if str(got) else ''}")
            return
        why = differs(got, want, grads=True)
        if why:
            wrong.append(f"{label}: {why}")

    started = time.perf_counter()
    try:
        call("first call", (x,))
        call("new values", (torch.randn_like(x),))
        call("batch 2", (torch.randn(2, *x.shape[1:]),))
        call("channels_last", (torch.randn_like(x).contiguous(memory_format=torch.channels_last),))
        call("grad mode", (torch.randn_like(x),), grad=True)  # (the model answers a plan's first such call)
        call("grad mode again", (torch.randn_like(x),), grad=True)
        g = torch.Generator().manual_seed(1)
        changed = model.state_dict()  # (changed in its place: its metadata, which some models' loading reads, kept)
        for k, v in changed.items():
            if v.is_floating_point():
                changed[k] = v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype)
        model.load_state_dict(changed)
        call("after load_state_dict", (torch.randn_like(x),))
        norm = next((m for m in model.modules() if type(m).__module__.startswith("torch.nn.")
                     and isinstance(getattr(m, "eps", None), float)), None)
        if norm is not None:
            norm.eps = 0.5
            call("after a norm's eps set", (torch.randn_like(x),))
        call("bfloat16 autocast", (torch.randn_like(x),), autocast=True)
        fast.train()
        call("after fast.train()", (torch.randn(2, *x.shape[1:]),), seed=3)
        fast.eval()
        call("after fast.eval()", (torch.randn_like(x),))
        fast.double()
        call("after fast.double()", (torch.randn_like(x).double(),))
    except Exception:  # noqa: BLE001 - the harness's own failure, recorded
        failed.append("harness: " + traceback.format_exc().strip().splitlines()[-1])
    finally:
        fast.close()
    return {"model": spec, "input_shape": list(x.shape), "calls": calls, "wrong": wrong, "tracebacks": failed,
            "plans_built": builder.built - len(builder.failures), "plans_failed": builder.failures,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--out", default="docs/zoo_calls.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    append = appender(args.out)  # as each model finishes: a long run interrupted keeps what it measured
    for spec in args.models:
        try:
            row = one(spec, args.image_size)
        except Exception as e:  # noqa: BLE001 - a model that cannot be loaded or wrapped: said, and the sweep goes on
            row = {"model": spec, "image_size": args.image_size, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row = append(row)
        print(f"{spec}: {row.get('calls', 0)} calls, {row.get('plans_built', 0)} plans made and "
              f"{len(row.get('plans_failed', []))} not, {len(row.get('wrong', []))} wrong, "
              f"{len(row.get('tracebacks', []))} tracebacks, {row.get('seconds', '-')} s "
              f"{row.get('error', '')} {row.get('wrong', [])[:1]} {row.get('tracebacks', [])[:1]}", flush=True)


if __name__ == "__main__":
    main()
