"""The CUDA backend of one device: a StreamProgram on CUDA streams and events, optionally captured as one CUDA
graph; the ``threads`` peer's stream per task; event timing (:func:`time_cuda`).

Streams: stream 0 of the program is the caller's current stream; each other program stream gets its own
stream. A run step launches its units on its stream; ``record`` records an event on it and ``wait`` makes
the stream wait for an event: the host never blocks, the device orders the work. Before anything, every
side stream waits for the current stream (so that the inputs it wrote are ready); at the end the current
stream waits for every side stream (so that the caller sees finished outputs).

Memory: the caching allocator ties each block to the stream that allocated it, and may hand it out again as
soon as the tensor is freed *on the host*, while a kernel on another stream may still read it. So every
tensor read on a stream other than the one that made it is marked with ``Tensor.record_stream`` for the
reading stream before the host drops it; the allocator then waits for that stream's pending work before
reusing the block.

CUDA graphs (``graph=True``): the whole program is captured once into one CUDA graph. The side streams fork
from the capture stream after capture begins (they wait on an event recorded on it) and join back (the
capture stream waits on an event from each) before it ends, as multi-stream capture requires; inside the
graph only those dependency edges remain, so replay has no launch or event overhead. Every value stays
alive until capture ends, so the graph's private pool never hands a block read on one stream to another.
A graph reads and writes fixed addresses: the module keeps *static* input tensors, copies each call's
inputs into them, replays, and returns the static outputs. Those outputs are overwritten by the next call:
clone them to keep them. Whatever the graph keeps across calls (static inputs, intermediates, outputs) is
made as ordinary tensors without autograd, never as inference tensors, even when the first call runs in
inference mode (as :func:`opsched.verify` does): a later call outside inference mode copies its inputs
into the static ones, which PyTorch refuses for an inference tensor.

Timing (``record_timeline``): an event pair around every run step and one origin event recorded on the
current stream before the side streams fork; ``timeline`` then holds (stream, units, start, finish) in
seconds from the origin, read after a synchronise. Events have no order of their own (the device decides
when work on two streams runs), so every time is measured from that one origin, which precedes all the
program's work on every stream.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from opsched.runtime.cuda.api import CudaApi, CudaError, current_api
from opsched.runtime.kernels import Operator
from opsched.runtime.lowered import Call, Record, Remaining, Wait, lower
from opsched.runtime.program import StreamProgram

HOLD_MARGIN = 1.5  # a hold lasts this many times the host's last time for the work queued behind it,
HOLD_EXTRA_MS = 0.05  # plus this, so that the host's jitter does not reach the device


class StreamPerTask:
    """A CUDA stream for each of ``count`` tasks that host threads run at once (the ``threads`` peer of a model
    batch: each model's forward on a thread of its own). A task queues its kernels on its own stream
    (:meth:`on`) instead of the one default stream every thread shares, which would run them one after
    another; :meth:`fork`, called by the submitting thread first, makes every stream wait for what that
    thread queued before (the inputs). The caller synchronises the device before reading the outputs, so
    no stream's memory is read or freed while it is still being written."""

    def __init__(self, count: int, api: CudaApi | None = None):
        self.api = api or current_api()
        self.streams = [self.api.new_stream() for _ in range(count)]

    def fork(self) -> None:
        event = self.api.new_event()
        self.api.record(event, self.api.current_stream())
        for stream in self.streams:
            self.api.wait(stream, event)

    def on(self, task: int) -> contextlib.AbstractContextManager:
        return self.api.use_stream(self.streams[task])


class CUDAExecutor:
    """Execute ``program`` on the current CUDA device (see the module docstring) through ``api`` (default:
    :func:`current_api`)."""

    def __init__(self, program: StreamProgram, operator: Operator, graph: bool = False, api: CudaApi | None = None):
        self.cuda = api or current_api()
        if not self.cuda.available():
            raise CudaError("CUDA is not available")
        self.program = program
        self.lowered = lower(program, operator)
        self._streams: list[Any] = [None] + [self.cuda.new_stream() for _ in program.streams[1:]]
        produced_on = {slot: k for k in range(len(program.streams)) for c in self.lowered.calls(k)
                       for slot in c.writes}
        # per run step, the inputs made on another stream (or by the caller, for side streams): record_stream
        self._foreign = [[tuple(a for a in c.reads if produced_on.get(a, 0) != k) if type(c) is Call else ()
                          for c in steps] for k, steps in enumerate(self.lowered.streams)]
        self._use_graph = graph
        self._graph: Any = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_outputs: list[Any] = []
        self.timeline: list[tuple[int, tuple[int, ...], float, float]] | None = None

    def __call__(self, *inputs: torch.Tensor, record_timeline: bool = False) -> list[Any]:
        values = self.lowered.start(inputs)  # the count of inputs checked in either mode
        if not self._use_graph:
            with _no_cast_cache():
                return self._launch(values, record_timeline)
        if torch.is_autocast_enabled("cuda"):
            # autocast's cached casts of the weights would be recorded by address and freed when the autocast ends
            raise CudaError("a CUDA graph is not captured or replayed under autocast (the weights' casts it would "
                            "record are freed when autocast ends): run the plan on streams, without cuda_graph")
        if record_timeline:
            raise CudaError("a replayed CUDA graph has no per-unit timeline; record it without cuda_graph")
        if self._graph is None:
            self._capture(inputs)
        for static, x in zip(self._static_inputs, inputs):
            static.copy_(x, non_blocking=True)
        self.cuda.replay(self._graph)
        return list(self._static_outputs)

    def close(self) -> None:
        """Nothing to stop: streams are released with the executor."""

    def _after(self, stream: Any, other: Any) -> None:
        after(self.cuda, stream, other)

    def _launch(self, values: list[Any], record_timeline: bool, kept: list | None = None) -> list[Any]:
        """Queue the program on the streams, ``values`` holding the inputs (see :meth:`LoweredProgram.start`);
        while capturing a graph, ``kept`` receives every value, for the caller to hold until capture has
        ended."""
        cuda = self.cuda
        capturing = kept is not None
        current = cuda.current_stream()
        streams = [current] + self._streams[1:]
        remaining = Remaining(self.lowered)
        events = [cuda.new_event() for _ in range(self.lowered.events)]
        origin = None
        if record_timeline:
            origin = cuda.new_event(timing=True)
            cuda.record(origin, current)
        for s in streams[1:]:
            self._after(s, current)  # side streams start after what the caller queued (the inputs)
        marks = []
        with autograd_off(persistent=capturing):
            # Streams are walked in turn: a stream's steps are queued until it waits on an event that no
            # stream has recorded yet, then the next stream is served; the device does the ordering.
            position = [0] * len(streams)
            recorded: set[int] = set()
            while any(position[k] < len(steps) for k, steps in enumerate(self.lowered.streams)):
                progressed = False
                for k, steps in enumerate(self.lowered.streams):
                    with cuda.use_stream(streams[k]):
                        while position[k] < len(steps):
                            step = steps[position[k]]
                            if type(step) is Wait:
                                if step.event not in recorded:
                                    break
                                cuda.wait(streams[k], events[step.event])
                            elif type(step) is Record:
                                cuda.record(events[step.event], streams[k])
                                recorded.add(step.event)
                            else:
                                if not capturing:
                                    for a in self._foreign[k][position[k]]:
                                        if isinstance(values[a], torch.Tensor):
                                            cuda.record_stream(values[a], streams[k])
                                if record_timeline:
                                    began, ended = cuda.new_event(timing=True), cuda.new_event(timing=True)
                                    cuda.record(began, streams[k])
                                result = step.fn(*[values[a] for a in step.reads])
                                if record_timeline:
                                    cuda.record(ended, streams[k])
                                    marks.append((k, step.units, began, ended))
                                step.store(values, result)
                                for slot in step.release:
                                    # during capture every value lives until capture ends (see above)
                                    if (remaining.counts[slot] == 1 or remaining.last(slot)) and not capturing:
                                        values[slot] = None
                            position[k] += 1
                            progressed = True
                if not progressed:
                    raise RuntimeError("the stream program deadlocks: a stream waits on an event never recorded")
        for s in streams[1:]:
            self._after(current, s)
        if capturing:
            kept.append(values)
        if record_timeline:
            cuda.synchronize()
            self.timeline = [(k, units, cuda.elapsed_ms(origin, b) / 1000.0, cuda.elapsed_ms(origin, e) / 1000.0)
                             for k, units, b, e in marks]
        return [values[s] for s in self.lowered.outputs]

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        """Capture the program into one CUDA graph with static inputs (after a warm-up on a side stream,
        which CUDA graph capture needs so that lazy initialisation is not captured)."""
        with autograd_off(persistent=True):
            self._static_inputs = [x.detach().clone() for x in inputs]
        kept: list = []
        # Inside capture, the current stream is the capture stream: _launch forks the side streams from it with
        # an event and joins them back before capture ends.
        self._graph, self._static_outputs = capture_graph(
            self.cuda, lambda capturing: self._launch(self.lowered.start(self._static_inputs), False,
                                                      kept if capturing else None))
        kept.clear()  # every value lived until capture ended; their memory is the graph's now


def after(cuda: CudaApi, stream: Any, other: Any) -> None:
    """Work queued on ``stream`` from now on starts after what is queued on ``other`` now."""
    event = cuda.new_event()
    cuda.record(event, other)
    cuda.wait(stream, event)


def capture_graph(cuda: CudaApi, run: Callable[[bool], Any], warmups: int = 1) -> tuple[Any, Any]:
    """PyTorch's recipe for a CUDA graph: ``run(False)`` called ``warmups`` times on a side stream that starts
    after the caller's work (lazy initialisation, cuDNN's choices and workspaces must not be captured), the caller
    waiting for it, then ``run(True)`` captured into a new graph. Returns the graph and what the captured call
    returned (its static outputs)."""
    caller, warmup = cuda.current_stream(), cuda.new_stream()
    after(cuda, warmup, caller)
    with cuda.use_stream(warmup):
        for _ in range(warmups):
            run(False)
    after(cuda, caller, warmup)
    graph = cuda.new_graph()
    with cuda.capture(graph):
        outputs = run(True)
    return graph, outputs


@contextlib.contextmanager
def _no_cast_cache() -> Iterator[None]:
    """Under autocast, no cached casts of the weights: every stream is launched from this one thread, which
    shares one cache, and a cast made on one stream would be read on another with nothing ordering the two
    (each stream casts for itself instead)."""
    if not torch.is_autocast_enabled("cuda") or not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def autograd_off(persistent: bool) -> contextlib.AbstractContextManager:
    """No autograd while a program runs: inference mode for a call's own tensors; for the tensors a CUDA
    graph keeps across calls (``persistent``), ordinary tensors under ``no_grad`` (see the module
    docstring), even inside a caller's inference mode."""
    if not persistent:
        return torch.inference_mode()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def time_cuda(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, api: CudaApi | None = None,
              queued: bool = False) -> float:
    """Median milliseconds of ``fn`` on the device, timed with events around each call on the current
    stream (default interface: :func:`current_api`). ``queued``: each call is queued behind a hold (see
    :func:`hold_for`), so that its launches are hidden and the events time its device work alone."""
    cuda = api or current_api()
    host_seconds = 0.0
    for _ in range(warmup):
        began_on_host = time.perf_counter()
        fn()
        host_seconds = time.perf_counter() - began_on_host
    samples = []
    for _ in range(repeats):
        if queued:
            hold_for(cuda, host_seconds)
        stream = cuda.current_stream()
        began, ended = cuda.new_event(timing=True), cuda.new_event(timing=True)
        cuda.record(began, stream)
        fn()
        cuda.record(ended, stream)
        cuda.synchronize()
        samples.append(cuda.elapsed_ms(began, ended))
    return statistics.median(samples)


def hold_for(cuda: CudaApi, host_seconds: float) -> None:
    """Hold the current stream (:meth:`~opsched.runtime.cuda.api.CudaApi.hold`) for longer than the host took,
    last time, to queue (and wait for) what comes next: that work then runs on the device back to back, its
    launches hidden, as it runs replayed in a CUDA graph. Not checked: that the host did finish queuing within the
    hold (a host stalled by a full launch queue, or by a collection, leaves part of the run launch-bound)."""
    cuda.hold(HOLD_MARGIN * host_seconds * 1000.0 + HOLD_EXTRA_MS)
