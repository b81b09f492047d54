"""The CUDA backend: a StreamProgram on CUDA streams and events, optionally captured as one CUDA graph.
All CUDA-only code of opsched is in this module.

The device interface: the executor, :func:`time_cuda` and the measured cost model touch CUDA only through
one small object, a :class:`CudaApi` (streams, events, ``record_stream``, synchronisation, event timing,
graph capture and replay). :class:`TorchCuda` implements it on ``torch.cuda`` and is the default;
:func:`use_api` installs another one, such as the test suite's stand-in, which runs the same calls on CPU or
``meta`` tensors and raises wherever a program breaks CUDA's rules, so that this code runs in CI on a
machine without a GPU.

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

Several devices (:class:`DevicesExecutor`, for plans mapped onto devices): each program stream runs on one
device, the host or CUDA device N, driven by a thread of its own. A host stream computes, with its steps'
intra-op threads; a CUDA stream queues its units on a stream of its device, their weights copied there once,
when the executor is made, on that stream (so no other stream ever reads memory it allocated). ``record`` sets
a host event (the waiting thread blocks until the recording one got there) and, on a CUDA stream, records a
CUDA event too; on ``wait``, a CUDA stream waits on the recorder's CUDA event on the device (a stream may wait
on another device's event), and a host stream synchronises with it, so that the host knows finished whatever
the recorder had queued or waited for (and so does every stream that later waits on the host stream). A value
read on another device is copied there once per call and device, when it is first read:
- onto a CUDA device with ``.to(device, non_blocking=True)`` on the reading stream, which already waited for
  the maker, the source then marked with ``record_stream`` for the reading stream: the source was allocated
  on the maker's stream, and the allocator would otherwise reuse it once the host drops it. (PyTorch runs a
  copy between two GPUs on the source device's current stream, fenced on both sides by events against the
  target's current stream, which is the reading stream here: the copy starts after what that stream queued
  before and what it queues after waits for the copy.)
- onto the host by its maker, on the maker's stream, as soon as it is made (the source is never read on
  another stream); the host reads it only once it synchronised with an event recorded after the copy, since
  a copy to the host with ``non_blocking`` lands in pinned memory when the device gets to it, not when the
  call returns. A value a stream reads from another stream of its own device is not copied, only marked with
  ``record_stream``.
Inputs are the host's and outputs return there: the call ends by synchronising with every CUDA stream.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from opsched.errors import OpschedError
from opsched.runtime.cpu import StreamFailed, UnitFailed, end_pool
from opsched.runtime.kernels import Operator
from opsched.runtime.program import Record, Run, StreamProgram, Wait, store_outputs


class CudaError(OpschedError, RuntimeError):
    """CUDA asked for where there is none, or used in a way the CUDA backend does not support."""


class CudaApi(Protocol):
    """The device interface: everything the CUDA backend asks of CUDA. Streams, events and graphs are
    opaque objects handed back to the same interface. Every call is asynchronous on the device except
    :meth:`synchronize`."""

    device: torch.device
    """Where this interface's tensors live (``cuda``; the stand-in's are on ``cpu`` or ``meta``)."""

    def available(self) -> bool: ...

    def device_count(self) -> int: ...

    def describe(self) -> str:
        """What makes timings comparable: the GPU, its compute capability, CUDA and PyTorch versions."""

    def current_stream(self) -> Any: ...

    def new_stream(self, device: int | None = None) -> Any:
        """A stream of CUDA device ``device`` (default: the current device)."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context in which ``stream`` is the current stream (kernels launch on it)."""

    def new_event(self, timing: bool = False) -> Any:
        """An event; only ``timing`` events can be passed to :meth:`elapsed_ms`."""

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after the work ``event`` was recorded behind."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` when it is freed is done."""

    def place(self, module: torch.nn.Module, device: int) -> torch.nn.Module:
        """A copy of ``module`` with its weights on CUDA device ``device``, allocated on that device's current
        stream and there when this returns; ``module`` itself stays where it is."""

    def to(self, tensor: torch.Tensor, device: int | None) -> torch.Tensor:
        """``tensor`` copied to CUDA device ``device`` (the host for None) with ``non_blocking``: queued on the
        current stream of the target device, or of the source's device for a copy to the host, whose result
        may be read only after synchronising with an event recorded after the copy."""

    def synchronize(self) -> None:
        """The host waits for everything queued on the current device."""

    def synchronize_event(self, event: Any) -> None:
        """The host waits for the work ``event`` was recorded behind."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded, completed timing events."""

    def new_graph(self) -> Any: ...

    def capture(self, graph: Any) -> contextlib.AbstractContextManager:
        """A context whose work is captured into ``graph``; inside it the current stream is the capture
        stream."""

    def replay(self, graph: Any) -> None: ...


