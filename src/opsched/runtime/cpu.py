"""The CPU backend: run a StreamProgram with one thread per stream.

Stream 0 runs on the calling thread, so a one-stream program (sequential) costs no hand-off at all; the
other streams run on persistent worker threads, each applying the intra-op thread count of every step with
``torch.set_num_threads`` inside that thread (the OpenMP setting is per thread; set in the caller, it would
not reach the workers, and workers left at the default would oversubscribe the cores). Events are
:class:`Gate` s; PyTorch releases the GIL inside its kernels, so streams really run at the same time.

A worker that ran a step on more than one intra-op thread ends after the call, and a fresh thread takes its
place. With GNU OpenMP (PyTorch's CPU builds), every thread that opens a parallel region of several threads
keeps its own pool of OpenMP threads for as long as it lives; once the process's pools hold more threads
than there are cores, libgomp stops spinning between parallel regions everywhere in the process, and each
region then waits for sleeping threads to wake. Measured here (2 cores, SqueezeNet, see docs/runtime.md):
the model's own forward on 2 threads ran 1.5x slower, in the caller's thread, for as long as one idle
worker that had once run a 2-thread step was alive. A new thread costs about 0.1 ms per call, and only
programs with such steps pay it.

Calls are serialised by a lock, so an executor is safe to share between threads: two calls interleaving on
shared workers could otherwise wait on each other's streams.

If a unit fails, the other streams stop at their next step (every event is set, so none waits forever), and
the caller gets one :class:`UnitFailed` naming the unit, raised from the original exception; the workers
are then free and the next call runs normally. The worker threads end when the executor is closed or
garbage collected.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from opsched.runtime.guards import autocast_now, in_autocast
from opsched.runtime.kernels import Operator
from opsched.runtime.lowered import Call, LoweredProgram, Record, Remaining, StreamFailed, UnitFailed, lower
from opsched.runtime.program import StreamProgram

__all__ = ["CPUExecutor", "StreamFailed", "ThreadedCall", "UnitFailed", "end_pool", "wait_until_gone"]


class CPUExecutor:
    """Execute ``program``; ``operator(nodes, threads)`` gives the callable for the units of a run step
    (see :mod:`opsched.runtime.kernels`): called with the values the first unit reads, it returns one
    value, or one per unit for a merge. A program already lowered (its callables made elsewhere: the Ray
    engine's actor running every device of a node) is run as it is, with no ``operator``. The executor runs
    the kernels ``operator`` gives, deciding nothing itself: a plan's are chosen once and recorded
    (:class:`~opsched.runtime.kernels.ChosenKernels`)."""

    def __init__(self, program: StreamProgram | LoweredProgram, operator: Operator | None = None):
        self.program = program
        self.lowered = program if isinstance(program, LoweredProgram) else lower(program, operator)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.timeline: list[tuple[int, tuple[int, ...], float, float]] | None = None

    def __call__(self, *inputs: Any, record_timeline: bool = False) -> list[Any]:
        """Run the program on the flat list of graph inputs; return the graph's flat outputs. With
        ``record_timeline``, ``self.timeline`` then holds (stream, units, start, finish) in seconds from the
        start of the call."""
        values = self.lowered.start(inputs)
        streams = len(self.lowered.streams)
        with self._lock:
            while len(self._workers) < streams - 1:
                self._workers.append(_Worker())
            call = _Call(self, values, record_timeline)
            for k, worker in enumerate(self._workers[:streams - 1], 1):
                worker.submit(call, k)
            caller_threads = torch.get_num_threads()
            try:
                with torch.inference_mode():  # thread-local: each worker is in it for as long as it lives
                    call.run_stream(0)
            finally:
                torch.set_num_threads(caller_threads)
            for k in range(1, streams):
                call.finished[k].wait()
            self._retire_wide_workers(call)
            if call.error is not None:
                raise call.error
            if record_timeline:
                self.timeline = sorted(call.timeline, key=lambda t: t[2])
            return [values[s] for s in self.lowered.outputs]

    def _retire_wide_workers(self, call: _Call) -> None:
        """End every worker that ran a step on several threads in ``call`` (see the module's docstring), and
        wait until it has left the process, so that its OpenMP pool is gone before the caller goes on."""
        ended = []
        for k, worker in enumerate(self._workers, 1):
            if call.wide[k]:
                worker.stop()
                worker.join()
                ended.append(worker.native_id)
                self._workers[k - 1] = _Worker()
        wait_until_gone(ended)

    def close(self) -> None:
        """Stop the worker threads and wait for them to end (a later call starts new ones)."""
        with self._lock:  # a call in progress finishes first
            workers, self._workers = self._workers, []
            for worker in workers:
                worker.stop()
            for worker in workers:
                worker.join()

    def __del__(self) -> None:
        # Collected: no call can be in progress. Only signal the workers; this may run on one of them (the cyclic
        # garbage collector runs on whichever thread allocates when it is due), which cannot join itself.
        for worker in getattr(self, "_workers", []):  # absent when __init__ failed
            worker.stop()


class ThreadedCall:
    """What one call of a program shares between the threads that run its streams: the slots' values, their
    releases, a host event per program event, and the first error, which stops every stream."""

    def __init__(self, lowered: LoweredProgram, values: list[Any]):
        self.values = values
        self.remaining = Remaining(lowered)
        self.events = [Gate() for _ in range(lowered.events)]
        self.wide = [False] * len(lowered.streams)  # per stream: ran a step on more than one CPU thread
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        # the caller's autocast, which is thread-local: every stream's thread runs its steps in it, as the
        # caller's own thread runs eager
        self.autocast = autocast_now()

    def caller_modes(self) -> contextlib.AbstractContextManager:
        """The caller's autocast, to enter on a stream's thread (nothing where it is off)."""
        return in_autocast(self.autocast)

    def fail(self, error: BaseException) -> None:
        """Keep the call's first error, and set every event: no stream waits forever on one that stopped."""
        with self.lock:
            if self.error is None:
                self.error = error
        for event in self.events:
            event.set()

    def use_threads(self, k: int, threads: int) -> int:
        """Give the next steps of stream ``k``, running on this thread, ``threads`` intra-op threads."""
        torch.set_num_threads(threads)
        self.wide[k] = self.wide[k] or threads > 1
        return threads


class Gate:
    """A one-shot event for the threads of one call: closed when made, open for good once :meth:`set` (any number
    of threads may :meth:`wait`). A lock held from the start: ``threading.Event`` does the same through a
    Python-level condition, and making and passing one costs several times more, for every event of every call
    (docs/runtime.md, per-call cost)."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already open: a failing stream opens every gate, maybe one being opened
            pass

    def wait(self) -> None:
        self._lock.acquire()
        self.set()  # open again for the next waiter (unless a failing stream just opened it)


class _Call(ThreadedCall):
    """The state of one execution of a program."""

    def __init__(self, executor: CPUExecutor, values: list[Any], record_timeline: bool):
        super().__init__(executor.lowered, values)
        self.steps = executor.lowered.streams
        self.finished: list[Gate | None] = [None] + [Gate() for _ in self.steps[1:]]  # the caller waits for the workers
        self.timeline: list | None = [] if record_timeline else None
        self.started = time.perf_counter() if record_timeline else 0.0

    def run_stream(self, k: int) -> None:
        try:
            self._run_steps(k)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.fail(e)
        finally:
            if k:
                self.finished[k].set()

    def _run_steps(self, k: int) -> None:
        values, events, remaining = self.values, self.events, self.remaining
        counts = remaining.counts
        threads_now = -1
        for step in self.steps[k]:
            if type(step) is Call:
                if self.error is not None:  # another stream failed: the call's result is lost, stop now
                    raise StreamFailed("another stream failed")
                if step.threads != threads_now:
                    threads_now = self.use_threads(k, step.threads)
                began = time.perf_counter() if self.timeline is not None else 0.0
                try:
                    result = step.fn(*[values[a] for a in step.reads])
                except Exception as e:
                    raise UnitFailed(step.name, e) from e
                if self.timeline is not None:
                    self.timeline.append((k, step.units, began - self.started, time.perf_counter() - self.started))
                step.store(values, result)
                for slot in step.release:
                    if counts[slot] == 1 or remaining.last(slot):
                        values[slot] = None
            elif type(step) is Record:
                events[step.event].set()
            else:
                events[step.event].wait()
                if self.error is not None:
                    raise StreamFailed("another stream failed")


class _Worker:
    """A daemon thread running the streams handed to it, one call at a time."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="opsched-stream")
        self._thread.start()

    def submit(self, call: _Call, stream: int) -> None:
        self._queue.put((call, stream))

    def stop(self) -> None:
        self._queue.put(None)

    def join(self) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def _loop(self) -> None:
        # PyTorch sets a thread's intra-op count at its first parallel operator, from the count last set in any
        # thread, over what this thread set before: asked now, it does that now, and the steps' counts hold.
        torch.get_num_threads()
        with torch.inference_mode():  # entered once: a few microseconds of every call otherwise
            while (item := self._queue.get()) is not None:
                call, stream = item
                with call.caller_modes():
                    call.run_stream(stream)
                # A call holds its values and steps (whose callables hold the units): held here while waiting for
                # the next one, it would keep them alive after the call returned, and after its module was dropped.
                del item, call


def wait_until_gone(native_ids: Sequence[int | None], timeout: float = 1.0) -> None:
    """Wait until the threads of ``native_ids`` have left the process (at most ``timeout`` seconds; Linux,
    where /proc lists them). A joined Python thread has finished its Python code, but the C library frees its
    thread-local state, the OpenMP pool among it, a moment later, as the thread exits."""
    tasks = "/proc/self/task"
    wanted = [f"{tasks}/{n}" for n in native_ids if n is not None]
    if not wanted or not os.path.isdir(tasks):
        return
    deadline = time.monotonic() + timeout
    while any(os.path.exists(t) for t in wanted) and time.monotonic() < deadline:
        time.sleep(0.0002)


def end_pool(pool: Any) -> None:
    """Shut a ``concurrent.futures.ThreadPoolExecutor`` down and wait until its threads have left the process
    (see :func:`wait_until_gone`), so that their OpenMP pools no longer slow anything."""
    ended = [t.native_id for t in list(pool._threads)]
    pool.shutdown(wait=True)
    wait_until_gone(ended)
