"""``opsched bench``: the papers' comparisons (see :mod:`opsched.bench`), written as CSV, markdown and plots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError
from opsched.progress import say


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched import bench
    from opsched.report.plots import write_plots

    cases = bench.preset_cases(args.preset, models=args.models, costs=args.cost, batches=args.batch,
                               methods=args.methods)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise OpschedError(f"{out} exists and is not a directory")
    started = time.perf_counter()
    rows = bench.run(cases, out, repeats=args.repeats, torch_compile=args.torch_compile,
                     progress=say)
    (out / "results.md").write_text(bench.markdown(rows) + "\n")
    plots = write_plots(rows, out)
    result = {"preset": args.preset, "out": str(out), "rows": len(rows), "seconds": time.perf_counter() - started,
              "files": [str(out / "results.csv"), str(out / "results.md")] + [str(p) for p in plots]}
    if not args.json:
        print(bench.markdown([r for r in rows if r["preset"] == args.preset]))
        print(f"{len(rows)} rows in {out / 'results.csv'}; table {out / 'results.md'}; "
              f"{len(plots)} plots ({time.perf_counter() - started:.0f} s)")
    return result
