"""A StreamProgram lowered once for the executors: :func:`lower` makes each run step a :class:`Call` (the callable
of its units and the slots it reads, writes and releases), the one step type every backend reads by field: CPU
threads, one GPU's streams and graph, several devices, Ray actors. :class:`Remaining` counts a call's releases,
and a failing unit is one :class:`UnitFailed`.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.runtime.program import staged_program
>>> g = Graph([Node("a", args=("x",)), Node("b", args=("a",))], inputs=["x"])
>>> lowered = lower(staged_program(g, [("concurrent", [[0]]), ("concurrent", [[1]])]), lambda nodes, threads: None)
>>> [(c.name, c.reads, c.writes, c.release) for c in lowered.streams[0]]
[('a', (0,), (1,), ()), ('b', (1,), (2,), (1,))]
>>> lowered.slots, lowered.outputs
(3, (2,))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opsched.graph.ir import Node
from opsched.runtime.program import Record, Run, StreamProgram, Wait

__all__ = ["Call", "LoweredProgram", "LoweredStep", "Record", "Remaining", "StreamFailed", "UnitFailed", "Wait",
           "lower"]


class StreamFailed(RuntimeError):
    """Another stream failed; this one stopped."""


class UnitFailed(RuntimeError):
    """A unit raised while the program ran; ``unit`` names it (the units of a merge, joined by ``+``) and the
    original exception is the ``__cause__``."""

    def __init__(self, unit: str, error: Exception):
        lines = str(error).strip().splitlines()
        super().__init__(f"unit {unit!r} failed: {type(error).__name__}" + (f": {lines[0]}" if lines else ""))
        self.unit = unit


@dataclass(frozen=True)
class Call:
    """A run step lowered for an executor: ``fn`` called on the values of the slots ``reads`` gives the values
    of ``writes`` (one, or one per unit of a merge); ``release`` are the slots it is the (or a) last reader of
    on its stream, ``threads`` its intra-op threads, ``units`` and ``name`` what it runs (for timelines, and
    for :class:`UnitFailed`)."""

    fn: Callable[..., Any]
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    release: tuple[int, ...]
    threads: int
    units: tuple[int, ...]
    name: str

    def store(self, values: Any, result: Any) -> None:
        """Put the result in its slots of ``values`` (a list, or a dict): one value, or one per unit of a
        merge."""
        if len(self.writes) == 1:
            values[self.writes[0]] = result
        else:
            for slot, value in zip(self.writes, result):
                values[slot] = value


LoweredStep = Call | Record | Wait


@dataclass(frozen=True)
class LoweredProgram:
    """Each stream's lowered steps, and the slots they use: ``inputs`` graph inputs in the first slots, then one
    slot per unit (``slots`` in all); ``readers[slot]``, how many run steps release it; ``outputs``, the slots
    the program returns."""

    streams: tuple[tuple[LoweredStep, ...], ...]
    events: int
    inputs: int
    slots: int
    readers: tuple[int, ...]
    outputs: tuple[int, ...]

    def start(self, inputs: Sequence[Any]) -> list[Any]:
        """The slots of a call on ``inputs``: the inputs, then room for every unit's value."""
        if len(inputs) != self.inputs:
            raise ValueError(f"the program takes {self.inputs} inputs, got {len(inputs)}")
        values: list[Any] = [None] * self.slots
        values[:self.inputs] = inputs
        return values

    def calls(self, stream: int) -> list[Call]:
        """The run steps of ``stream``, in order."""
        return [s for s in self.streams[stream] if type(s) is Call]


def lower(program: StreamProgram, operator: Callable[[list[Node], int], Any],
          place: Callable[[int, list[Node]], list[Node]] | None = None) -> LoweredProgram:
    """``program`` with every :class:`~opsched.runtime.program.Run` made a :class:`Call`: ``operator(nodes,
    threads)`` makes the callable of a run step's units, after ``place(stream, nodes)``, when given, put them
    where that stream runs (their weights on its CUDA device, say)."""
    graph = program.graph
    inputs = len(graph.inputs)
    streams = []
    for k, steps in enumerate(program.streams):
        out: list[LoweredStep] = []
        for s in steps:
            if not isinstance(s, Run):
                out.append(s)
                continue
            nodes = [graph.nodes[u] for u in s.units]
            if place is not None:
                nodes = place(k, nodes)
            out.append(Call(operator(nodes, s.threads), tuple(program.slot(a) for a in nodes[0].args),
                            tuple(inputs + u for u in s.units), s.release, s.threads, s.units,
                            "+".join(n.name for n in nodes)))
        streams.append(tuple(out))
    return LoweredProgram(tuple(streams), program.events, inputs, inputs + len(graph), tuple(program.readers),
                          program.outputs)


class Remaining:
    """How many run steps of one call have still to release each slot (``counts``), streams on several threads
    counting down together. A step done with ``slot`` frees it when ``counts[slot] == 1 or last(slot)``: a slot
    with one release left has no other step to race with, so the common case takes no lock and no call."""

    __slots__ = ("counts", "lock")

    def __init__(self, program: LoweredProgram):
        self.counts = list(program.readers)
        self.lock = threading.Lock()

    def last(self, slot: int) -> bool:
        """Count down one release of ``slot``; whether it was the last."""
        with self.lock:
            self.counts[slot] -= 1
            return not self.counts[slot]