class TorchCuda:
    """:class:`CudaApi` on ``torch.cuda`` (or on ``api``, any object with torch.cuda's names)."""

    device = torch.device("cuda")

    def __init__(self, api: Any = None):
        self.api = api if api is not None else torch.cuda

    def available(self) -> bool:
        return self.api.is_available()

    def device_count(self) -> int:
        return self.api.device_count()

    def describe(self) -> str:
        index = self.api.current_device()
        major, minor = self.api.get_device_capability(index)
        return (f"cuda|{self.api.get_device_name(index)}|sm_{major}{minor}|cuda {torch.version.cuda}|"
                f"torch {torch.__version__}")

    def current_stream(self) -> Any:
        return self.api.current_stream()

    def new_stream(self, device: int | None = None) -> Any:
        return self.api.Stream(device=device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.api.stream(stream)

    def new_event(self, timing: bool = False) -> Any:
        return self.api.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def place(self, module: torch.nn.Module, device: int) -> torch.nn.Module:
        return copy.deepcopy(module).to(torch.device("cuda", device))

    def to(self, tensor: torch.Tensor, device: int | None) -> torch.Tensor:
        return tensor.to(torch.device("cpu") if device is None else torch.device("cuda", device), non_blocking=True)

    def synchronize(self) -> None:
        self.api.synchronize()

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def new_graph(self) -> Any:
        return self.api.CUDAGraph()

    def capture(self, graph: Any) -> contextlib.AbstractContextManager:
        return self.api.graph(graph)

    def replay(self, graph: Any) -> None:
        graph.replay()


_installed: list[CudaApi] = []
_torch_cuda = TorchCuda()


def current_api() -> CudaApi:
    """The device interface in use: the one :func:`use_api` installed last, else ``torch.cuda``."""
    return _installed[-1] if _installed else _torch_cuda


@contextlib.contextmanager
def use_api(api: CudaApi) -> Iterator[CudaApi]:
    """Run the CUDA backend (executors made inside, :func:`time_cuda`, the measured cost model) on ``api``.

    >>> class NoGPU(TorchCuda):
    ...     def available(self): return False
    >>> with use_api(NoGPU()):
    ...     available()
    False
    """
    _installed.append(api)
    try:
        yield api
    finally:
        _installed.remove(api)


def available() -> bool:
    return current_api().available()


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
        g = program.graph
        self._inputs = len(g.inputs)
        self._slots = self._inputs + len(g)
        self._streams: list[Any] = [None] + [self.cuda.new_stream() for _ in program.streams[1:]]
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
        self._graph: Any = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_outputs: list[Any] = []
        self.timeline: list[tuple[int, tuple[int, ...], float, float]] | None = None

    def __call__(self, *inputs: torch.Tensor, record_timeline: bool = False) -> list[Any]:
        if len(inputs) != self._inputs:
            raise ValueError(f"the program takes {self._inputs} inputs, got {len(inputs)}")
        if not self._use_graph:
            return self._launch(list(inputs), record_timeline)
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
        """Work queued on ``stream`` from now on starts after what is queued on ``other`` now."""
        event = self.cuda.new_event()
        self.cuda.record(event, other)
        self.cuda.wait(stream, event)

    def _launch(self, inputs: list[Any], record_timeline: bool, kept: list | None = None) -> list[Any]:
        """Queue the program on the streams; while capturing a graph, ``kept`` receives every value, for
        the caller to hold until capture has ended."""
        cuda = self.cuda
        capturing = kept is not None
        current = cuda.current_stream()
        streams = [current] + self._streams[1:]
        values: list[Any] = [None] * self._slots
        values[:len(inputs)] = inputs
        remaining = list(self.program.readers)
        events = [cuda.new_event() for _ in range(self.program.events)]
        origin = None
        if record_timeline:
            origin = cuda.new_event(timing=True)
            cuda.record(origin, current)
        for s in streams[1:]:
            self._after(s, current)  # side streams start after what the caller queued (the inputs)
        marks = []
        with _autograd_off(persistent=capturing):
            # Streams are walked in turn: a stream's steps are queued until it waits on an event that no
            # stream has recorded yet, then the next stream is served; the device does the ordering.
            position = [0] * len(streams)
            recorded: set[int] = set()
            while any(position[k] < len(self._steps[k]) for k in range(len(streams))):
                progressed = False
                for k, steps in enumerate(self._steps):
                    with cuda.use_stream(streams[k]):
                        while position[k] < len(steps):
                            step = steps[position[k]]
                            if step[0] == "wait":
                                if step[1] not in recorded:
                                    break
                                cuda.wait(streams[k], events[step[1]])
                            elif step[0] == "record":
                                cuda.record(events[step[1]], streams[k])
                                recorded.add(step[1])
                            else:
                                _, fn, args, outs, release, foreign, units = step
                                if not capturing:
                                    for a in foreign:
                                        if isinstance(values[a], torch.Tensor):
                                            cuda.record_stream(values[a], streams[k])
                                if record_timeline:
                                    began, ended = cuda.new_event(timing=True), cuda.new_event(timing=True)
                                    cuda.record(began, streams[k])
                                result = fn(*[values[a] for a in args])
                                if record_timeline:
                                    cuda.record(ended, streams[k])
                                    marks.append((k, units, began, ended))
                                store_outputs(values, outs, result)
                                for slot in release:
                                    remaining[slot] -= 1
                                    # During capture every value stays alive until capture ends (see above).
                                    if remaining[slot] == 0 and not capturing:
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
        return [values[s] for s in self.program.outputs]

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        """Capture the program into one CUDA graph with static inputs (after a warm-up on a side stream,
        which CUDA graph capture needs so that lazy initialisation is not captured)."""
        cuda = self.cuda
        with _autograd_off(persistent=True):
            self._static_inputs = [x.detach().clone() for x in inputs]
        caller = cuda.current_stream()
        warmup = cuda.new_stream()
        self._after(warmup, caller)
        with cuda.use_stream(warmup):
            self._launch(list(self._static_inputs), False)
        self._after(caller, warmup)
        graph = cuda.new_graph()
        kept: list = []
        with cuda.capture(graph):
            # Inside capture, the current stream is the capture stream: _launch forks the side streams from
            # it with an event and joins them back before capture ends.
            self._static_outputs = self._launch(list(self._static_inputs), False, kept)
        del kept  # every value lived until capture ended; their memory is the graph's now
        self._graph = graph


class DevicesExecutor:
    """Execute ``program`` with its stream k on ``devices[k]``: the host (None) or CUDA device N, through ``api``
    (default: :func:`current_api`); see "Several devices" in the module docstring. ``operator`` makes each run
    step's callable from its units, whose weights are first copied to the step's CUDA device. A call takes the
    inputs on the host and returns the outputs there, everything they depend on finished."""

    def __init__(self, program: StreamProgram, operator: Operator, devices: Sequence[int | None],
                 api: CudaApi | None = None):
        self.cuda = api or current_api()
        if not self.cuda.available():
            raise CudaError("CUDA is not available")
        if len(devices) != len(program.streams):
            raise ValueError(f"the program has {len(program.streams)} streams, but {len(devices)} devices were given")
        count = self.cuda.device_count()
        beyond = sorted({d for d in devices if d is not None and not 0 <= d < count})
        if beyond:
            raise CudaError(f"the program runs on cuda:{beyond[0]}, but PyTorch sees {count} CUDA device(s)")
        self.program = program
        self.devices = list(devices)
        g = program.graph
        self._inputs = len(g.inputs)
        self._streams = [None if d is None else self.cuda.new_stream(d) for d in devices]
        self._made_on = [-1] * (self._inputs + len(g))  # the stream making each slot; -1: the caller, on the host
        self._recorded_on: dict[int, int] = {}
        read_on_host: set[int] = set()
        for k, steps in enumerate(program.streams):
            for s in steps:
                if isinstance(s, Run):
                    for u in s.units:
                        self._made_on[self._inputs + u] = k
                    if devices[k] is None:
                        read_on_host.update(program.slot(a) for a in g.nodes[s.units[0]].args)
                elif isinstance(s, Record):
                    self._recorded_on[s.event] = k
        # values made on a CUDA device that the host reads: each copied to the host by its maker, once made
        self._to_host = {slot for slot in read_on_host | set(program.outputs) if self.device_of(slot) is not None}
        self._steps = []
        for k, steps in enumerate(program.streams):
            compiled = []
            for s in steps:
                if isinstance(s, Run):
                    nodes = [g.nodes[u] for u in s.units]
                    if devices[k] is not None:
                        with self.cuda.use_stream(self._streams[k]):  # allocated on the one stream that reads them
                            nodes = [dataclasses.replace(n, run=self.cuda.place(n.run, devices[k]))
                                     if isinstance(n.run, torch.nn.Module) else n for n in nodes]
                    compiled.append(("run", operator(nodes, s.threads), tuple(program.slot(a) for a in nodes[0].args),
                                     tuple(self._inputs + u for u in s.units), s.release, s.threads,
                                     "+".join(n.name for n in nodes)))
                elif isinstance(s, Record):
                    compiled.append(("record", s.event))
                elif isinstance(s, Wait):
                    if s.event not in self._recorded_on:
                        raise RuntimeError("the stream program deadlocks: a stream waits on an event never recorded")
                    compiled.append(("wait", s.event, self._recorded_on[s.event]))
            self._steps.append(compiled)
        self._lock = threading.Lock()
        self._workers: ThreadPoolExecutor | None = None

    def device_of(self, slot: int) -> int | None:
        """The CUDA device whose memory holds the value of ``slot`` as made (None: the host)."""
        maker = self._made_on[slot]
        return None if maker < 0 else self.devices[maker]

    def __call__(self, *inputs: Any, record_timeline: bool = False) -> list[Any]:
        if len(inputs) != self._inputs:
            raise ValueError(f"the program takes {self._inputs} inputs, got {len(inputs)}")
        if record_timeline:
            raise CudaError("a program on several devices records no per-unit timeline")
        if any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in inputs):
            raise CudaError("a program on several devices takes its inputs on the host and moves them itself")
        with self._lock:  # a call's streams run on the shared worker threads, one call at a time
            if self._workers is None and len(self._steps) > 1:
                # torch.get_num_threads: PyTorch's first-use count setting, done before the steps set theirs
                self._workers = ThreadPoolExecutor(len(self._steps) - 1, thread_name_prefix="opsched-device",
                                                   initializer=torch.get_num_threads)
            call = _DevicesCall(self, inputs)
            others = [self._workers.submit(call.run_stream, k) for k in range(1, len(self._steps))]
            caller_threads = torch.get_num_threads()
            try:
                call.run_stream(0)
            finally:
                torch.set_num_threads(caller_threads)
            for other in others:
                other.result()
            if any(call.wide[1:]):
                # A worker thread that ran several OpenMP threads keeps an OpenMP pool that slows every later
                # parallel region in the process (see opsched.runtime.cpu): end the workers now.
                end_pool(self._workers)
                self._workers = None
            return call.finish()

    def close(self) -> None:
        """Stop the worker threads (a later call starts new ones)."""
        with self._lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown()


