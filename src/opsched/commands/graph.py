"""``opsched graph``: a model's (or a DAG JSON file's) schedule units, edges, blocks and FLOPs."""

from __future__ import annotations

import argparse
import time
from typing import Any

from opsched.commands.common import load_and_capture


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.graph.blocks import split_blocks

    graph, load_seconds, capture_seconds = _load_graph(args)
    blocks = split_blocks(graph, args.max_block_size, at_cuts=not args.no_split)
    widths = [graph.width_of(b.mask) for b in blocks]
    summary = {
        "model": args.model, "units": len(graph), "edges": len(graph.edges), "blocks": len(blocks),
        "max_block_width": max(widths, default=0), "flops": graph.flops, "width": graph.width,
        "batch": args.batch,
        "load_seconds": round(load_seconds, 3), "capture_seconds": round(capture_seconds, 3),
        "block_table": [{"units": len(b), "width": w, "part": f"{b.part + 1}/{b.parts}",
                         "first": graph.nodes[b.units[0]].name,
                         "exit": graph.nodes[b.exit].name if b.exit is not None else None}
                        for b, w in zip(blocks, widths)],
    }
    if not args.json:
        _print(summary)
    return summary


def _print(s: dict[str, Any]) -> None:
    gflops = s["flops"] / 1e9
    print(f"model            {s['model']}" + (f" (batch {s['batch']})" if s["batch"] else ""))
    print(f"units            {s['units']}")
    print(f"edges            {s['edges']}")
    print(f"width            {s['width']}")
    print(f"blocks           {s['blocks']}  (widest block: {s['max_block_width']} units side by side)")
    print(f"FLOPs            {gflops:.3f} G")
    print(f"capture          {s['capture_seconds']:.2f} s  (loading the model: {s['load_seconds']:.2f} s)")
    print()
    rows = [("block", "units", "width", "part", "first unit", "exit unit")]
    rows += [(str(k), str(b["units"]), str(b["width"]), b["part"], b["first"], b["exit"] or "-")
             for k, b in enumerate(s["block_table"])]
    sizes = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(size) if c >= 3 else cell.rjust(size)
                        for c, (cell, size) in enumerate(zip(r, sizes))).rstrip())


def _load_graph(args: argparse.Namespace):
    """The unit graph of a model specifier or of a DAG JSON file, with the seconds spent loading the
    model (and PyTorch) and capturing it."""
    start = time.perf_counter()
    if args.model.endswith(".json"):
        from opsched.graph import dagjson

        return dagjson.read(args.model), time.perf_counter() - start, 0.0
    from opsched.models.spec import unit_graph

    graph = unit_graph(args.model, args.batch)
    if graph is not None:
        return graph, time.perf_counter() - start, 0.0
    _, graph, load_seconds, capture_seconds = load_and_capture(args, args.model)
    return graph, load_seconds, capture_seconds
