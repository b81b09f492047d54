"""``opsched cache info|clear``: the sqlite cache of measured latencies, and the ONNX exports kept beside it."""

from __future__ import annotations

import argparse
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.cost.cache import LatencyCache, default_path
    from opsched.runtime.onnx_store import OnnxStore

    path = default_path()
    exports = OnnxStore()
    if args.action == "clear":
        removed = LatencyCache(path).clear() if path.exists() else 0
        result = {"path": str(path), "removed": removed, "onnx_exports_removed": exports.clear()}
        if not args.json:
            print(f"removed {removed} measurements from {path}")
            print(f"removed {result['onnx_exports_removed']} ONNX exports from {exports.folder}")
        return result
    summary = LatencyCache(path).summary() if path.exists() else {"path": str(path), "bytes": 0, "entries": 0,
                                                                  "devices": []}
    summary["onnx_exports"] = exports.summary()
    if not args.json:
        print(f"cache    {summary['path']}  ({summary['bytes'] / 1024:.0f} KiB, {summary['entries']} measurements)")
        for d in summary["devices"]:
            print(f"  {d['entries']:>6}  kernels {d['kernels']:<8}  {d['device']}")
        stored = summary["onnx_exports"]
        print(f"exports  {stored['path']}  ({stored['bytes'] / 1024 ** 2:.0f} MiB, {stored['exports']} ONNX exports, "
              "the least recently used removed beyond 2 GiB)")
    return summary
