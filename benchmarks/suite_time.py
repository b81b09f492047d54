"""How long the README's test command takes here: runs ``python -m pytest`` (the whole suite, as CI does) and
appends one JSON line with the wall time, the counts pytest reports, the slowest tests and the machine, versions,
date and commit to ``--out``. The README quotes it.

    python benchmarks/suite_time.py [--out docs/suite_time.jsonl] [-- PYTEST ARGS ...]
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from sweep import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/suite_time.jsonl")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "--durations=15",
               "-rfE", *args.pytest_args]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    tail = done.stdout.strip().splitlines()
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed)", line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}
    slowest = [line.strip() for line in tail if re.match(r"\s*\d+\.\d+s (call|setup|teardown)", line)][:15]
    # which tests failed, with pytest's one line on each: a failure seen once must be nameable afterwards
    failed = [line.strip() for line in tail if line.startswith(("FAILED ", "ERROR "))]
    row = {"command": "python -m pytest", "seconds": round(seconds, 1), "exit_status": done.returncode,
           "counts": counts, "summary": summary, "failed": failed, "slowest": slowest, **machine()}
    with (root / args.out).open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{seconds / 60:.1f} min, exit {done.returncode}: {summary}")
    print("\n".join(failed + slowest))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
