"""The ``opsched`` executable and ``python -m opsched``.

Kept apart from :mod:`opsched.cli` so that Ctrl-C is handled before the command line's own imports
(networkx, then PyTorch) begin.
"""

import os
import signal
import sys

from opsched.interrupt import CtrlC


def script() -> None:
    """Run :func:`opsched.cli.main` on ``sys.argv`` and exit with its status; no Ctrl-C, from the first
    import to the interpreter's teardown, ends it any other way than ``opsched: interrupted`` and 130."""
    with CtrlC():
        try:
            from opsched.cli import main

            status = main()
        except KeyboardInterrupt:  # pressed while opsched.cli was being imported
            print("opsched: interrupted", file=sys.stderr)
            status = 130
    sys.stdout.flush()
    sys.stderr.flush()
    if status == 130:
        # A KeyboardInterrupt that passed through code run by PyRun_String (pybind11's exec is such code) sets
        # CPython's "unhandled KeyboardInterrupt" flag even though we caught it, and the interpreter then kills
        # itself by SIGINT on exit instead of returning 130 (seen here before imports held the interrupt).
        # Nothing is left to clean up: caches and files were closed while the exception unwound.
        os._exit(130)
    # The answer is out; tearing down the interpreter (PyTorch's exit hooks) takes a moment, and a Ctrl-C then
    # would kill the process by the signal after the work was done and reported.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    script()
