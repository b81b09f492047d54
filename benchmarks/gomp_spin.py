"""Why concurrent stages cost so much on this CPU: GNU OpenMP's helper threads spin after a parallel region and
hold the core a worker stream needs. GoogLeNet's sequential, greedy and IOS plans (costs simulated, so that the
same plans run in both settings; every unit on its default kernel) are timed interleaved, medians of --repeats
rounds, once in a Python started with the default spinning and once with ``GOMP_SPINCOUNT=0`` (it is read when
the OpenMP runtime starts, so each setting has a process of its own). One JSON line per setting, with the
machine, versions, date and commit, is appended to --out (docs/runtime.md's paragraph).

    python benchmarks/gomp_spin.py [--image-size 224] [--repeats 15] [--out docs/gomp_spin.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sweep import appender

METHODS = ["sequential", "greedy", "ios"]


def measure(image_size: int, repeats: int) -> dict:
    """In this process: the plans' medians (ms) and their ratios to the sequential plan's."""
    import torch

    from opsched.cost.simulate import SimulatedGPU
    from opsched.evaluation import Candidate, evaluate, module_runner, reference_outputs
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.pipeline import method_options
    from opsched.runtime.module import OptimizedModule
    from opsched.schedulers import make_schedule

    cores = torch.get_num_threads()
    loaded = load_model("torchvision:googlenet", batch=1, image_size=image_size)
    model, inputs = loaded.model.eval(), tuple(loaded.inputs)
    graph = capture(model, inputs, name="googlenet")
    sim = SimulatedGPU(graph, "v100")
    candidates = [Candidate(m, module_runner(OptimizedModule(graph, make_schedule(m, graph, sim,
                                                                                  **method_options(m)), cores),
                                             inputs, cores)) for m in METHODS]
    verified = evaluate(candidates, reference_outputs(model, inputs, cores), repeats=repeats)
    ms = verified.measured_ms
    return {"measured_ms": {k: round(v, 4) for k, v in ms.items()}, "dropped": verified.dropped,
            "noise_floor": verified.noise_floor, "threads": cores,
            "over_sequential": {m: verified.ratio(m, "sequential") for m in METHODS if m in ms and m != "sequential"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="docs/gomp_spin.jsonl", help="JSON lines appended here")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # measure in this process
    args = parser.parse_args()
    if args.here:
        print(json.dumps(measure(args.image_size, args.repeats)))
        return
    append = appender(args.out)
    for setting, env in (("default", {}), ("GOMP_SPINCOUNT=0", {"GOMP_SPINCOUNT": "0"})):
        environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
        ran = subprocess.run([sys.executable, __file__, "--here", "--image-size", str(args.image_size),
                              "--repeats", str(args.repeats)], env=environ, capture_output=True, text=True,
                             check=True)
        row = append({"setting": setting, "model": "torchvision:googlenet", "image": args.image_size,
                      **json.loads(ran.stdout.strip().splitlines()[-1])})
        ratios = ", ".join(f"{m} {r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"
                           for m, r in row["over_sequential"].items())
        print(f"{setting}: sequential {row['measured_ms']['sequential']:.1f} ms; each plan's time over the sequential "
              f"plan's: {ratios}; noise {100 * (row['noise_floor'] or 0):.1f}%", flush=True)


if __name__ == "__main__":
    main()
