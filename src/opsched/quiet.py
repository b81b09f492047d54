"""PyTorch's chatter silenced on one thread, never the process: :func:`this_thread_quiet`.

torch.export and the ONNX exporter warn, log and print what are notes to themselves (partial graphs,
symbolic-shape reasoning, deprecations). opsched runs them on background threads too (a server building a
fused plan while it answers), so silencing them must not silence the rest of the process. Warnings filters,
loggers, ``sys.stderr`` and file descriptor 2 are each one for the process, and swapping them (``catch_warnings``,
a logger's level, ``dup2`` onto /dev/null) dropped, for the seconds a capture or export took, every other thread's
warnings, torch logs and error output. Instead each of them is given, once, a hook that drops what comes from a
quiet thread and lets the rest through:

- a warnings filter, first in ``warnings.filters``, whose category matches only on a quiet thread;
- a logging filter on each ``torch`` logger and its handlers, on the record's own thread;
- ``sys.stderr`` replaced, while any thread is quiet, by a stream that writes nowhere for quiet threads;
- ``torch._C._jit_onnx_log``, through which the TorchScript exporter prints the graph of a failed export to
  standard output whatever the log's setting (PyTorch 2.14), passed through for other threads.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as seen:
...     warnings.simplefilter("always")
...     with this_thread_quiet():
...         warnings.warn("a note to itself")
...     warnings.warn("the user's own")
>>> [str(w.message) for w in seen]
["the user's own"]
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

_quiet: Counter[int] = Counter()  # thread ident -> how many this_thread_quiet it is inside
_lock = threading.Lock()


def _is_quiet() -> bool:
    return _quiet[threading.get_ident()] > 0


class _OnQuietThreads(type):
    """Metaclass of :class:`QuietWarning`: the warnings machinery asks ``issubclass(warning's category,
    filter's category)`` of each filter, which this answers yes for any warning, on a quiet thread only."""

    def __subclasscheck__(cls, subclass: Any) -> bool:
        return _is_quiet()


class QuietWarning(Warning, metaclass=_OnQuietThreads):
    """The category of opsched's one warnings filter ("ignore"): every warning on a quiet thread."""


class _FromOtherThreads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _quiet[record.thread] == 0 if record.thread is not None else True


_LOG_FILTER = _FromOtherThreads()


class _OtherThreadsOnly:
    """``stream`` for every thread but a quiet one, which writes nowhere."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text) if _is_quiet() else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, encoding, isatty...: the stream's own
        return getattr(self._stream, name)


def _onnx_log_passing_other_threads(log: Any) -> Any:
    def onnx_log(*args: Any) -> None:
        if not _is_quiet():
            log(*args)

    onnx_log.opsched_quiet = True
    return onnx_log


def _install_hooks() -> None:
    """The hooks, where they are not in place: called on each entry, since a user's ``catch_warnings`` or
    ``resetwarnings`` can drop the filter, and torch makes loggers as it imports its modules."""
    first = warnings.filters[0] if warnings.filters else None
    if first is None or first[2] is not QuietWarning:  # first, so that no "error" filter comes before it
        warnings.filterwarnings("ignore", category=QuietWarning)
    torch_loggers = [logging.getLogger("torch")] + [
        logger for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger)]
    for logger in torch_loggers:
        logger.addFilter(_LOG_FILTER)  # (a no-op where it is there already)
        # and on their handlers (torch gives its registered logs handlers of their own, and a user may add some),
        # which a logger torch makes while a capture runs reaches: it has no filter of its own yet (torch.export's
        # first run imports modules that make some)
        for handler in logger.handlers:
            handler.addFilter(_LOG_FILTER)
    log = getattr(torch._C, "_jit_onnx_log", None)
    if log is not None and not getattr(log, "opsched_quiet", False):
        torch._C._jit_onnx_log = _onnx_log_passing_other_threads(log)


@contextlib.contextmanager
def this_thread_quiet() -> Iterator[None]:
    """Within: this thread's warnings, ``torch`` logs, ``sys.stderr`` writes and the ONNX exporter's log are
    dropped; other threads' are not. Nests. What C++ writes straight to file descriptor 2 is not caught."""
    me = threading.get_ident()
    with _lock:
        _install_hooks()
        # (again where a thread of the user's set a stream of its own meanwhile; none where there is none)
        if sys.stderr is not None and not isinstance(sys.stderr, _OtherThreadsOnly):
            sys.stderr = _OtherThreadsOnly(sys.stderr)
        _quiet[me] += 1
    try:
        yield
    finally:
        with _lock:
            _quiet[me] -= 1
            if not _quiet[me]:
                del _quiet[me]
            while not _quiet and isinstance(sys.stderr, _OtherThreadsOnly):  # (a stream set meanwhile: left)
                sys.stderr = sys.stderr._stream
