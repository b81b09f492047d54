"""Measured on this CPU: eager PyTorch (best of 1 and all threads) against opsched's sequential and IOS
schedules, for the zoo and GoogLeNet at several batch sizes; also how close the measured cost model's
prediction of each schedule came. Every figure is measured; configurations of one model are interleaved
and the medians kept.

    python benchmarks/zoo_cpu.py [--models inception_v3 ...] [--batches 1 8] [--repeats 9] [--kernels eager]
        [--out docs/zoo_cpu.jsonl]

Prints a markdown table and appends one JSON line per row (with the machine, versions, date and commit) to
``--out``.
"""

import argparse
import time

import torch
from sweep import appender

from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.pipeline import Workload, method_options, run_workload

MODELS = ["inception_v3", "squeezenet", "nasnet", "randwire", "torchvision:googlenet"]


def one(model_name: str, batch: int, repeats: int, kernels: str, max_block_size: int) -> dict:
    loaded = load_model(model_name, batch=batch)
    loaded.model.eval()
    graph = capture(loaded.model, loaded.inputs, name=loaded.name)
    started = time.perf_counter()
    methods = {m: (m, method_options(m, max_block_size=max_block_size)) for m in ("sequential", "ios")}
    outcome = run_workload(Workload(loaded.model, tuple(loaded.inputs), graph, methods, kernels=kernels,
                                    repeats=repeats, cores=torch.get_num_threads()))
    seconds = time.perf_counter() - started
    ev, cost, schedules = outcome.evaluation, outcome.cost, outcome.schedules
    ios = schedules["ios"]
    eager = ev.measured_ms["eager"]
    measured = {m: ev.measured_ms.get(m, float("nan")) for m in schedules}
    return {"model": model_name, "batch": batch, "units": len(graph), "kernels": kernels,
            "eager_ms": eager, "eager_threads": ev.threads["eager"], "sequential_ms": measured["sequential"],
            "ios_ms": measured["ios"],  # over the rounds both ran (the race may have left eager out early)
            "speedup_vs_eager": ev.ratio("eager", "ios")["ratio"] if "ios" in ev.measured_ms else float("nan"),
            "predicted_sequential_ms": schedules["sequential"].predicted_latency,
            "predicted_ios_ms": ios.predicted_latency,
            "ios_prediction_error": ios.predicted_latency / measured["ios"] - 1.0,
            "ios_stages": len(ios.stages), "ios_concurrent_stages": sum(len(s.groups) > 1 for s in ios.stages
                                                                        if s.strategy == "concurrent"),
            "ios_merges": sum(s.strategy == "merge" for s in ios.stages),
            "refinements": ios.stats.get("refinements"), "profile_search_and_timing_seconds": seconds,
            "max_abs_error": max(ev.abs_errors.values()), "dropped": ev.dropped, "warnings": ev.warnings,
            "contention": cost.contention, "merge_factor": cost.merge_factor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--kernels", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--max-block-size", type=int, default=20)
    parser.add_argument("--out", default="docs/zoo_cpu.jsonl")
    args = parser.parse_args()
    append = appender(args.out)  # as each row finishes: a long run interrupted keeps what it measured
    print("| model | batch | eager ms (threads) | sequential ms | IOS ms | IOS vs eager | IOS predicted ms (error) | "
          "stages: concurrent / merge | profile+search+timing s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for batch in args.batches:
            r = append({**one(model, batch, args.repeats, args.kernels, args.max_block_size),
                        "repeats": args.repeats, "kernels": args.kernels})
            print(f"| {model} | {batch} | {r['eager_ms']:.1f} ({r['eager_threads']}) | {r['sequential_ms']:.1f} | "
                  f"{r['ios_ms']:.1f} | {r['speedup_vs_eager']:.2f}x | {r['predicted_ios_ms']:.1f} "
                  f"({100 * r['ios_prediction_error']:+.0f}%) | {r['ios_concurrent_stages']} / {r['ios_merges']} | "
                  f"{r['profile_search_and_timing_seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
