"""Calls wait while a model is traced: torch.fx's tracer (and torch.export, which traces with it) replaces
``torch.nn.Module.__call__`` for the whole process while it traces, so a module called on another thread at that
moment goes through the tracer and fails (``NameError: module is not installed as a submodule``; the fuzzer of
docs/calls.md met it 4 times in 10,000 sequences while plans were built in the background).

:data:`TRACING` is a readers-writer lock: :meth:`TracingLock.tracing` (capture) waits until no call is under way
and holds new ones back; :meth:`TracingLock.calling` (an optimized module's call) waits while a model is traced.
Calls do not wait for each other. A thread already inside a call neither waits for a trace nor blocks its own
(nested calls, or a call that traces), nor does a call inside its own thread's trace. Modules opsched does not run are not held back: a background build
traces while they may run on other threads (docs/calls.md).

>>> with TRACING.calling():
...     with TRACING.calling():  # nested: no wait
...         pass
>>> with TRACING.tracing():
...     pass
"""

from __future__ import annotations

import threading


class TracingLock:
    """Readers (calls) and writers (traces); a trace waiting holds new calls back, so that it is not starved."""

    def __init__(self):
        self._condition = threading.Condition()
        self._calls = 0
        self._traces = 0
        self._waiting = 0
        self._local = threading.local()

    def calling(self) -> _Calling:
        return _Calling(self)

    def tracing(self) -> _Tracing:
        return _Tracing(self)


class _Calling:
    __slots__ = ("lock", "outer")

    def __init__(self, lock: TracingLock):
        self.lock = lock

    def __enter__(self) -> None:
        lock = self.lock
        depth = getattr(lock._local, "depth", 0)
        # (a call inside this thread's own trace, as of a model holding an optimized module, goes on)
        self.outer = depth == 0 and not getattr(lock._local, "traces", False)
        if self.outer:
            with lock._condition:
                while lock._traces or lock._waiting:
                    lock._condition.wait()
                lock._calls += 1
        lock._local.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        lock = self.lock
        lock._local.depth -= 1
        if self.outer:
            with lock._condition:
                lock._calls -= 1
                if not lock._calls:
                    lock._condition.notify_all()


class _Tracing:
    __slots__ = ("held", "lock")

    def __init__(self, lock: TracingLock):
        self.lock = lock

    def __enter__(self) -> None:
        lock = self.lock
        self.held = not getattr(lock._local, "depth", 0)  # a call that traces cannot wait for itself
        if self.held:
            with lock._condition:
                lock._waiting += 1
                while lock._calls or lock._traces:
                    lock._condition.wait()
                lock._waiting -= 1
                lock._traces += 1
            lock._local.traces = True

    def __exit__(self, *exc: object) -> None:
        if self.held:
            lock = self.lock
            lock._local.traces = False
            with lock._condition:
                lock._traces -= 1
                lock._condition.notify_all()


TRACING = TracingLock()
