"""Commands of opsched's CLI as a user types them, run with ``--json`` and recorded: the figures docs/ quotes from
``opsched map`` and ``opsched multi`` runs come from here.

Each preset is a list of commands; each command runs ``--runs`` times, one process a run (so that every run pays
what a user's does: imports, capture, and profiling, every command measuring afresh with ``--no-cache``), the
presets' commands interleaved run by run. Each run's JSON is appended to OUT as one line, with the command as run,
the session (when this invocation started) and the run's number, its wall time, the load average before it, and the
machine, versions, date and commit. A command that fails (or prints something else than its JSON) is recorded with
its exit status and the last line it wrote.

    python benchmarks/cli_runs.py --preset mapping-cpu2 --runs 3 --out docs/mapping_cpu2.jsonl
    python benchmarks/cli_runs.py --preset multi-resnet18 multi-mixed --out docs/multi_cli.jsonl

Presets:

- ``mapping-cpu2``: GoogLeNet at 64 px and MobileNetV3-small at 96 px mapped by HEFT onto two 1-thread CPU
  devices, the units profiled afresh each run (``--no-cache``): the mapped plan, each device alone and eager,
  verified and timed interleaved (docs/mapping.md, "Execution").
- ``multi-resnet18``: four ResNet-18 copies at batch 2 at 64, 112 and 224 px (docs/multi.md).
- ``multi-mixed``: four different small torchvision networks on one 64 px input, on ONNX Runtime kernels
  (docs/multi.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from sweep import appender

PRESETS: dict[str, list[list[str]]] = {
    "mapping-cpu2": [
        ["map", "torchvision:googlenet", "--image-size", "64", "--platform", "cpu2", "--method", "heft", "--no-cache"],
        ["map", "torchvision:mobilenet_v3_small", "--image-size", "96", "--platform", "cpu2", "--method", "heft",
         "--no-cache"],
    ],
    "multi-resnet18": [
        ["multi", "torchvision:resnet18", "--copies", "4", "--batch", "2", "--image-size", str(size), "--no-cache"]
        for size in (64, 112, 224)
    ],
    "multi-mixed": [
        ["multi", "torchvision:squeezenet1_1", "torchvision:mobilenet_v3_small", "torchvision:shufflenet_v2_x0_5",
         "torchvision:mnasnet0_5", "--image-size", "64", "--kernels", "onnxruntime", "--no-cache"],
    ],
}


def command_line(command: list[str]) -> list[str]:
    return [sys.executable, "-m", "opsched", *command, "--json"]


def run(command: list[str], timeout: float) -> dict:
    """One run of ``opsched COMMAND --json`` in its own process: its JSON, or its failure."""
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as scratch:  # the plans and charts a command writes are not kept
            done = subprocess.run(command_line(command), capture_output=True, text=True, timeout=timeout,
                                  check=False, cwd=scratch)
    except subprocess.TimeoutExpired:
        return {"failed": f"over {timeout:.0f} s", "seconds": round(time.perf_counter() - started, 1)}
    seconds = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return {"failed": f"exit {done.returncode}: {last}", "seconds": seconds}
    try:
        return {"result": json.loads(done.stdout), "seconds": seconds}
    except json.JSONDecodeError:
        last = (done.stdout.strip().splitlines() or ["(nothing)"])[-1]
        return {"failed": f"stdout is not one JSON object: {last[:200]}", "seconds": seconds}


def table(path: str, preset: str) -> str:
    """The markdown table of ``preset``'s runs in the record at ``path`` (its latest session): each run's
    prediction (if any), every configuration's median, the one chosen, and the largest error."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    rows = [r for r in rows if r["preset"] == preset]
    latest = max((r["session"] for r in rows), default=None)
    rows = [r for r in rows if r["session"] == latest]
    configs = sorted({k for r in rows for k in r.get("result", {}).get("measured_ms", {})})
    lines = ["| command | run | predicted | " + " | ".join(configs) + " | chosen | largest error | load before |",
             "|" + "---|" * (len(configs) + 6)]
    for r in rows:
        command = " ".join(a for a in r["command"][2:] if a not in ("--json", "--no-cache"))
        if "failed" in r:
            lines.append(f"| `{command}` | {r['run']} | {r['failed']} |" + " |" * (len(configs) + 3))
            continue
        result = r["result"]
        ms = result.get("measured_ms", {})
        predicted = result.get("predicted")
        cells = [f"{ms[c]:.2f}" if c in ms else "-" for c in configs]
        lines.append(f"| `{command}` | {r['run']} | {predicted:.2f} |" if isinstance(predicted, (int, float))
                     else f"| `{command}` | {r['run']} | - |")
        lines[-1] += " " + " | ".join(cells) + f" | {result.get('chosen')} | {result.get('max_error', 0):.1e} | " \
            f"{r['load_average_before']} |"
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", choices=sorted(PRESETS), required=True)
    parser.add_argument("--runs", type=int, default=1, help="runs of each command")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run")
    parser.add_argument("--out", required=True, help="JSON lines appended here")
    parser.add_argument("--table", action="store_true", help="print the markdown table of each preset's latest "
                                                             "session in --out, and stop")
    args = parser.parse_args()
    if args.table:
        for preset in args.preset:
            print(f"{preset}:\n\n{table(args.out, preset)}\n")
        return
    append = appender(args.out)
    session = datetime.now().isoformat(timespec="seconds")
    commands = [(preset, command) for preset in args.preset for command in PRESETS[preset]]
    for number in range(1, args.runs + 1):
        for preset, command in commands:
            print(f"run {number}: opsched {' '.join(command)}", file=sys.stderr, flush=True)
            load = os.getloadavg()[0]
            row = append({"preset": preset, "command": command_line(command)[1:], "session": session, "run": number,
                          "load_average_before": round(load, 2), **run(command, args.timeout)})
            print(row.get("failed") or f"{row['seconds']} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
