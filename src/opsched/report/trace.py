"""A Chrome/Perfetto trace (the JSON "Trace Event Format") of a timeline, one row per stream.

Open it at https://ui.perfetto.dev or chrome://tracing. ``label`` says what the times are (predicted by
which cost model, simulated, or measured); it names the process row, so that no one reads a simulated
timeline as a measurement.

>>> from opsched.schedule import OpTiming
>>> doc = chrome_trace([OpTiming("a", 0, 0.0, 1.5), OpTiming("b", 1, 0.5, 1.0)], "predicted (table)")
>>> [(e["name"], e["tid"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
[('a', 0, 0.0, 1500.0), ('b', 1, 500.0, 500.0)]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsched.schedule import OpTiming


def chrome_trace(ops: Sequence[OpTiming], label: str) -> dict[str, Any]:
    """The trace document; ``ops`` times are read as milliseconds (a table cost model's unitless figures
    are shown as if they were)."""
    scale = 1000.0  # trace timestamps are microseconds
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": label}}]
    for stream in sorted({o.stream for o in ops}):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stream, "args": {"name": f"stream {stream}"}})
    for o in sorted(ops, key=lambda o: (o.start, o.stream)):
        events.append({"name": o.name, "ph": "X", "pid": 0, "tid": o.stream, "ts": o.start * scale,
                       "dur": (o.finish - o.start) * scale, "args": {"start": o.start, "finish": o.finish}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"timeline": label}}


def write_trace(path: str | Path, ops: Sequence[OpTiming], label: str) -> None:
    Path(path).write_text(json.dumps(chrome_trace(ops, label)) + "\n")
