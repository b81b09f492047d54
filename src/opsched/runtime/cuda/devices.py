"""The several-device runtime of plans mapped onto devices (:class:`DevicesExecutor`): each program stream runs on
one device, the host or CUDA device N, driven by a thread of its own. A host stream computes, with its steps'
intra-op threads; a CUDA stream queues its units on a stream of its device, their weights copied there once, when
the executor is made, on that stream (so no other stream ever reads memory it allocated). ``record`` sets a host
event (the waiting thread blocks until the recording one got there) and, on a CUDA stream, records a CUDA event
too; on ``wait``, a CUDA stream waits on the recorder's CUDA event on the device (a stream may wait on another
device's event), and a host stream synchronises with it, so that the host knows finished whatever the recorder had
queued or waited for (and so does every stream that later waits on the host stream). A value read on another
device is copied there once per call and device, when it is first read:
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
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from opsched.runtime.cpu import ThreadedCall, end_pool
from opsched.runtime.cuda.api import CudaApi, CudaError, current_api
from opsched.runtime.kernels import Operator
from opsched.runtime.lowered import Call, Record, StreamFailed, UnitFailed, Wait, lower
from opsched.runtime.program import StreamProgram


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
        self._streams = [None if d is None else self.cuda.new_stream(d) for d in devices]
        self.lowered = lower(program, operator, self._place)
        self._made_on = [-1] * self.lowered.slots  # the stream making each slot; -1: the caller, on the host
        self._recorded_on = {s.event: k for k, steps in enumerate(self.lowered.streams) for s in steps
                             if type(s) is Record}
        read_on_host: set[int] = set()
        for k, steps in enumerate(self.lowered.streams):
            for c in steps:
                if type(c) is Call:
                    for slot in c.writes:
                        self._made_on[slot] = k
                    if devices[k] is None:
                        read_on_host.update(c.reads)
                elif type(c) is Wait and c.event not in self._recorded_on:
                    raise RuntimeError("the stream program deadlocks: a stream waits on an event never recorded")
        # values made on a CUDA device that the host reads: each copied to the host by its maker, once made
        self._to_host = {slot for slot in read_on_host | set(program.outputs) if self.device_of(slot) is not None}
        self._lock = threading.Lock()
        self._workers: ThreadPoolExecutor | None = None

    def _place(self, k: int, nodes: list) -> list:
        """Stream ``k``'s units with their weights on its CUDA device, copied there on the one stream that reads
        them (none for a host stream)."""
        if self.devices[k] is None:
            return nodes
        with self.cuda.use_stream(self._streams[k]):
            return [dataclasses.replace(n, run=self.cuda.place(n.run, self.devices[k]))
                    if isinstance(n.run, torch.nn.Module) else n for n in nodes]

    def device_of(self, slot: int) -> int | None:
        """The CUDA device whose memory holds the value of ``slot`` as made (None: the host)."""
        maker = self._made_on[slot]
        return None if maker < 0 else self.devices[maker]

    def __call__(self, *inputs: Any, record_timeline: bool = False) -> list[Any]:
        values = self.lowered.start(inputs)
        if record_timeline:
            raise CudaError("a program on several devices records no per-unit timeline")
        if any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in inputs):
            raise CudaError("a program on several devices takes its inputs on the host and moves them itself")
        with self._lock:  # a call's streams run on the shared worker threads, one call at a time
            streams = len(self.lowered.streams)
            if self._workers is None and streams > 1:
                # torch.get_num_threads: PyTorch's first-use count setting, done before the steps set theirs
                self._workers = ThreadPoolExecutor(streams - 1, thread_name_prefix="opsched-device",
                                                   initializer=torch.get_num_threads)
            call = DevicesCall(self, values)
            others = [self._workers.submit(call.run_stream, k) for k in range(1, streams)]
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


class DevicesCall(ThreadedCall):
    """One execution of a :class:`DevicesExecutor`'s program: the values as made, their copies on other
    devices, and the events (``events``, the host's: the recorder got there; ``cuda_events``, the CUDA streams')."""

    def __init__(self, executor: DevicesExecutor, values: list[Any]):
        super().__init__(executor.lowered, values)
        self.executor = executor
        self.cuda = executor.cuda
        self.on_host: dict[int, Any] = {}  # copies to the host of values made on a CUDA device
        self.copies: list[dict[int, Any]] = [{} for _ in executor.lowered.streams]  # per stream: what it read, there
        self.cuda_events = {e: self.cuda.new_event() for e, k in executor._recorded_on.items()
                            if executor.devices[k] is not None}

    def run_stream(self, k: int) -> None:
        device = self.executor.devices[k]
        try:
            with torch.inference_mode(), self.caller_modes(), \
                    (self.cuda.use_stream(self.executor._streams[k]) if device is not None
                     else contextlib.nullcontext()):
                self._run_steps(k, device)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.fail(e)

    def _run_steps(self, k: int, device: int | None) -> None:
        cuda, values, stream = self.cuda, self.values, self.executor._streams[k]
        threads_now = -1
        for step in self.executor.lowered.streams[k]:
            if self.error is not None:  # the call's result is lost: stop now
                raise StreamFailed("another stream failed")
            if type(step) is Call:
                if device is None and step.threads != threads_now:
                    threads_now = self.use_threads(k, step.threads)
                try:  # a failing copy of an input to this device is reported as the unit's failure
                    result = step.fn(*[self._value(slot, k, device) for slot in step.reads])
                except Exception as e:
                    raise UnitFailed(step.name, e) from e
                step.store(values, result)
                for slot in step.writes:
                    if slot in self.executor._to_host:
                        self.on_host[slot] = cuda.to(values[slot], None)
                for slot in step.release:
                    self.copies[k].pop(slot, None)
                    if self.remaining.counts[slot] == 1 or self.remaining.last(slot):
                        values[slot] = None
                        self.on_host.pop(slot, None)
            elif type(step) is Record:
                if device is not None:
                    cuda.record(self.cuda_events[step.event], stream)
                self.events[step.event].set()
            else:
                self.events[step.event].wait()  # set by the recorder, or by a stream that failed
                if self.error is None and self.executor.devices[self.executor._recorded_on[step.event]] is not None:
                    if device is not None:
                        cuda.wait(stream, self.cuda_events[step.event])
                    else:
                        cuda.synchronize_event(self.cuda_events[step.event])

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
                for slot in self.executor.lowered.outputs]
