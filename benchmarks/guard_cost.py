"""What the guards cost per call (issue 36): a plan's call checked (signature and weights) against the same
plan's call unchecked, which is what the plan's ``forward`` did before the guards, interleaved in one process.

Three configurations of each model's plan, timed in interleaved rounds (each round: ``--calls`` calls of each,
in turn; the figure is the median over rounds of the mean call):

- ``unchecked``: the OptimizedModule with no guard, called as before the guards (flatten, run);
- ``guarded plan``: ``module(x)``, the OptimizedModule with its guard (signature, weights, modes);
- ``optimize's module``: the GuardedModule ``opsched.optimize`` (``optimize_batch``) hands back (the weights
  watched, the signature looked up among its plans, the plan run unchecked);
- ``weights not followed``: the same with ``follow_weights=False`` (the modules watched, not the tensors).

The guard's parts are also timed alone (``check_us``: the plan's whole guard, the call's signature, the look
at the weights), free of the noise of the calls around it.

Models: ResNet-18 and SqueezeNet 1.1 at batch 1 (224 px), and 16 LeNet-5 run as one fused graph
(``opsched.optimize_batch``). Each model's plan is the schedule
``opsched.optimize`` made and verified (its sequential schedule where eager was chosen: the guard's cost is
the same for every schedule).

    python benchmarks/guard_cost.py [--rounds 30] [--calls 20] [--out docs/guard_cost.jsonl]
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torchvision
from sweep import machine

import opsched
from opsched.noise import ratio_interval
from opsched.runtime.guards import WeightWatch, flat_signature


def lenet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 6, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Conv2d(6, 16, 5), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(400, 120), torch.nn.ReLU(),
        torch.nn.Linear(120, 84), torch.nn.ReLU(), torch.nn.Linear(84, 10)).eval()


def one_model(name: str, model: torch.nn.Module, x: torch.Tensor) -> dict:
    result = opsched.optimize(model, (x,), repeats=5)
    fast = result.module
    fast.say = lambda text: None
    plan = next(iter(fast.plans.values()))
    module = plan.module if plan.module is not None else result.evaluation.modules[plan.schedule.measured.measured_as]
    if plan.module is None:  # eager was chosen: optimize's module would call the model; time the plan instead
        plan.module = module
    return {"case": name, "chosen": result.chosen, "plan": plan.schedule.measured.measured_as,
            "check_us": _parts(module, (x,)),
            "configurations": {"unchecked": _unchecked(module, (x,)), "guarded plan": lambda: module(x),
                               **_optimizes(fast, (x,))}}


def ensemble(count: int = 16) -> dict:
    torch.manual_seed(0)
    models = [lenet() for _ in range(count)]
    x = torch.randn(1, 1, 32, 32)
    result = opsched.optimize_batch(models, (x,), repeats=5)
    plan = result.plan()
    module = result.outcome.modules[plan.measured.measured_as]
    inputs = tuple(result.fusion.batch.inputs)
    fast = result.module
    fast.say = lambda text: None
    only = next(iter(fast.plans.values()))
    if only.module is None:  # the models one after another were chosen: time the fused plan instead
        only.module = module
    return {"case": f"{count} LeNet-5, one fused graph", "chosen": result.chosen, "plan": plan.measured.measured_as,
            "check_us": _parts(module, inputs),
            "configurations": {"unchecked": _unchecked(module, inputs), "guarded plan": lambda: module(*inputs),
                               **_optimizes(fast, inputs)}}


def _optimizes(fast, inputs):
    """optimize's module called, with its weights followed and not (a shallow copy sharing its plans, watching
    the modules only)."""
    light = copy.copy(fast)
    light.watch = WeightWatch(fast.model, tensors=False)
    return {"optimize's module": lambda: fast(*inputs), "weights not followed": lambda: light(*inputs)}


def _parts(module, inputs) -> dict[str, float]:
    """Microseconds of the plan's guard, of the call's signature and of the look at the weights, each alone."""
    return dict(zip(("guard", "signature", "weights"), check_us(
        lambda: module.guard.check(inputs), lambda: flat_signature(inputs), module.guard.weights.changed)))


def _unchecked(module, inputs):
    """The plan's call as it was before the guards: a shallow copy of the module (the same executor) with no
    guard, called as the model is (nn.Module's call, flatten, run)."""
    bare = copy.copy(module)
    bare.guard = None
    return lambda: bare(*inputs)


def check_us(*checks) -> list[float]:
    """Microseconds per call of each check alone (the plan's guard; optimize's module's look at the weights):
    the median of 7 runs of 2,000 calls."""
    figures = []
    for check in checks:
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(2000):
                check()
            runs.append((time.perf_counter() - start) / 2000 * 1e6)
        figures.append(round(sorted(runs)[3], 2))
    return figures


def timed(configurations: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in configurations}
    with torch.inference_mode():
        for run in configurations.values():  # warm
            for _ in range(3):
                run()
        for _ in range(rounds):
            for name, run in configurations.items():
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                samples[name].append((time.perf_counter() - start) / calls * 1e3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default="docs/guard_cost.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = [one_model("resnet18 bs1 224px", torchvision.models.resnet18().eval(), torch.randn(1, 3, 224, 224)),
             one_model("squeezenet1_1 bs1 224px", torchvision.models.squeezenet1_1().eval(),
                       torch.randn(1, 3, 224, 224)),
             ensemble()]
    rows = []
    for case in cases:
        samples = timed(case.pop("configurations"), args.rounds, args.calls)
        medians = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
        row = {**case, **machine(), "threads": torch.get_num_threads(), "rounds": args.rounds, "calls": args.calls,
               "median_ms": {n: round(ms, 5) for n, ms in medians.items()}, "over_unchecked": {}}
        for name in samples:
            if name != "unchecked":
                ratio, low, high = ratio_interval(samples[name], samples["unchecked"])
                row["over_unchecked"][name] = {"ratio": round(ratio, 4), "interval_99": [round(low, 4), round(high, 4)],
                                               "extra_us": round((medians[name] - medians["unchecked"]) * 1e3, 1)}
        rows.append(row)
        print(f"{row['case']}: the guard alone {row['check_us']['guard']:.1f} us (signature "
              f"{row['check_us']['signature']:.1f}, weights {row['check_us']['weights']:.1f}); unchecked {medians['unchecked']:.3f} ms; " + "; ".join(
            f"{n} {v['ratio']:.3f}x (99% {v['interval_99'][0]:.3f}-{v['interval_99'][1]:.3f}, {v['extra_us']:+.1f} us)"
            for n, v in row["over_unchecked"].items()))
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
