"""Timing on a noisy machine: configurations are compared interleaved, and medians kept.

A burst of load from a neighbour lasts longer than one run. Timing configuration A ten times and then B
ten times lets such a burst land on one of them only; running A, B, A, B, ... spreads it over both, and
the median of each then ignores the runs it hit.

Each sample is led in by untimed calls of the same configuration (one, or as many as last ``lead_in_seconds``), so
that it is timed in its own steady state (a model called again and again, as it is deployed), not in the wake of
the configuration before it. What that wake costs, measured here (2 cores, GoogLeNet 64 px mapped onto the
``cpu2`` platform's two one-thread devices, medians of 30 calls): 9.4-9.6 ms called back to back, 14.0-14.3 ms
right after eager on 2 threads, 10.0-10.2 ms when 5 ms pass after eager in between. GNU OpenMP's threads spin for
a while after a parallel region before they sleep; eager's 2-thread regions left one spinning on the core the plan's
second stream needed.

>>> import time
>>> fast, slow = interleaved_medians([lambda: None, lambda: time.sleep(0.002)], repeats=3)
>>> fast < 1.0 < slow
True
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from opsched.exiting import stop_point

MAX_INNER = 50
# how much slower than the fastest runner's slowest sample a runner's fastest sample must be for a race to leave it
# out (interleaved_samples): well above the same-program spread of a quiet run here (1-3%), so that a runner as
# fast as the fastest is not left out by chance
RACE_MARGIN = 1.10
RACE_SPREADS = 3.0  # in a noisier run, the margin is this many times one program timed twice lands apart (medians)
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)
TRIM_THRESHOLD = 64 << 20  # and twice that for trimming, as glibc's moving thresholds keep it


def steady_allocator() -> bool:
    """Fix glibc malloc's thresholds in this process, so that how one configuration's tensors are allocated
    does not depend on what ran before it; True when they were set (glibc only).

    glibc serves a block above its mmap threshold with fresh pages from the kernel, and raises the
    threshold to the size of each such block freed (up to 32 MB), trimming the heap above twice that. A
    process that runs one model over and over soon serves every activation from reused heap; in an
    interleaved comparison, what the other configurations allocated and freed decides whether the next one
    pays page faults on every large tensor. Measured here (sixteen small CNNs fused into one plan, 2 cores):
    the plan ran 1.00 ms interleaved with the models one after another, and 1.30 ms when the vmap peer was
    timed beside them, which itself ran 3.1 ms; with the thresholds fixed, 1.06 and 1.9 ms. Fixed at glibc's
    own ceilings, every configuration is timed in that steady state.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(libc.mallopt(m_trim_threshold,
                                                                                      TRIM_THRESHOLD))


def interleaved_medians(runners: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1,
                        min_sample_seconds: float = 0.0,
                        after_each: Callable[[], Any] | None = None) -> list[float]:
    """Median milliseconds per call of each runner over ``repeats`` interleaved rounds, after ``warmup``
    calls each (see :func:`interleaved_samples`)."""
    return [statistics.median(s) for s in interleaved_samples(runners, repeats, warmup, min_sample_seconds,
                                                              after_each)]


def interleaved_samples(runners: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1,
                        min_sample_seconds: float = 0.0, after_each: Callable[[], Any] | None = None,
                        around: Sequence[tuple[Callable[[], Any] | None, Callable[[], Any] | None]] | None = None,
                        race_after: int | None = None, control: tuple[int, int] | None = None,
                        lead_in_seconds: float = 0.0) -> list[list[float]]:
    """Milliseconds per call of each runner in each of ``repeats`` interleaved rounds, after ``warmup``
    calls each, each sample after an untimed lead-in: one call, repeated until it lasts ``lead_in_seconds`` (at most
    50 calls), so that a short call is not timed in the wake of the configuration before it. A sample repeats a
    short call until it lasts ``min_sample_seconds`` (at most 50 calls), so that the clock's resolution does not
    matter. ``after_each`` is called after every sample (say, to
    advance a progress bar; a runner left out calls it for the samples it skips); ``around[i]``, when given, is
    (prepare, settle), called before and after each call of runner i, untimed (either may be None).

    With ``race_after`` and ``control`` (two runners of one program), from that round on the rounds left are
    raced: a runner :func:`race_leavers` names is left out of them, its samples stopping at that round; the time
    goes to those that can still be the fastest or tie with it.
    """
    around = list(around) if around is not None else [(None, None)] * len(runners)

    def calls(i: int, times: int) -> float:
        """Seconds ``times`` calls of runner i took: timed together, unless each needs preparing or settling."""
        prepare, settle = around[i]
        if prepare is None and settle is None:
            began = time.perf_counter()
            for _ in range(times):
                runners[i]()
            return time.perf_counter() - began
        spent = 0.0
        for _ in range(times):
            if prepare is not None:
                prepare()
            began = time.perf_counter()
            runners[i]()
            spent += time.perf_counter() - began
            if settle is not None:
                settle()
        return spent

    inner, lead = [], []
    for i in range(len(runners)):
        for _ in range(max(1, warmup)):
            once = calls(i, 1)
        inner.append(max(1, min(MAX_INNER, int(min_sample_seconds / max(once, 1e-7)))))
        lead.append(max(1, min(MAX_INNER, math.ceil(lead_in_seconds / max(once, 1e-7)))))
    samples: list[list[float]] = [[] for _ in runners]
    running = list(range(len(runners)))
    for round_ in range(1, repeats + 1):
        for i in running:
            stop_point()  # a background build asked to stop (the interpreter exiting, its server stopping)
            calls(i, lead[i])  # the lead-in (see the module docstring), untimed
            samples[i].append(calls(i, inner[i]) / inner[i] * 1000.0)
            if after_each:
                after_each()
        if race_after is not None and control is not None and round_ >= race_after:
            out = race_leavers(samples, running, control)
            running = [i for i in running if i not in out]
            for _ in range(len(out) * (repeats - round_) if after_each else 0):
                after_each()
    return samples


