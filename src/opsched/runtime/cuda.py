"""The CUDA backend: a StreamProgram on torch.cuda streams and events, optionally captured as one CUDA graph.
All CUDA-only code of opsched is in this module.

Streams: stream 0 of the program is the caller's current stream; each other program stream gets its own
``torch.cuda.Stream``. A run step launches its units on its stream; ``record`` records a
``torch.cuda.Event`` on it and ``wait`` makes the stream wait for an event (``Stream.wait_event``): the
host never blocks, the device orders the work. Before anything, every side stream waits for the current
stream (so that the inputs it wrote are ready); at the end the current stream waits for every side stream
(so that the caller sees finished outputs).

Memory: the caching allocator ties each block to the stream that allocated it, and may hand it out again as
soon as the tensor is freed *on the host*, while a kernel on another stream may still read it. So every
tensor read on a stream other than the one that made it is marked with ``Tensor.record_stream`` for the
reading stream before the host drops it; the allocator then waits for that stream's pending work before
reusing the block.

CUDA graphs (``graph=True``): the whole program is captured once into one ``torch.cuda.CUDAGraph``. The
side streams fork from the capture stream after capture begins (they wait on an event recorded on it) and
join back (the capture stream waits on an event from each) before it ends, as multi-stream capture
requires; inside the graph only those dependency edges remain, so replay has no launch or event overhead.
A graph reads and writes fixed addresses: the module keeps *static* input tensors, copies each call's
inputs into them, replays, and returns the static outputs. Those outputs are overwritten by the next call:
clone them to keep them.

Timing (``record_timeline``): an event pair around every run step; ``timeline`` then holds
(stream, units, start, finish) in seconds from the first event, read after a synchronise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from opsched.runtime.kernels import Operator
from opsched.runtime.program import Record, Run, StreamProgram, Wait, store_outputs


def available() -> bool:
    return torch.cuda.is_available()


class CUDAExecutor:
    """Execute ``program`` on the current CUDA device (see the module docstring)."""

    def __init__(self, program: StreamProgram, operator: Operator, graph: bool = False):
        if not available():
            raise RuntimeError("CUDA is not available")
        self.program = program
        g = program.graph
        self._inputs = len(g.inputs)
        self._slots = self._inputs + len(g)
        self._streams: list[torch.cuda.Stream | None] = [None] + [torch.cuda.Stream() for _ in program.streams[1:]]
        self._steps = []
        produced_on = {}
        for k, steps in enumerate(program.streams):
            for s in steps:
                if isinstance(s, Run):
                    for u in s.units:
                        produced_on[self._inputs + u] = k
        for k, steps in enumerate(program.streams):
            compiled = []
            for s in steps:
                if isinstance(s, Run):
                    first = g.nodes[s.units[0]]
                    args = tuple(program.slot(a) for a in first.args)
                    # inputs made on another stream (or by the caller, for side streams) need record_stream
                    foreign = tuple(a for a in args if produced_on.get(a, 0) != k)
                    compiled.append(("run", operator([g.nodes[u] for u in s.units], s.threads), args,
                                     tuple(self._inputs + u for u in s.units), s.release, foreign, s.units))
                elif isinstance(s, Record):
                    compiled.append(("record", s.event))
                elif isinstance(s, Wait):
                    compiled.append(("wait", s.event))
            self._steps.append(compiled)
        self._use_graph = graph
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_outputs: list[Any] = []
        self.timeline: list[tuple[int, tuple[int, ...], float, float]] | None = None

    def __call__(self, *inputs: torch.Tensor, record_timeline: bool = False) -> list[Any]:
        if len(inputs) != self._inputs:
            raise ValueError(f"the program takes {self._inputs} inputs, got {len(inputs)}")
        if not self._use_graph:
            return self._launch(list(inputs), record_timeline)
        if self._graph is None:
            self._capture(inputs)
        for static, x in zip(self._static_inputs, inputs):
            static.copy_(x, non_blocking=True)
        self._graph.replay()
        return list(self._static_outputs)

    def close(self) -> None:
        """Nothing to stop: streams are released with the executor."""

    def _launch(self, inputs: list[Any], record_timeline: bool, capturing: bool = False) -> list[Any]:
        current = torch.cuda.current_stream()
        streams = [current] + self._streams[1:]
        values: list[Any] = [None] * self._slots
        values[:len(inputs)] = inputs
        remaining = list(self.program.readers)
        events = [torch.cuda.Event() for _ in range(self.program.events)]
        fork = torch.cuda.Event()
        fork.record(current)
        for s in streams[1:]:
            s.wait_event(fork)  # side streams start after what the caller queued (the inputs)
        marks = []
        with torch.inference_mode():
            # Streams are walked in turn: a stream's steps are queued until it waits on an event that no
            # stream has recorded yet, then the next stream is served; the device does the ordering.
            position = [0] * len(streams)
            recorded: set[int] = set()
            while any(position[k] < len(self._steps[k]) for k in range(len(streams))):
                progressed = False
                for k, steps in enumerate(self._steps):
                    with torch.cuda.stream(streams[k]):
                        while position[k] < len(steps):
                            step = steps[position[k]]
                            if step[0] == "wait":
                                if step[1] not in recorded:
                                    break
                                streams[k].wait_event(events[step[1]])
                            elif step[0] == "record":
                                events[step[1]].record(streams[k])
                                recorded.add(step[1])
                            else:
                                _, fn, args, outs, release, foreign, units = step
                                for a in foreign:
                                    if isinstance(values[a], torch.Tensor) and not capturing:
                                        values[a].record_stream(streams[k])
                                if record_timeline:
                                    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                                        enable_timing=True)
                                    began.record(streams[k])
                                result = fn(*[values[a] for a in args])
                                if record_timeline:
                                    ended.record(streams[k])
                                    marks.append((k, units, began, ended))
                                store_outputs(values, outs, result)
                                for slot in release:
                                    remaining[slot] -= 1
                                    # During capture every value stays alive until capture ends, so the
                                    # graph's private pool never hands a block read on one stream to another.
                                    if remaining[slot] == 0 and not capturing:
                                        values[slot] = None
                            position[k] += 1
                            progressed = True
                if not progressed:
                    raise RuntimeError("the stream program deadlocks: a stream waits on an event never recorded")
        for s in streams[1:]:
            join = torch.cuda.Event()
            join.record(s)
            current.wait_event(join)
        if record_timeline:
            torch.cuda.synchronize()
            origin = min(b for _, _, b, _ in marks) if marks else None
            self.timeline = [(k, units, origin.elapsed_time(b) / 1000.0, origin.elapsed_time(e) / 1000.0)
                             for k, units, b, e in marks]
        return [values[s] for s in self.program.outputs]

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        """Capture the program into one CUDA graph with static inputs (after a warm-up on a side stream,
        which CUDA graph capture needs so that lazy initialisation is not captured)."""
        self._static_inputs = [x.clone() for x in inputs]
        warmup = torch.cuda.Stream()
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warmup):
            self._launch(list(self._static_inputs), False)
        torch.cuda.current_stream().wait_stream(warmup)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            # Inside capture, the current stream is the capture stream: _launch forks the side streams from
            # it with an event and joins them back before capture ends.
            self._static_outputs = self._launch(list(self._static_inputs), False, capturing=True)


def time_cuda(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the device, timed with CUDA events around each call."""
    import statistics

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        fn()
        ended.record()
        ended.synchronize()
        samples.append(began.elapsed_time(ended))
    return statistics.median(samples)
