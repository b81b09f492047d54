"""The whole graph on Inductor, as ``--kernels auto`` offers it, on random models at scale (the suite runs 8):
hundreds of random recipes (tests/support/small_models.py: views, in-place writes, pools, gates, several inputs
and outputs, float32, float64 and bfloat16), each run as one compiled region and compared with the model's own
eager answer. Counts, per run: cases, wrong answers (the first few), refusals by opsched's one-line error (as
the optimize that offered it drops that plan), and the distinct reasons.

    python benchmarks/inductor_region_fuzz.py [--cases 200] [--seed 0] [--out docs/inductor_region_fuzz.jsonl]
"""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from sweep import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.small_models import check_inductor_region, recipes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/inductor_region_fuzz.jsonl")
    args = parser.parse_args()
    counts, wrong, refused = Counter(), [], Counter()
    began = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(recipes())
    def one(recipe):
        counts["cases"] += 1
        counts[recipe["dtype"]] += 1
        try:
            why = check_inductor_region(recipe)
        except AssertionError as e:  # a wrong answer: recorded, and the run goes on
            wrong.append(str(e)[:300])
            return
        if why:
            refused[why.split(": ", 1)[-1][:120]] += 1

    one()
    row = {"cases": counts["cases"], "dtypes": {k: v for k, v in counts.items() if k != "cases"},
           "wrong": len(wrong), "wrong_first": wrong[:3], "refused": sum(refused.values()),
           "refused_why": dict(refused), "seconds": round(time.perf_counter() - began, 1), "seed": args.seed,
           **machine()}
    with Path(args.out).open("a") as sink:
        sink.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
