"""A stand-in for CUDA: :class:`CudaStandIn` implements opsched's device interface
(:class:`opsched.runtime.cuda.CudaApi`) on CPU or ``meta`` tensors, so that the CUDA backend runs in CI on a
machine without a GPU, and raises :class:`BrokenRule` wherever a real GPU would fail or, worse, compute
garbage. Kernels run at once on the host; what the stand-in keeps is the *device's* view: what each stream
has queued, which work is ordered before which (a vector clock per stream, carried by events), which
stream allocated each tensor and which streams read it, and what the host knows finished (``synced``).

Several GPUs (``CudaStandIn(devices=N)``): every tensor is tagged with where it is, CUDA device k (made by
a kernel, a copy or :meth:`place` on a stream of device k) or the host (a copy to the host, and every tensor
the stand-in did not see made: the caller's inputs, the model's own weights). Without ``devices`` it models
one GPU on which every tensor it did not see made already is (a model and inputs moved there by the caller).
Like PyTorch, each host thread has its current device and a current stream per device; ``use_stream`` makes
the stream's device current. The stand-in is safe to call from several threads (one lock; each thread's
kernels are watched by a dispatch mode of its own).

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
9. A kernel on a stream of device k reads only tensors on device k (CPU scalars aside): a tensor of another
   device, or of the host, must be copied first (:meth:`to`; the copy reads its source on the target's current
   stream, so rules 2 and 3 apply to it there), and weights must be placed there (:meth:`place`). An event is
   recorded only on streams of the device it was first recorded on.
10. A copy to the host is read on the host (any operator on it, in any thread) only once the host has
   synchronised with it: with an event recorded after it (:meth:`synchronize_event`) or with its device
   (:meth:`synchronize`). A copy to the host with ``non_blocking`` lands when the device gets to it.

A tensor counts as freed when the host drops the last tensor object a kernel returned for its memory (as
the caching allocator sees it). A captured graph keeps aliases of the tensors its kernels used, not the
objects themselves, so that a value the program drops during capture is seen freed then; a replay re-runs
the captured kernels on those aliases, writing their results in place, as a real graph replays kernels at
fixed addresses.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import threading
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
    """A stand-in stream of CUDA device ``device``: ``position`` counts the work queued on it; ``clock[n]`` is
    how far stream ``n``'s work is known to be ordered before what is queued here next."""

    def __init__(self, number: int, device: int = 0):
        self.number = number
        self.device = device
        self.position = 0
        self.clock: dict[int, int] = {number: 0}

    def __repr__(self) -> str:
        return f"<stream {self.number} of cuda:{self.device}>"

    def queue(self) -> int:
        """One more piece of work queued here (a kernel, a copy, a replay): its position."""
        self.position += 1
        self.clock[self.number] = self.position
        return self.position


class Event:
    """A stand-in event. It deliberately defines no ordering (rule 5)."""

    def __init__(self, timing: bool):
        self.timing = timing
        self.clock: dict[int, int] | None = None  # the recording stream's clock, once recorded
        self.stream: Stream | None = None
        self.host_time = 0.0
        self.capture: int | None = None  # the capture it was recorded in

    def done(self, synced: dict[int, int]) -> bool:
        """Known finished by the host, which has synchronised up to ``synced``."""
        return synced.get(self.stream.number, -1) >= self.clock[self.stream.number]


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
    device: int = 0                       # the CUDA device it is on
    uses: list[tuple[Stream, int]] = field(default_factory=list)  # reads on streams other than origin
    protected: set[int] = field(default_factory=set)              # streams given to record_stream
    live: int = 0                         # tensor objects of it that kernels returned, still held


class _Thread(threading.local):
    """What each host thread has of its own, as in PyTorch: a current device and a current stream per device;
    and the dispatch mode watching its kernels."""

    def __init__(self):
        self.device = 0
        self.current: dict[int, Stream] = {}
        self.watch: _Watch | None = None
        self.watching = 0
        self.paused = False  # inside the stand-in's own copies, whose kernels are not the program's


