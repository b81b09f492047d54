"""Where, when and with what a figure was measured: every record a benchmark or ``opsched bench`` writes carries it.

>>> sorted(machine())
['commit', 'date', 'machine', 'versions']
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import date
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository root when opsched runs from a source checkout


def machine() -> dict:
    """The machine (architecture, cores, CPU model), the versions of Python, PyTorch and ONNX Runtime, today's date
    and opsched's commit (``+changes`` when its source in the working tree differs from it; None outside a git
    checkout)."""
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {names[0] if names else platform.processor()}",
            "versions": versions, "date": date.today().isoformat(), "commit": _commit()}


def _commit() -> str | None:
    """opsched's commit when it runs from its own source checkout (``src/opsched`` beside a ``pyproject.toml`` of
    opsched, in a git work tree), ``+changes`` when its source differs from that commit; otherwise None."""
    pyproject = CHECKOUT / "pyproject.toml"
    if Path(__file__).resolve().parents[1].name != "src" or not (CHECKOUT / ".git").exists() \
            or not pyproject.is_file() or 'name = "opsched"' not in pyproject.read_text():
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=CHECKOUT, check=False).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "src/opsched")  # the package's own source, new files included
    except OSError:  # no git here
        return None
    return (commit + ("+changes" if dirty else "")) or None
