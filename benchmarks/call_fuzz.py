"""The differential fuzzer of optimized modules at scale (issue 36): thousands of random call sequences on random
models (tests/support/call_fuzz.py; the suite runs 50), every answer compared with the model's own.

Counts, per run: sequences, calls, wrong answers (values, shapes, dtypes or structure unlike the model's), hangs
(a sequence that has not ended after ``--deadline`` seconds), tracebacks that are not one of opsched's own
exceptions, and refusals by opsched's own exceptions (with the first few).

    python benchmarks/call_fuzz.py [--sequences 10000] [--seed 0] [--out docs/call_fuzz.jsonl]
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from sweep import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import call_fuzz


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--out", default="docs/call_fuzz.jsonl")
    args = parser.parse_args()
    counts = {"sequences": 0, "calls": 0, "plans_built": 0, "plans_resized": 0, "wrong": 0, "hangs": 0,
              "tracebacks": 0, "refused": 0}
    examples: dict[str, list] = {"wrong": [], "tracebacks": [], "refused": []}
    started = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.sequences, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(call_fuzz.sequences())
    def one(case):
        box: dict = {}

        def target():
            try:
                box["result"] = call_fuzz.run_sequence(case)
            except BaseException as e:  # noqa: BLE001 - counted
                box["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(args.deadline)
        counts["sequences"] += 1
        if thread.is_alive():
            counts["hangs"] += 1
            return
        if "error" in box:
            counts["tracebacks"] += 1
            examples["tracebacks"].append({"case": repr(case), "error": box["error"]})
            return
        result = box["result"]
        counts["calls"] += result["calls"]
        counts["plans_built"] += result["built"]
        counts["plans_resized"] += result["resized"]  # made from another size's schedule (dynamic dimensions)
        counts["wrong"] += len(result["wrong"])
        counts["refused"] += len(result["refused"])
        if result["wrong"]:
            examples["wrong"].append({"case": repr(case), "wrong": result["wrong"][:3]})
            print(f"wrong: {examples['wrong'][-1]}", flush=True)  # at once: a long run may be stopped
        examples["refused"] += result["refused"][:1]
        if counts["sequences"] % 250 == 0:
            print(f"{counts['sequences']} sequences, {counts['calls']} calls, {counts['wrong']} wrong, "
                  f"{counts['hangs']} hangs, {counts['tracebacks']} tracebacks, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)

    one()
    seconds = time.perf_counter() - started
    row = {**machine(), **counts, "seconds": round(seconds, 1),
           "sequences_per_minute": round(counts["sequences"] / seconds * 60, 1),
           "examples": {k: v[:5] for k, v in examples.items()}}
    with Path(args.out).open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "examples"}))


if __name__ == "__main__":
    main()
