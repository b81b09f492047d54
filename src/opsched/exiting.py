"""Background work that the interpreter's exit stops and waits for.

A plan built in the background (a new call signature, autocast, new weights) runs on a daemon thread inside
PyTorch and ONNX Runtime. A script that ends meanwhile used to die with SIGABRT ("terminate called without an
active exception"): Python 3.11 ends a daemon thread that asks for the GIL after finalisation began by unwinding
its stack, and unwinding through PyTorch's C++ frames terminates the process. So such threads are started with
:func:`start_background`: on exit the interpreter asks them to stop (:func:`stop_point` raises :class:`Stopped` in
them at their next measurement or compilation) and waits for them before it finalises. A thread given its own
``stop`` event stops the same way when that is set: a server stopped while it prepares its plans.

>>> import threading
>>> finished = threading.Event()
>>> def measure_until_finished():
...     while not finished.wait(0.01):
...         stop_point()  # nothing until the interpreter exits; then Stopped ends the thread quietly
>>> thread = start_background(measure_until_finished, (), "example")
>>> finished.set(); thread.join(); thread.is_alive()
False
"""

from __future__ import annotations

# Imported first so that their exit hooks are registered before this module's: threading runs them last registered
# first, and a pool shut down before a build stopped would fail the build with an ordinary error ("cannot schedule
# new futures after interpreter shutdown"), which a cost model may record as a failed region.
import concurrent.futures.process
import concurrent.futures.thread  # noqa: F401
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

# how long an exit waits silently for a stopping thread before it says what it waits for
QUIET_WAIT_SECONDS = 0.5


class Stopped(BaseException):
    """Raised by :func:`stop_point` in a background thread once the interpreter exits. A BaseException, as
    KeyboardInterrupt is: an ``except Exception`` that turns a failed step into a fallback would go on working."""


_exiting = threading.Event()
_running: dict[threading.Thread, Callable[[], Any] | None] = {}  # each thread and what wakes it from a wait
_running_lock = threading.Lock()
_local = threading.local()  # .stop: this thread was started by start_background, and stops once it is set


def exiting() -> bool:
    """Whether the interpreter has begun to exit (background work is being stopped): work asked for from now on
    is done in the caller's thread, or not at all."""
    return _exiting.is_set()


def stop_point() -> None:
    """Raise :class:`Stopped` in a thread :func:`start_background` started once the interpreter exits or its own
    ``stop`` is set; nothing otherwise (a user's own threads, which the interpreter waits for, are never stopped).
    Called between measurements and before compilations, so that a stopping build ends within one of them."""
    stop = getattr(_local, "stop", None)
    if stop is not None and (_exiting.is_set() or stop.is_set()):
        raise Stopped("the interpreter is exiting" if _exiting.is_set() else "asked to stop")


def start_background(target: Callable[..., Any], args: tuple, name: str, wake: Callable[[], Any] | None = None,
                     stop: threading.Event | None = None) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread that the interpreter's exit stops and waits for. ``wake``
    (optional) ends a wait of the thread's own (say, puts a sentinel on the queue it reads); ``stop`` (optional),
    once set, stops it as the exit does; :class:`Stopped` ends the thread quietly."""

    def run() -> None:
        _local.stop = stop if stop is not None else threading.Event()
        try:
            target(*args)
        except Stopped:
            pass
        finally:
            with _running_lock:
                _running.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _running_lock:
        _running[thread] = wake
    try:
        thread.start()
    except BaseException:
        with _running_lock:
            _running.pop(thread, None)
        raise
    return thread


def _stop_and_wait() -> None:
    """At exit, before daemon threads are abandoned: stop every background thread and wait for it. Ctrl-C while
    waiting ends the process at once (status 130): finalising with the thread inside PyTorch would abort."""
    _exiting.set()
    with _running_lock:
        running = list(_running.items())
    try:
        for _, wake in running:
            if wake is not None:
                wake()
        for thread, _ in running:
            thread.join(QUIET_WAIT_SECONDS)
            if thread.is_alive():
                print(f"opsched: exiting: waiting for {thread.name} to stop (it stops at its next measurement or "
                      "compilation; Ctrl-C exits at once)", file=sys.stderr, flush=True)
                thread.join()
    except KeyboardInterrupt:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(130)


def _forget_in_child() -> None:
    """In a child made by fork (a DataLoader's worker), none of the parent's threads runs, and the lock may have
    been held by one of them at the fork: the child's own exit would wait on it forever."""
    global _running_lock
    _running_lock = threading.Lock()
    _running.clear()


os.register_at_fork(after_in_child=_forget_in_child)
# threading's own exit hook (the one concurrent.futures uses) runs before atexit's handlers, some of which
# PyTorch's own state needs while a build still runs, and before the daemon threads are abandoned
threading._register_atexit(_stop_and_wait)  # type: ignore[attr-defined]
