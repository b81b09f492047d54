"""Timing on a noisy machine: configurations are compared interleaved, and medians kept.

A burst of load from a neighbour lasts longer than one run. Timing configuration A ten times and then B
ten times lets such a burst land on one of them only; running A, B, A, B, ... spreads it over both, and
the median of each then ignores the runs it hit.

>>> import time
>>> fast, slow = interleaved_medians([lambda: None, lambda: time.sleep(0.002)], repeats=3)
>>> fast < 1.0 < slow
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

MAX_INNER = 50


def interleaved_medians(runners: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1,
                        min_sample_seconds: float = 0.0,
                        after_each: Callable[[], Any] | None = None) -> list[float]:
    """Median milliseconds per call of each runner over ``repeats`` interleaved rounds, after ``warmup``
    calls each (see :func:`interleaved_samples`)."""
    return [statistics.median(s) for s in interleaved_samples(runners, repeats, warmup, min_sample_seconds,
                                                              after_each)]


def interleaved_samples(runners: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1,
                        min_sample_seconds: float = 0.0,
                        after_each: Callable[[], Any] | None = None) -> list[list[float]]:
    """Milliseconds per call of each runner in each of ``repeats`` interleaved rounds, after ``warmup``
    calls each. A sample repeats a short call until it lasts ``min_sample_seconds`` (at most 50 calls), so
    that the clock's resolution does not matter. ``after_each`` is called after every sample (say, to
    advance a progress bar)."""
    inner = []
    for run in runners:
        for _ in range(max(1, warmup)):
            began = time.perf_counter()
            run()
            once = time.perf_counter() - began
        inner.append(max(1, min(MAX_INNER, int(min_sample_seconds / max(once, 1e-7)))))
    samples: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for i, run in enumerate(runners):
            began = time.perf_counter()
            for _ in range(inner[i]):
                run()
            samples[i].append((time.perf_counter() - began) / inner[i] * 1000.0)
            if after_each:
                after_each()
    return samples


def unsteady(samples: Sequence[float], spread: float = 2.0) -> bool:
    """True when a median is not to be trusted: it is more than ``spread`` times the fastest sample, so
    most of the samples were slowed by something other than the code timed.

    >>> unsteady([10.0, 10.5, 11.0]), unsteady([10.0, 40.0, 45.0])
    (False, True)
    """
    return statistics.median(samples) > spread * min(samples)
