"""The runtime: schedules compiled to StreamPrograms (:mod:`~opsched.runtime.program`), lowered to one step type
(:func:`opsched.runtime.lowered.lower`) and run by a backend: CPU threads, one GPU's streams (or a CUDA graph),
several devices, Ray actors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opsched.errors import OpschedError
from opsched.runtime.kernels import Operator
from opsched.runtime.program import StreamProgram

DEVICES = ("cpu", "cuda")


def make_executor(program: StreamProgram, operator: Operator, devices: str | Sequence[int | None] = "cpu",
                  cuda_graph: bool = False) -> Any:
    """The backend that runs ``program``. ``devices`` is where: ``cpu`` (worker threads) or ``cuda`` (one GPU's
    streams and events, optionally replayed as one CUDA graph), or a device per program stream, each None (a
    CPU worker thread) or N (CUDA device N): streams on several devices run on the several-device executor,
    which takes the inputs on the host and returns the outputs there.

    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.runtime.program import staged_program
    >>> g = Graph([Node("a", args=("x",)), Node("b", args=("x",))], inputs=["x"])
    >>> program = staged_program(g, [("concurrent", [[0], [1]])])
    >>> type(make_executor(program, lambda nodes, threads: None, [None, None])).__name__
    'CPUExecutor'
    """
    if not isinstance(devices, str):
        if len(devices) != len(program.streams):
            raise OpschedError(f"the program has {len(program.streams)} streams, but {len(devices)} devices were "
                               "given")
        if any(d is not None for d in devices):
            if cuda_graph:
                raise OpschedError("a program on several devices runs on their streams, not as one CUDA graph")
            from opsched.runtime.cuda import DevicesExecutor

            return DevicesExecutor(program, operator, devices)
        devices = "cpu"
    if devices == "cpu":
        from opsched.runtime.cpu import CPUExecutor

        return CPUExecutor(program, operator)
    if devices == "cuda":
        from opsched.runtime.cuda import CUDAExecutor

        return CUDAExecutor(program, operator, graph=cuda_graph)
    raise OpschedError(f"unknown device {devices!r}; choose from {', '.join(DEVICES)}")
