"""A stand-in for CUDA: :class:`CudaStandIn` implements opsched's device interface
(:class:`opsched.runtime.cuda.CudaApi`) on CPU or ``meta`` tensors, so that the CUDA backend runs in CI on a
machine without a GPU, and raises :class:`BrokenRule` wherever a real GPU would fail or, worse, compute
garbage. Kernels run at once on the host; what the stand-in keeps is the *device's* view: what each stream
has queued, which work is ordered before which (a vector clock per stream, carried by events), which
stream allocated each tensor and which streams read it.

The rules, from PyTorch's and CUDA's documentation (torch.cuda.Stream, Event, Tensor.record_stream,
torch.cuda.graph and "CUDA Graphs: multi-stream capture"):

1. A stream waits only on an event that was recorded (waiting on an unrecorded event orders nothing).
2. A kernel on stream B reads a tensor written on stream A only after B waited for that write (through an
   event, or a synchronize): otherwise it races with the writer.
3. A tensor allocated on stream A and read on stream B is freed on the host only when protected: marked
   with ``record_stream`` for B, or A waited on an event recorded on B after the read. Otherwise the
   caching allocator may hand its block to A's next allocation while B still reads it. (Memory made
   during a capture belongs to the graph's private pool, freed with the graph, and is exempt once capture
   has ended.)
4. During graph capture, any stream other than the capture stream that gets work must first fork from it
   (wait on an event recorded on a captured stream after capture began); no captured stream waits on an
   event recorded outside the capture; nobody synchronises or reads event times; and by the end every
   forked stream has joined back (the capture stream waited for its last work).
5. Events have no order: they define no comparison, so ``min`` or ``<`` over them raises TypeError, as with
   ``torch.cuda.Event``.
6. ``elapsed_ms`` needs two timing events, both recorded and completed (a synchronize after the later one).
7. Nothing in inference mode leaks into later calls: no tensor a captured graph keeps (its static inputs,
   intermediates and outputs) is an inference tensor.
8. On ``meta`` (``CudaStandIn("meta")``), every tensor a kernel reads or makes is on the ``meta`` device
   (CPU scalars aside): a tensor created without ``device=`` shows up as a CPU tensor and is caught.

A tensor counts as freed when the host drops the last tensor object a kernel returned for its memory (as
the caching allocator sees it). A captured graph keeps aliases of the tensors its kernels used, not the
objects themselves, so that a value the program drops during capture is seen freed then; a replay re-runs
the captured kernels on those aliases, writing their results in place, as a real graph replays kernels at
fixed addresses.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class BrokenRule(Exception):
    """A use of the device interface that real CUDA would punish."""


class Stream:
    """A stand-in stream: ``position`` counts the work queued on it; ``clock[n]`` is how far stream ``n``'s
    work is known to be ordered before what is queued here next."""

    def __init__(self, number: int):
        self.number = number
        self.position = 0
        self.clock: dict[int, int] = {number: 0}

    def __repr__(self) -> str:
        return f"<stream {self.number}>"


class Event:
    """A stand-in event. It deliberately defines no ordering (rule 5)."""

    def __init__(self, timing: bool):
        self.timing = timing
        self.clock: dict[int, int] | None = None  # the recording stream's clock, once recorded
        self.stream: Stream | None = None
        self.host_time = 0.0
        self.capture: int | None = None  # the capture it was recorded in
        self.syncs_before = 0  # synchronisations done before it was recorded


@dataclass
class Graph:
    ops: list[tuple[Any, tuple, dict, Any]] = field(default_factory=list)
    captured: bool = False


@dataclass
class _Memory:
    """What the stand-in knows of one storage."""

    origin: Stream                        # the stream that allocated it
    writer: tuple[Stream, int] | None     # the last kernel that wrote it: (stream, position)
    capture: int | None = None            # the capture it was allocated in
    uses: list[tuple[Stream, int]] = field(default_factory=list)  # reads on streams other than origin
    protected: set[int] = field(default_factory=set)              # streams given to record_stream
    live: int = 0                         # tensor objects of it that kernels returned, still held


class CudaStandIn:
    """The device interface on ``device`` (``cpu`` or ``meta``) tensors, enforcing the rules above."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.default = Stream(0)
        self.streams = [self.default]
        self.current = self.default
        self.synced: dict[int, int] = {}
        self.syncs = 0
        self.capture_stream: Stream | None = None
        self.capture_id: int | None = None
        self.forked: set[int] = set()
        self.graph: Graph | None = None
        self.memory: dict[int, _Memory] = {}
        self.aliases: dict[int, torch.Tensor] = {}  # during capture: a kernel's output object -> the graph's alias
        self.broken: list[str] = []
        self.calls: dict[str, int] = {}
        self._captures = itertools.count(1)
        self._watch = _Watch(self)
        self._watching = 0

    # -- the device interface --

    def available(self) -> bool:
        return True

    def describe(self) -> str:
        return f"cuda|stand-in on {self.device.type}|sm_00|cuda none|torch {torch.__version__}"

    def current_stream(self) -> Stream:
        return self.current

    def new_stream(self) -> Stream:
        stream = Stream(len(self.streams))
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream: Stream):
        self._count("use_stream")
        if not isinstance(stream, Stream) or stream not in self.streams:
            raise TypeError(f"{stream!r} is not a stream of this device")
        previous, self.current = self.current, stream
        try:
            with self._watching_kernels():
                yield
        finally:
            self.current = previous

    def new_event(self, timing: bool = False) -> Event:
        return Event(timing)

    def record(self, event: Event, stream: Stream) -> None:
        self._count("record")
        self._raise_broken()
        self._may_work(stream, "records an event")
        event.clock = dict(stream.clock)
        event.stream = stream
        event.host_time = time.perf_counter()
        event.capture = self.capture_id
        event.syncs_before = self.syncs

    def wait(self, stream: Stream, event: Event) -> None:
        self._count("wait")
        self._raise_broken()
        if event.clock is None:
            raise BrokenRule(f"{stream!r} waits on an event that was never recorded")
        if self.capture_id is not None:
            if event.capture != self.capture_id:
                raise BrokenRule(f"{stream!r} waits, during capture, on an event recorded outside the capture")
            self.forked.add(stream.number)  # waiting on captured work makes a stream part of the capture
        self._may_work(stream, "waits on an event")
        for number, position in event.clock.items():
            stream.clock[number] = max(stream.clock.get(number, -1), position)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        self._count("record_stream")
        self._raise_broken()
        memory = self.memory.get(id(tensor.untyped_storage()))
        if memory is not None:
            memory.protected.add(stream.number)

    def synchronize(self) -> None:
        self._count("synchronize")
        self._raise_broken()
        if self.capture_id is not None:
            raise BrokenRule("synchronize during graph capture")
        self.synced = {s.number: s.position for s in self.streams}
        self.syncs += 1

    def elapsed_ms(self, start: Event, end: Event) -> float:
        self._count("elapsed_ms")
        if self.capture_id is not None:
            raise BrokenRule("event times read during graph capture")
        for event in (start, end):
            if not event.timing:
                raise BrokenRule("elapsed time of an event made without timing")
            if event.clock is None:
                raise BrokenRule("elapsed time of an event never recorded")
            if event.syncs_before >= self.syncs:
                raise BrokenRule("elapsed time of an event not known to be complete (no synchronize after it)")
        return (end.host_time - start.host_time) * 1000.0

    def new_graph(self) -> Graph:
        return Graph()

    @contextlib.contextmanager
    def capture(self, graph: Graph):
        self._count("capture")
        if self.capture_id is not None:
            raise BrokenRule("graph capture inside a graph capture")
        self.synchronize()  # torch.cuda.graph synchronises before it begins
        stream = self.new_stream()  # and captures on a side stream of its own
        previous = self.current
        self.current, self.capture_stream, self.capture_id = stream, stream, next(self._captures)
        self.forked, self.graph = {stream.number}, graph
        try:
            with self._watching_kernels():
                yield
            for number in sorted(self.forked - {stream.number}):
                if stream.clock.get(number, -1) < self.streams[number].position:
                    raise BrokenRule(f"stream {number} was not joined back into the capture stream "
                                     "before capture ended")
            for op in graph.ops:
                for t in _tensors(op[1:]):
                    if t.is_inference():
                        raise BrokenRule(f"the graph keeps an inference tensor (used by {op[0]}): a later call "
                                         "outside inference mode cannot update it")
            graph.captured = True
        finally:
            self.current, self.capture_stream, self.capture_id, self.graph = previous, None, None, None
            self.forked, self.aliases = set(), {}

    def replay(self, graph: Graph) -> None:
        self._count("replay")
        self._raise_broken()
        if not graph.captured:
            raise BrokenRule("replay of a graph that was never captured")
        stream = self.current  # the whole graph is one piece of work on the current stream
        stream.position += 1
        stream.clock[stream.number] = stream.position
        with torch.no_grad():
            for func, args, kwargs, outputs in graph.ops:
                fresh = func(*args, **kwargs)
                for kept, new in zip(_tensors(outputs), _tensors(fresh)):
                    if id(kept.untyped_storage()) != id(new.untyped_storage()):  # views and in-place: already there
                        kept.copy_(new)
                    memory = self.memory.get(id(kept.untyped_storage()))
                    if memory is not None:
                        memory.writer = (stream, stream.position)

    # -- for tests --

    def made_on_current(self, *tensors: torch.Tensor) -> None:
        """Say that ``tensors`` were just written on the current stream (as a copy to the device would)."""
        stream = self.current
        stream.position += 1
        stream.clock[stream.number] = stream.position
        for t in tensors:
            self._allocated(t, stream)

    def assert_ready(self, *tensors: Any) -> None:
        """Raise unless the current stream may read ``tensors`` (the program joined every stream back)."""
        for t in _tensors(tensors):
            self._read(t, self.current, "the caller")
        self.check()

    def check(self) -> None:
        """Raise the first rule broken when memory was freed (found by a finaliser, raised here)."""
        gc.collect()
        self._raise_broken()

    # -- bookkeeping --

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def _raise_broken(self) -> None:
        if self.broken:
            first, self.broken = self.broken[0], []
            raise BrokenRule(first)

    @contextlib.contextmanager
    def _watching_kernels(self):
        """Watch every ATen operator (a kernel) while a stream is current, once however deeply nested."""
        self._watching += 1
        try:
            if self._watching == 1:
                with self._watch:
                    yield
            else:
                yield
        finally:
            self._watching -= 1

    def _may_work(self, stream: Stream, what: str) -> None:
        if self.capture_id is not None and stream.number not in self.forked:
            raise BrokenRule(f"{stream!r} {what} during graph capture without having forked from the capture "
                             "stream (wait on an event recorded on it after capture began)")

    def _kernel(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._raise_broken()
        stream = self.current
        self._may_work(stream, f"runs {func}")
        inputs = _tensors((args, kwargs))
        self._check_device(func, inputs)
        stream.position += 1
        stream.clock[stream.number] = stream.position
        for t in inputs:
            self._read(t, stream, f"{func}")
        result = func(*args, **kwargs)
        outputs = _tensors(result)
        self._check_device(func, outputs)
        read = {id(t.untyped_storage()) for t in inputs}
        for t in outputs:
            key = id(t.untyped_storage())
            if key not in read:
                self._allocated(t, stream)
            elif key in self.memory:
                self._held(t, key)
                if func._schema.is_mutable:
                    self.memory[key].writer = (stream, stream.position)
        if self.graph is not None:
            kept_args, kept_kwargs = pytree.tree_map(self._alias, (args, kwargs))
            for t in outputs:
                self.aliases[id(t)] = t.detach()
                weakref.finalize(t, self.aliases.pop, id(t), None)
            self.graph.ops.append((func, kept_args, kept_kwargs, pytree.tree_map(self._alias, result)))
        return result

    def _alias(self, value: Any) -> Any:
        """What the graph keeps of ``value``: the alias of a kernel's output made during this capture (so
        that the object itself can die), else the value."""
        return self.aliases.get(id(value), value) if isinstance(value, torch.Tensor) else value

    def _check_device(self, func: Any, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device != self.device and not (t.dim() == 0 and t.device.type == "cpu"):
                raise BrokenRule(f"{func} meets a tensor on {t.device}; every tensor should be on {self.device}")

    def _read(self, t: torch.Tensor, stream: Stream, reader: str) -> None:
        memory = self.memory.get(id(t.untyped_storage()))
        if memory is None:
            return  # made before the stand-in saw it (weights, the caller's tensors): ready everywhere
        if memory.writer is not None:
            writer, position = memory.writer
            if (writer is not stream and stream.clock.get(writer.number, -1) < position
                    and self.synced.get(writer.number, -1) < position):
                raise BrokenRule(f"{reader} on {stream!r} reads a tensor written on {writer!r} without waiting "
                                 "for it (a race)")
        if memory.origin is not None and memory.origin is not stream:
            memory.uses.append((stream, stream.position))

    def _allocated(self, t: torch.Tensor, stream: Stream) -> None:
        key = id(t.untyped_storage())
        if key in self.memory:
            self.memory[key].writer = (stream, stream.position)
        else:
            self.memory[key] = _Memory(stream, (stream, stream.position), self.capture_id)
        self._held(t, key)

    def _held(self, t: torch.Tensor, key: int) -> None:
        self.memory[key].live += 1
        weakref.finalize(t, self._dropped, key)

    def _dropped(self, key: int) -> None:
        memory = self.memory.get(key)
        if memory is None:
            return
        memory.live -= 1
        if memory.live:
            return
        del self.memory[key]  # freed: the allocator may hand the block out again
        if memory.capture is not None and memory.capture != self.capture_id:
            return  # the graph's private pool, released with the graph
        origin = memory.origin
        if memory.capture is not None and memory.capture != self.capture_id:
            return  # the graph's private pool, released with the graph
        origin = memory.origin
        for stream, position in memory.uses:
            if stream.number in memory.protected:
                continue
            if origin.clock.get(stream.number, -1) >= position or self.synced.get(stream.number, -1) >= position:
                continue
            self.broken.append(f"a tensor allocated on {origin!r} and read on {stream!r} was freed without "
                               "record_stream or an event wait: its memory could be reused during the read")
            return


class _Watch(TorchDispatchMode):
    def __init__(self, standin: CudaStandIn):
        super().__init__()
        self.standin = standin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.standin._kernel(func, args, kwargs or {})


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
