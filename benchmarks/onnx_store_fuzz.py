"""ONNX exports kept between runs (src/opsched/runtime/onnx_store.py) on random models at scale (the suite runs
15): each case a random recipe (tests/support/small_models.py: views, in-place writes, pools, gates, several
inputs and outputs), run on ONNX Runtime kernels under a random plan (sequential or IOS, with or without
compiled regions), then its weights changed one random way (in place, through ``.data``, through a NumPy view,
``load_state_dict`` of other weights, or not at all) and run again by a new operator, which takes what it can
from the store, every answer compared with the model's own eager one. One store for the whole run, so that models
of one shape meet each other's exports. Counts, per run: cases, wrong answers (the first few), exports made,
taken from the store, and stored ones the check before use rejected (a name the key should have told apart).

    python benchmarks/onnx_store_fuzz.py [--cases 500] [--seed 0] [--out docs/onnx_store_fuzz.jsonl]
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from sweep import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.small_models import build, onnxruntime_verdict, recipes

CHANGES = ("in place", "through .data", "through numpy", "load_state_dict", "none")


def change_weights(model: torch.nn.Module, how: str, recipe: dict) -> None:
    """Change ``model``'s weights ``how`` (one of ``CHANGES``), a random tensor of it where one is changed."""
    tensors = [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]
    if not tensors or how == "none":
        return
    target = random.Random(recipe["seed"]).choice(tensors)
    if how == "in place":
        with torch.no_grad():
            target.mul_(1.5)
    elif how == "through .data":
        target.data[...] = target.data * 1.5 + 0.1
    elif how == "through numpy":
        view = target.detach().numpy()
        view *= 1.5
        view += 0.1
    else:
        model.load_state_dict(build({**recipe, "seed": recipe["seed"] + 1})[0].state_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/onnx_store_fuzz.jsonl")
    args = parser.parse_args()
    from opsched.runtime import kernels

    counts, wrong = Counter(), []
    exporting, taking, checking = kernels.onnx_bytes, kernels.OnnxStore.get, kernels.OnnxRuntimeOperator._call

    def export(*a, **k):
        counts["exports"] += 1
        return exporting(*a, **k)

    def take(self, key):
        found = taking(self, key)
        counts["from_store"] += found is not None
        return found

    def check(exported, from_store, *a):
        call = checking(exported, from_store, *a)
        counts["rejected"] += call is None
        return call

    kernels.onnx_bytes, kernels.OnnxStore.get, kernels.OnnxRuntimeOperator._call = export, take, staticmethod(check)
    began = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(recipe=recipes(), method=st.sampled_from(["sequential", "ios"]), regions=st.booleans(),
           how=st.sampled_from(CHANGES))
    def one(recipe, method, regions, how):
        recipe = {**recipe, "dtype": "float32"}  # (ONNX Runtime's CPU kernels are float32's)
        counts["cases"] += 1
        counts[how] += 1
        model, inputs = build(recipe)
        for when in ("first", "after the change"):
            if when != "first":
                change_weights(model, how, recipe)
            verdict = onnxruntime_verdict(model, inputs, method, regions)
            if not verdict.ok:
                wrong.append(f"{when} ({how}, {method}, regions={regions}): {verdict.why}"[:300])

    with tempfile.TemporaryDirectory() as folder:
        os.environ["OPSCHED_CACHE_DIR"] = folder  # one store for the run, none of the user's
        one()
    row = {"cases": counts.pop("cases"), "wrong": len(wrong), "wrong_first": wrong[:3],
           "changes": {k: counts.pop(k) for k in CHANGES if k in counts}, **dict(counts),
           "seconds": round(time.perf_counter() - began, 1), "seed": args.seed, **machine()}
    with Path(args.out).open("a") as sink:
        sink.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