class _DevicesCall:
    """One execution of a :class:`DevicesExecutor`'s program: the values as made, their copies on other
    devices, and the events."""

    def __init__(self, executor: DevicesExecutor, inputs: Sequence[Any]):
        self.executor = executor
        self.cuda = executor.cuda
        self.values: list[Any] = [None] * len(executor._made_on)
        self.values[:len(inputs)] = inputs
        self.on_host: dict[int, Any] = {}  # copies to the host of values made on a CUDA device
        self.copies: list[dict[int, Any]] = [{} for _ in executor._steps]  # per stream: the values it read, there
        self.remaining = list(executor.program.readers)
        self.reached = [threading.Event() for _ in range(executor.program.events)]
        self.events = {e: self.cuda.new_event() for e, k in executor._recorded_on.items()  # the CUDA streams' events
                       if executor.devices[k] is not None}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.wide = [False] * len(executor._steps)  # per stream: ran a step on more than one CPU thread

    def run_stream(self, k: int) -> None:
        device = self.executor.devices[k]
        try:
            with torch.inference_mode(), \
                    (self.cuda.use_stream(self.executor._streams[k]) if device is not None else contextlib.nullcontext()):
                self._run_steps(k, device)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            with self.lock:
                if self.error is None:
                    self.error = e
            for reached in self.reached:  # no stream waits forever on one that stopped
                reached.set()

    def _run_steps(self, k: int, device: int | None) -> None:
        cuda, values, stream = self.cuda, self.values, self.executor._streams[k]
        threads_now = -1
        for step in self.executor._steps[k]:
            if self.error is not None:  # the call's result is lost: stop now
                raise StreamFailed("another stream failed")
            if step[0] == "run":
                _, fn, args, outs, release, threads, name = step
                if device is None and threads != threads_now:
                    torch.set_num_threads(threads)
                    threads_now = threads
                    self.wide[k] = self.wide[k] or threads > 1
                try:
                    result = fn(*[self._value(slot, k, device) for slot in args])
                except Exception as e:
                    raise UnitFailed(name, e) from e
                store_outputs(values, outs, result)
                for slot in outs:
                    if slot in self.executor._to_host:
                        self.on_host[slot] = cuda.to(values[slot], None)
                for slot in release:
                    self.copies[k].pop(slot, None)
                    with self.lock:
                        self.remaining[slot] -= 1
                        last = self.remaining[slot] == 0
                    if last:
                        values[slot] = None
                        self.on_host.pop(slot, None)
            elif step[0] == "record":
                if device is not None:
                    cuda.record(self.events[step[1]], stream)
                self.reached[step[1]].set()
            else:
                _, event, recorder = step
                self.reached[event].wait()  # set by the recorder, or by a stream that failed
                if self.error is None and self.executor.devices[recorder] is not None:
                    if device is not None:
                        cuda.wait(stream, self.events[event])
                    else:
                        cuda.synchronize_event(self.events[event])

    def _value(self, slot: int, k: int, device: int | None) -> Any:
        """The value of ``slot`` where stream ``k`` (on ``device``) reads it."""
        mine = self.copies[k]
        if slot in mine:
            return mine[slot]
        value = self.values[slot]
        made_on = self.executor.device_of(slot)
        stream = self.executor._streams[k]
        if made_on == device:
            if device is not None and self.executor._made_on[slot] != k:  # another stream's memory
                self.cuda.record_stream(value, stream)
                mine[slot] = value
            return value
        if device is None:  # copied by its maker; the wait before this step synchronised with the copy
            mine[slot] = self.on_host[slot]
        else:  # queued on this stream, which waited for the maker
            mine[slot] = self.cuda.to(value, device)
            if made_on is not None:
                self.cuda.record_stream(value, stream)
        return mine[slot]

    def finish(self) -> list[Any]:
        """The outputs on the host, once every CUDA stream's work is done."""
        if self.error is not None:
            raise self.error
        for stream in self.executor._streams:
            if stream is not None:
                done = self.cuda.new_event()
                self.cuda.record(done, stream)
                self.cuda.synchronize_event(done)
        return [self.on_host[slot] if slot in self.executor._to_host else self.values[slot]
                for slot in self.executor.program.outputs]


def _autograd_off(persistent: bool) -> contextlib.AbstractContextManager:
    """No autograd while a program runs: inference mode for a call's own tensors; for the tensors a CUDA
    graph keeps across calls (``persistent``), ordinary tensors under ``no_grad`` (see the module
    docstring), even inside a caller's inference mode."""
    if not persistent:
        return torch.inference_mode()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def time_cuda(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, api: CudaApi | None = None) -> float:
    """Median milliseconds of ``fn`` on the device, timed with events around each call on the current
    stream (default interface: :func:`current_api`)."""
    cuda = api or current_api()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        stream = cuda.current_stream()
        began, ended = cuda.new_event(timing=True), cuda.new_event(timing=True)
        cuda.record(began, stream)
        fn()
        cuda.record(ended, stream)
        cuda.synchronize()
        samples.append(cuda.elapsed_ms(began, ended))
    return statistics.median(samples)