class CudaStandIn:
    """The device interface on ``device`` (``cpu`` or ``meta``) tensors, enforcing the rules above; with
    ``devices``, that many GPUs and the host, each tensor on one of them (see the module docstring)."""

    def __init__(self, device: str = "cpu", devices: int | None = None):
        self.device = torch.device(device)
        self.devices = devices
        self.streams = [Stream(k, k) for k in range(devices or 1)]  # stream k: device k's default stream
        self.defaults = list(self.streams)
        self.synced: dict[int, int] = {}  # per stream, how far the host knows its work finished
        self.capture_stream: Stream | None = None
        self.capture_id: int | None = None
        self.forked: set[int] = set()
        self.graph: Graph | None = None
        self.memory: dict[int, _Memory] = {}
        self.aliases: dict[int, torch.Tensor] = {}  # during capture: a kernel's output object -> the graph's alias
        self.broken: list[str] = []
        self.calls: dict[str, int] = {}
        self.holds: list[tuple[int, float, str | None]] = []  # per hold: its stream, its ms, what came next on it
        self._captures = itertools.count(1)
        self._lock = threading.RLock()
        self._thread = _Thread()

    # -- the device interface --

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices or 1

    def describe(self) -> str:
        return f"cuda|stand-in on {self.device.type}|sm_00|cuda none|torch {torch.__version__}"

    def current_stream(self) -> Stream:
        return self._current_of(self._thread.device)

    def new_stream(self, device: int | None = None) -> Stream:
        with self._lock:
            device = self._thread.device if device is None else device
            if not 0 <= device < self.device_count():
                raise ValueError(f"cuda:{device} is not a device of this stand-in ({self.device_count()} devices)")
            stream = Stream(len(self.streams), device)
            self.streams.append(stream)
            return stream

    @contextlib.contextmanager
    def use_stream(self, stream: Stream):
        self._count("use_stream")
        if not isinstance(stream, Stream) or stream not in self.streams:
            raise TypeError(f"{stream!r} is not a stream of this device")
        state = self._thread
        device, previous = state.device, state.current.get(stream.device)
        self._set_current(stream)
        try:
            with self._watching_kernels():
                yield
        finally:
            state.device = device
            if previous is None:
                del state.current[stream.device]
            else:
                state.current[stream.device] = previous

    def new_event(self, timing: bool = False) -> Event:
        return Event(timing)

    def record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            self._count("record")
            self._raise_broken()
            self._may_work(stream, "records an event")
            if event.stream is not None and event.stream.device != stream.device:
                raise BrokenRule(f"an event of cuda:{event.stream.device} recorded on {stream!r}")
            self._after_hold(stream, "a timing event" if event.timing else "an event")
            event.clock = dict(stream.clock)
            event.stream = stream
            event.host_time = time.perf_counter()
            event.capture = self.capture_id

    def wait(self, stream: Stream, event: Event) -> None:
        with self._lock:
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
        with self._lock:
            self._count("record_stream")
            self._raise_broken()
            memory = self.memory.get(id(tensor.untyped_storage()))
            if memory is not None:
                memory.protected.add(stream.number)

    def place(self, module: torch.nn.Module, device: int) -> torch.nn.Module:
        with self._lock:
            self._count("place")
            self._raise_broken()
            stream = self._current_of(device)
            self._may_work(stream, "places weights")
            with self._paused():
                placed = copy.deepcopy(module).to(self.device)
            for t in (*placed.parameters(), *placed.buffers()):
                self._allocated(t, stream)
                self.memory[id(t.untyped_storage())].writer = None  # copied without non_blocking: there on return
            return placed

    def to(self, tensor: torch.Tensor, device: int | None) -> torch.Tensor:
        with self._lock:
            self._count("to")
            self._raise_broken()
            source = self._where(tensor)
            if device == source:  # already there: .to returns the tensor itself
                return tensor
            stream = self._current_of(source if device is None else device)
            self._may_work(stream, "copies a tensor")
            stream.queue()
            self._read(tensor, stream, "a copy", copying=True)
            with self._paused():
                moved = tensor.detach().clone()  # copying a copy to the host reads it there: rule 10 applies
            if device is None:
                return HostCopy(moved, self, stream, stream.position)
            self._allocated(moved, stream)
            return moved

    def synchronize(self) -> None:
        with self._lock:
            self._count("synchronize")
            self._raise_broken()
            if self.capture_id is not None:
                raise BrokenRule("synchronize during graph capture")
            for stream in self.streams:
                if stream.device == self._thread.device:
                    self.synced[stream.number] = stream.position

    def synchronize_event(self, event: Event) -> None:
        with self._lock:
            self._count("synchronize_event")
            self._raise_broken()
            if self.capture_id is not None:
                raise BrokenRule("the host synchronises with an event during graph capture")
            if event.clock is None:
                raise BrokenRule("the host synchronises with an event that was never recorded")
            for number, position in event.clock.items():
                self.synced[number] = max(self.synced.get(number, -1), position)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        with self._lock:
            self._count("elapsed_ms")
            if self.capture_id is not None:
                raise BrokenRule("event times read during graph capture")
            for event in (start, end):
                if not event.timing:
                    raise BrokenRule("elapsed time of an event made without timing")
                if event.clock is None:
                    raise BrokenRule("elapsed time of an event never recorded")
                if not event.done(self.synced):
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
        previous = self.current_stream()
        self._set_current(stream)
        self.capture_stream, self.capture_id = stream, next(self._captures)
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
            self._set_current(previous)
            self.capture_stream, self.capture_id, self.graph = None, None, None
            self.forked, self.aliases = set(), {}

    def replay(self, graph: Graph) -> None:
        with self._lock:
            self._count("replay")
            self._raise_broken()
            if not graph.captured:
                raise BrokenRule("replay of a graph that was never captured")
            stream = self.current_stream()  # the whole graph is one piece of work on the current stream
            stream.queue()
            with torch.no_grad():
                for func, args, kwargs, outputs in graph.ops:
                    fresh = func(*args, **kwargs)
                    for kept, new in zip(_tensors(outputs), _tensors(fresh)):
                        if id(kept.untyped_storage()) != id(new.untyped_storage()):  # views and in-place: already there
                            kept.copy_(new)
                        memory = self.memory.get(id(kept.untyped_storage()))
                        if memory is not None:
                            memory.writer = (stream, stream.position)

    def hold(self, ms: float) -> None:
        with self._lock:
            self._count("hold")
            self._raise_broken()
            if self.capture_id is not None:
                raise BrokenRule("a hold (a spin kernel for timing) during graph capture")
            stream = self.current_stream()  # one kernel on the current stream, reading and writing nothing
            stream.queue()
            self.holds.append((stream.number, ms, None))

    def _after_hold(self, stream: Stream, what: str) -> None:
        """Say what came first on ``stream`` after its last hold (a timed run's first event, it should be)."""
        for k in range(len(self.holds) - 1, -1, -1):
            number, ms, following = self.holds[k]
            if number == stream.number:
                if following is None:
                    self.holds[k] = (number, ms, what)
                return

    # -- for tests --

    def made_on_current(self, *tensors: torch.Tensor) -> None:
        """Say that ``tensors`` were just written on the current stream (as a copy to the device would)."""
        with self._lock:
            stream = self.current_stream()
            stream.queue()
            for t in tensors:
                self._allocated(t, stream)

    def assert_ready(self, *tensors: Any) -> None:
        """Raise unless the current stream may read ``tensors`` (the program joined every stream back)."""
        with self._lock:
            for t in _tensors(tensors):
                self._read(t, self.current_stream(), "the caller")
        self.check()

    def check(self) -> None:
        """Raise the first rule broken when memory was freed (found by a finaliser, raised here)."""
        gc.collect()
        with self._lock:
            self._raise_broken()

    # -- bookkeeping --

    def _count(self, what: str) -> None:
        with self._lock:
            self.calls[what] = self.calls.get(what, 0) + 1

    def _raise_broken(self) -> None:
        if self.broken:
            first, self.broken = self.broken[0], []
            raise BrokenRule(first)

    def _current_of(self, device: int) -> Stream:
        """This thread's current stream of ``device``."""
        return self._thread.current.get(device) or self.defaults[device]

    def _set_current(self, stream: Stream) -> None:
        self._thread.device = stream.device
        self._thread.current[stream.device] = stream

    @contextlib.contextmanager
    def _watching_kernels(self):
        """Watch every ATen operator (a kernel) this thread runs while a stream is current, once however deeply
        nested."""
        state = self._thread
        state.watching += 1
        try:
            if state.watching == 1:
                state.watch = state.watch or _Watch(self)
                with state.watch:
                    yield
            else:
                yield
        finally:
            state.watching -= 1

    @contextlib.contextmanager
    def _paused(self):
        """The operators run here are the stand-in's own (a copy), not kernels of the program."""
        state = self._thread
        paused, state.paused = state.paused, True
        try:
            yield
        finally:
            state.paused = paused

    def _may_work(self, stream: Stream, what: str) -> None:
        if self.capture_id is not None and stream.number not in self.forked:
            raise BrokenRule(f"{stream!r} {what} during graph capture without having forked from the capture "
                             "stream (wait on an event recorded on it after capture began)")

    def _kernel(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._thread.paused:
            return func(*args, **kwargs)
        with self._lock:
            self._raise_broken()
            stream = self.current_stream()
            self._may_work(stream, f"runs {func}")
            inputs = _tensors((args, kwargs))
            self._check_device(func, inputs)
            stream.queue()
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
            if t.device != self.device and not _scalar(t):
                raise BrokenRule(f"{func} meets a tensor on {t.device}; every tensor should be on {self.device}")

    def _where(self, t: torch.Tensor) -> int | None:
        """The CUDA device ``t`` is on; None for the host (a copy to it, or, with ``devices``, a tensor the
        stand-in did not see made)."""
        if isinstance(t, HostCopy):
            return None
        memory = self.memory.get(id(t.untyped_storage()))
        return memory.device if memory is not None else None

    def _read(self, t: torch.Tensor, stream: Stream, reader: str, copying: bool = False) -> None:
        """``reader`` on ``stream`` reads ``t``: on its device (rule 9, but for a copy, which reads any
        device's tensor), after its writer (rule 2); a read on another stream than the one that made it is a
        use (rule 3)."""
        memory = None if isinstance(t, HostCopy) else self.memory.get(id(t.untyped_storage()))
        # on one GPU, a tensor the stand-in did not see made is taken to be there already
        placed = memory is not None or isinstance(t, HostCopy) or self.devices is not None
        where = self._where(t)
        host_scalar = where is None and _scalar(t) and not isinstance(t, HostCopy)  # passed to kernels by value
        if placed and not copying and not host_scalar and where != stream.device:
            raise BrokenRule(f"{reader} on {stream!r} reads a tensor on {'the host' if where is None else f'cuda:{where}'}"
                             f" without copying it to cuda:{stream.device}")
        if memory is None:
            return  # the host's (copies read it at once), or, on one GPU, made before the stand-in saw it
        if memory.writer is not None:
            writer, position = memory.writer
            if (writer is not stream and stream.clock.get(writer.number, -1) < position
                    and self.synced.get(writer.number, -1) < position):
                raise BrokenRule(f"{reader} on {stream!r} reads a tensor written on {writer!r} without waiting "
                                 "for it (a race)")
        if memory.origin is not stream:
            memory.uses.append((stream, stream.position))

    def _host_read(self, copy: HostCopy, func: Any) -> None:
        with self._lock:
            if self.synced.get(copy.stream.number, -1) < copy.position:
                raise BrokenRule(f"the host reads ({func}) a copy to the host from {copy.stream!r} before "
                                 "synchronising with it (an event recorded after the copy)")

    def _allocated(self, t: torch.Tensor, stream: Stream) -> None:
        key = id(t.untyped_storage())
        if key in self.memory:
            self.memory[key].writer = (stream, stream.position)
        else:
            self.memory[key] = _Memory(stream, (stream, stream.position), self.capture_id, stream.device)
        self._held(t, key)

    def _held(self, t: torch.Tensor, key: int) -> None:
        self.memory[key].live += 1
        weakref.finalize(t, self._dropped, key)

    def _dropped(self, key: int) -> None:
        with self._lock:
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
            for stream, position in memory.uses:
                if stream.number in memory.protected:
                    continue
                if origin.clock.get(stream.number, -1) >= position or self.synced.get(stream.number, -1) >= position:
                    continue
                self.broken.append(f"a tensor allocated on {origin!r} and read on {stream!r} was freed without "
                                   "record_stream or an event wait: its memory could be reused during the read")
                return


class HostCopy(torch.Tensor):
    """What a copy to the host returns (rule 10): the copied values, which any operator may read, in any
    thread, only once the host has synchronised with the copy (queued on ``stream`` at ``position``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, standin: CudaStandIn, stream: Stream, position: int):
        copied = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                     device=data.device)
        copied.data_copied, copied.standin, copied.stream, copied.position = data, standin, stream, position
        return copied

    def __repr__(self) -> str:  # without reading it
        return f"<copy to the host of {tuple(self.shape)} from {self.stream!r}>"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrapped(value: Any) -> Any:
            if isinstance(value, HostCopy):
                value.standin._host_read(value, func)
                return value.data_copied
            return value

        return func(*pytree.tree_map(unwrapped, args), **pytree.tree_map(unwrapped, kwargs or {}))


class _Watch(TorchDispatchMode):
    def __init__(self, standin: CudaStandIn):
        super().__init__()
        self.standin = standin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.standin._kernel(func, args, kwargs or {})


def _scalar(t: torch.Tensor) -> bool:
    """A CPU scalar, which a CUDA kernel may read (as PyTorch passes it by value)."""
    return t.dim() == 0 and t.device.type == "cpu"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
