"""What ``--kernels auto`` (the default of ``opsched optimize``) adds to the time a plain optimize takes: the same
model optimized with ``--kernels eager`` (the default before) and ``auto``, each in a process of its own, on a
cold cache (an empty cache folder of its own, for opsched's costs and Inductor's compiled graphs) and on a warm
one (the same folder, a second time), the two kernels
alternated ``--rounds`` times. Appends one JSON line per run (kernels, cache, seconds, what was chosen and
measured, the kernel choice) with the machine, versions, date and commit to ``--out``, and prints the medians and
their ratios.

    python benchmarks/auto_time.py [--model inception_v3] [--rounds 2] [--out docs/auto_time.jsonl]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sweep import machine


def one(model: str, kernels: str) -> dict:
    """One ``opsched.optimize`` of ``model`` (in this process), timed whole, capture included."""
    import torch

    import opsched
    from opsched.models import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(model, batch=1)
    began = time.perf_counter()
    outcome = opsched.optimize(loaded.model.eval(), tuple(loaded.inputs), kernels=kernels)
    seconds = time.perf_counter() - began
    return {"seconds": round(seconds, 1), "chosen": outcome.chosen,
            "measured_ms": {k: round(v, 3) for k, v in outcome.measured_ms.items()},
            "kernel_choice": getattr(outcome.cost, "kernel_choice", None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="inception_v3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/auto_time.jsonl")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for kernels in ("eager", "auto"):
                cache = Path(folder) / f"{kernels}-{round_}"
                for state in ("cold", "warm"):
                    # Inductor's own cache (its compiled graphs) cold and warm with opsched's
                    env = {**os.environ, "OPSCHED_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
                    ran = subprocess.run([sys.executable, __file__, "--one", args.model, kernels], env=env,
                                         capture_output=True, text=True, check=True)
                    row = {"model": args.model, "kernels": kernels, "cache": state, "round": round_,
                           **json.loads(ran.stdout.strip().splitlines()[-1]), **machine()}
                    rows.append(row)
                    with Path(args.out).open("a") as sink:
                        sink.write(json.dumps(row) + "\n")
                    print(f"{kernels:<6} {state}: {row['seconds']} s, chosen {row['chosen']}", flush=True)
    for state in ("cold", "warm"):
        eager, auto = (statistics.median(r["seconds"] for r in rows if r["kernels"] == k and r["cache"] == state)
                       for k in ("eager", "auto"))
        print(f"{state}: eager {eager:.1f} s, auto {auto:.1f} s, {auto / eager:.2f}x")


if __name__ == "__main__":
    main()
