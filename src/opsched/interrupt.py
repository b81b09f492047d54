"""Ctrl-C on the command line: every run that the user interrupts ends with one line and exit status 130.

Python's own handler raises KeyboardInterrupt wherever the main thread is, and on the way out of a PyTorch
program that goes wrong in three ways, all seen here: an exception inside PyTorch's C++ initialisation
terminates the process, one raised in a callback or destructor is dropped with a traceback and the run goes
on, and one a library catches comes back as an unrelated error. :class:`CtrlC` holds the interrupt while an
import runs and remembers that it was pressed, so that the command can end as interrupted whatever happened
to the exception.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Self

from opsched.exiting import Stopped, stop_point


class CtrlC:
    """SIGINT over one run of a command: raise KeyboardInterrupt as Python's own handler does, and remember
    that it was pressed, so that the run ends as interrupted (one line, status 130) whatever the exception
    met on its way: a library may catch it and fail later with an unrelated error, and Python drops one raised
    in a weakref callback or a destructor ("Exception ignored in ...") and goes on."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._held: threading.Timer | None = None
        # reentrant: the handler runs on the main thread between any two bytecodes, inside a locked block too
        self._held_lock = threading.RLock()
        self._resent = False  # the held interrupt was sent again (to whichever handler is in place then)
        self._held_in_import = False  # held during an import, rather than dropped by a destructor
        self._closed = False  # the block is over: nothing is sent again from now on
        self._previous_unraisable_hook = sys.unraisablehook

    def __call__(self, signum: int, frame: Any) -> None:
        self.pressed = True
        if _importing(frame):
            # PyTorch's C++ initialisation calls back into Python where no exception can pass (pybind11 then
            # terminates the process), and importlib drops exceptions raised in its callbacks: hold the
            # interrupt until the import is over, by asking again shortly.
            self._ask_again_shortly(in_import=True)
            return
        self._held = None
        raise KeyboardInterrupt

    def _ask_again_shortly(self, in_import: bool) -> None:
        with self._held_lock:
            if self._closed or (self._held is not None and not self._resent):  # over, or asked already
                return
            self._resent, self._held_in_import = False, in_import
            self._held = threading.Timer(0.05, self._send_again)
            self._held.daemon = True
            self._held.start()

    def __enter__(self) -> Self:
        # Handlers can only be set from the main thread; elsewhere (main() called from a worker) Python's stays.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self)
            sys.unraisablehook = self._unraisable
        return self

    def _send_again(self) -> None:
        # Sent under the lock, and only by the timer still asked for: once the block has ended (it delivers
        # the interrupt itself) nothing reaches the handler in place after it.
        with self._held_lock:
            if self._closed or self._held is not threading.current_thread():
                return
            self._resent = True
            os.kill(os.getpid(), signal.SIGINT)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        with self._held_lock:
            self._closed = True
            held, self._held = self._held, None
            if held is not None:
                held.cancel()
                # Sent again already: a handler installed inside the block (the command's own) got it and
                # reported it; raising it here as well printed a traceback after "opsched: interrupted". One
                # a destructor dropped is not raised either: the run saw it pressed, or had already answered.
                held = None if self._resent or not self._held_in_import else held
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._previous_unraisable_hook
        if held is not None and exc_type is None:  # the block ended while an interrupt was held: deliver it
            raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        if unraisable.exc_type is not KeyboardInterrupt:
            self._previous_unraisable_hook(unraisable)
        else:
            # Ours, dropped (a destructor, a weakref callback) and the run went on: an interrupted MILP solve
            # ran to its 60 s time limit before the command ended as interrupted. Ask again, where it can pass.
            self._ask_again_shortly(in_import=False)


def solve_cp_sat(solver: Any, model: Any, callback: Any = None) -> Any:
    """``solver.Solve(model, callback)`` (OR-Tools CP-SAT) such that Ctrl-C ends it at once, as an interrupt.

    CP-SAT's own SIGINT handler stops the search and returns the best answer so far as if the time limit had
    come: an interrupted ``opsched map`` went on to write its plan and exit 0. Without that handler the
    interrupt waits, on the main thread, until the solve returns (up to its time limit). So the solve runs on a
    worker thread, CP-SAT's handler off, while the main thread waits where KeyboardInterrupt reaches it; on an
    interrupt the search is stopped and the interrupt raised once the worker has returned.

    Symmetry is used in presolve only (``symmetry_level`` 1, not CP-SAT's default 2): with the default, OR-Tools
    9.15 on two workers certified a mapping 2.8% above the optimum as OPTIMAL in 16 of 30 solves of one model
    (tests/test_mapping_claims.py found it; ``symmetry_level`` 0 and 1 gave the optimum in 30 of 30), the fault
    and the workaround its maintainers have named for symmetry handling (or-tools issues 3483 and 5293)."""
    solver.parameters.catch_sigint_signal = False
    solver.parameters.symmetry_level = 1
    done = threading.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["status"] = solver.Solve(model, callback)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="opsched-cp-sat", daemon=True).start()
    try:
        while not done.wait(0.1):
            stop_point()  # a background build asked to stop: the search stops as on Ctrl-C
    except (KeyboardInterrupt, Stopped):
        # asked again until the worker returns: a stop asked before Solve began its search is not heard, and the
        # search then ran to its time limit (once in the suite: 59 s after Ctrl-C)
        solver.StopSearch()
        while not done.wait(0.05):
            solver.StopSearch()
        raise
    if "error" in box:
        raise box["error"]
    return box["status"]


def _importing(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