def race_leavers(samples: Sequence[Sequence[float]], running: Sequence[int], control: tuple[int, int]) -> list[int]:
    """The runners of ``running`` a race leaves out after the rounds of ``samples``: those whose every sample is
    slower than every sample of the runner with the lowest median by RACE_MARGIN, or in a noisier run by
    RACE_SPREADS times the spread of the ``control`` pair (one program timed twice) where that is more. A run that
    noisy calls a runner some 10% slower on a few rounds tied with the fastest over all of them
    (:func:`opsched.noise.choose` counts a gain below that spread as none), and leaving it out would change the
    choice; a runner three spreads slower on every round is beaten. Never one of the pair.

    >>> race_leavers([[10, 11], [10, 11], [12.5, 13], [11.5, 12]], [0, 1, 2, 3], (0, 1))
    [2]
    >>> race_leavers([[10, 11], [10.5, 11.5], [12.2, 13], [15, 16]], [0, 1, 2, 3], (0, 1))  # 4.5% apart: 14% margin
    [3]
    """
    from opsched.noise import same_program_spread

    margin = 1.0 + max(RACE_MARGIN - 1.0, RACE_SPREADS * same_program_spread(samples[control[0]], samples[control[1]]))
    fastest = max(samples[min(running, key=lambda i: statistics.median(samples[i]))])
    return [i for i in running if i not in control and min(samples[i]) > margin * fastest]


def medians_until_apart(runners: Sequence[Callable[[], Any]], repeats: int, first: int = 5) -> list[float]:
    """Median milliseconds per call of each runner, as :func:`interleaved_medians`, but the rounds stop once,
    after at least ``first`` of them, every sample of the runner with the lowest median is below every sample of
    each other runner (for two runners of the same speed, chance orders five rounds so about once in 126, a little
    more often with the checks after later rounds), and at ``repeats`` rounds otherwise. For a choice that is
    usually clear, such as a whole graph's thread count.

    >>> fast, slow = medians_until_apart([lambda: None, lambda: time.sleep(0.002)], repeats=15)
    >>> fast < slow
    True
    """
    samples = interleaved_samples(runners, min(first, repeats), warmup=1)
    while len(samples[0]) < repeats and not _apart(samples):
        for kept, more in zip(samples, interleaved_samples(runners, min(2, repeats - len(samples[0])), warmup=0)):
            kept.extend(more)
    return [statistics.median(s) for s in samples]


def _apart(samples: Sequence[Sequence[float]]) -> bool:
    """Whether every sample of the runner with the lowest median is below every sample of each other runner."""
    best = min(range(len(samples)), key=lambda i: statistics.median(samples[i]))
    return all(max(samples[best]) < min(s) for i, s in enumerate(samples) if i != best)


def unsteady(samples: Sequence[float], spread: float = 2.0) -> bool:
    """True when a median is not to be trusted: it is more than ``spread`` times the fastest sample, so
    most of the samples were slowed by something other than the code timed.

    >>> unsteady([10.0, 10.5, 11.0]), unsteady([10.0, 40.0, 45.0])
    (False, True)
    """
    return statistics.median(samples) > spread * min(samples)
