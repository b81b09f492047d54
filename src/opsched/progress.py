"""What a command is doing, on stderr, while it works: the phases it goes through (:func:`say`) and the
progress of its long steps (:func:`progress_bar`).

On a terminal a step is a tqdm bar, redrawn in place. Anywhere else (a CI log, a pipe, ``2> log``) a bar's
redraws would pile up as one endless line, and nothing at all would leave a log silent for the minute a
model's profiling takes; there a step prints plain lines instead: one as it starts, one at most every
:data:`PERIOD` seconds saying how far it is, and one as it ends, never one per tick. The commands' ``--quiet``
(:func:`quiet`) prints neither; warnings and errors are printed either way. Lines are flushed one by one, so
that a log shows each as it happens.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any, Self

PERIOD = 10.0  # seconds between two lines of a step's progress, off a terminal

_quiet = False


@contextlib.contextmanager
def quiet(silent: bool = True) -> Iterator[None]:
    """No phase and no progress printed while in the block (when ``silent``): a command's ``--quiet``."""
    global _quiet
    before, _quiet = _quiet, silent
    try:
        yield
    finally:
        _quiet = before


def say(text: str) -> None:
    """One line on stderr saying what the command does next."""
    if not _quiet:
        print(text, file=sys.stderr, flush=True)


def progress_bar(description: str, total: int, unit: str | None = None) -> Any:
    """The progress of a step of ``total`` ticks (``unit``s, say ``run``): a tqdm bar when stderr is a
    terminal, a :class:`ProgressLines` otherwise, and a disabled bar when quiet. Each has tqdm's ``update(n)``,
    ``n`` (ticks done), ``close()`` and context manager."""
    if _quiet or sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=description, unit=unit or "it", leave=False, disable=_quiet, file=sys.stderr)
    return ProgressLines(description, total, unit)


class ProgressLines:
    """A step's progress as a few plain lines on stderr: ``DESCRIPTION: 0/TOTAL UNITs`` as it starts,
    ``DESCRIPTION: DONE/TOTAL UNITs, S s`` at the first tick at least :data:`PERIOD` seconds after the line
    before, and ``DESCRIPTION: DONE/TOTAL UNITs, done in S s`` when closed. A step ended by an exception
    (an error, Ctrl-C) says nothing more: the error is the command's last line."""

    def __init__(self, description: str, total: int, unit: str | None = None):
        self.description = description
        self.total = total
        self.unit = f" {unit}s" if unit else ""
        self.n = 0
        self.closed = False
        self.started = self.printed = time.monotonic()
        self._line("")

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.printed >= PERIOD:
            self.printed = now
            self._line(f", {now - self.started:.0f} s")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(f", done in {time.monotonic() - self.started:.1f} s")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the error is the command's last line
            self.closed = True

    def _line(self, tail: str) -> None:
        print(f"{self.description}: {self.n}/{self.total}{self.unit}{tail}", file=sys.stderr, flush=True)
