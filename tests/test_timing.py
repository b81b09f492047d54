"""Interleaved timing that stops once the fastest is clear (opsched.timing.medians_until_apart): it stops after
its first rounds where one runner is apart from the others, and runs every round where none is."""

import itertools
import time

from opsched.timing import medians_until_apart


def _counted(seconds: float, calls: list[int], k: int):
    def run():
        calls[k] += 1
        if seconds:
            time.sleep(seconds)
    return run


def test_a_clear_winner_stops_the_rounds_early_and_a_tie_runs_them_all():
    calls = [0, 0]
    fast, slow = medians_until_apart([_counted(0.0, calls, 0), _counted(0.003, calls, 1)], repeats=15)
    assert fast < slow
    # five rounds, each a timed call and its untimed lead-in, after one warm-up call
    assert calls == [11, 11]

    # one runner's calls take 1, 3, 3, 1, 3, 3 ... ms, the other's 2: never apart, so all nine rounds run (the
    # first five after a warm-up call, then two and two, each batch after a warm-up call of its own)
    calls = [0, 0]
    cycle = itertools.cycle([0.001, 0.003, 0.003])

    def straddling():
        calls[0] += 1
        time.sleep(next(cycle))

    medians_until_apart([straddling, _counted(0.002, calls, 1)], repeats=9)
    assert calls == [21, 21]


def test_it_never_runs_more_rounds_than_asked():
    calls = [0, 0]
    medians_until_apart([_counted(0.0, calls, 0), _counted(0.0, calls, 1)], repeats=3)
    assert calls == [7, 7]  # one warm-up, three rounds of two calls
