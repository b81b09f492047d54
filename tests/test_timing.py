"""Interleaved timing that stops once the fastest is clear (opsched.timing.medians_until_apart): it stops after
its first rounds where one runner is apart from the others, and runs every round where none is."""

import itertools
import time

from opsched.timing import interleaved_samples, medians_until_apart


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


def test_a_race_stops_timing_a_plainly_slower_runner_but_never_one_it_keeps():
    calls, ticks = [0, 0, 0], []
    runners = [_counted(0.0, calls, 0), _counted(0.004, calls, 1), _counted(0.004, calls, 2)]
    fast, slow, kept = interleaved_samples(runners, repeats=8, race_after=3, keep=(2,),
                                           after_each=lambda: ticks.append(1))
    assert (len(fast), len(slow), len(kept)) == (8, 3, 8)
    assert calls[1] == 1 + 3 * 2  # a warm-up call, then three rounds of a lead-in and a timed call
    assert len(ticks) == 3 * 8  # the progress of every sample asked, those skipped included
    # without race_after every runner runs every round
    assert [len(s) for s in interleaved_samples(runners[:2], repeats=4)] == [4, 4]


def test_a_race_never_leaves_out_a_runner_as_fast_as_the_fastest():
    """Two runners of one program: every sample of one would have to be 10% slower than every sample of the other,
    which alternating steady calls never are."""
    calls = [0, 0]
    a, b = interleaved_samples([_counted(0.002, calls, 0), _counted(0.002, calls, 1)], repeats=10, race_after=3)
    assert len(a) == len(b) == 10
