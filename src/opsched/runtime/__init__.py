"""The runtime: schedules compiled to StreamPrograms, run by a backend (CPU threads or CUDA streams)."""

from __future__ import annotations

from typing import Any

from opsched.errors import OpschedError
from opsched.runtime.kernels import Operator
from opsched.runtime.program import StreamProgram

DEVICES = ("cpu", "cuda")


def make_executor(program: StreamProgram, operator: Operator, device: str = "cpu", cuda_graph: bool = False) -> Any:
    """The backend that runs ``program`` on ``device``: worker threads on the CPU, streams and events (and
    optionally one CUDA graph) on a GPU."""
    if device == "cpu":
        from opsched.runtime.cpu import CPUExecutor

        return CPUExecutor(program, operator)
    if device == "cuda":
        from opsched.runtime.cuda import CUDAExecutor

        return CUDAExecutor(program, operator, graph=cuda_graph)
    raise OpschedError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
