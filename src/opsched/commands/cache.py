"""``opsched cache info|clear``: the sqlite cache of measured latencies."""

from __future__ import annotations

import argparse
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.cost.cache import LatencyCache, default_path

    path = default_path()
    if args.action == "clear":
        removed = LatencyCache(path).clear() if path.exists() else 0
        result = {"path": str(path), "removed": removed}
        if not args.json:
            print(f"removed {removed} measurements from {path}")
        return result
    summary = LatencyCache(path).summary() if path.exists() else {"path": str(path), "bytes": 0, "entries": 0,
                                                                  "devices": []}
    if not args.json:
        print(f"cache    {summary['path']}  ({summary['bytes'] / 1024:.0f} KiB, {summary['entries']} measurements)")
        for d in summary["devices"]:
            print(f"  {d['entries']:>6}  kernels {d['kernels']:<8}  {d['device']}")
    return summary
