"""Interleaved timing that stops once the fastest is clear (opsched.timing.medians_until_apart): it stops after
its first rounds where one runner is apart from the others, and runs every round where none is; and the race of
an evaluation's configurations (opsched.timing.race_leavers), against timing every one every round."""

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from support.fake_clock import FakeClock

from opsched.noise import choose, same_program_spread
from opsched.timing import interleaved_samples, medians_until_apart, race_leavers


def test_a_clear_winner_stops_the_rounds_early_and_a_tie_runs_them_all(clock):
    # (on a clock only the runners move: with real sleeps, one pause of the machine's made the quick runner's
    # rounds straddle the slow one's, and more rounds ran)
    calls = [0, 0]
    fast, slow = medians_until_apart([clock.runner(0.0, calls, 0), clock.runner(0.003, calls, 1)], repeats=15)
    assert fast < slow
    # five rounds, each a timed call and its untimed lead-in, after one warm-up call
    assert calls == [11, 11]

    # one runner's calls take 1, 3, 3, 1, 3, 3 ... ms, the other's 2: never apart, so all nine rounds run (the
    # first five after a warm-up call, then two and two, each batch after a warm-up call of its own)
    calls = [0, 0]
    cycle = itertools.cycle([0.001, 0.003, 0.003])
    medians_until_apart([clock.runner(lambda: next(cycle), calls, 0), clock.runner(0.002, calls, 1)], repeats=9)
    assert calls == [21, 21]


def test_it_never_runs_more_rounds_than_asked(clock):
    calls = [0, 0]
    medians_until_apart([clock.runner(0.0, calls, 0), clock.runner(0.0, calls, 1)], repeats=3)
    assert calls == [7, 7]  # one warm-up, three rounds of two calls


def test_a_race_stops_timing_a_plainly_slower_runner_but_never_the_control_pair(clock):
    calls, ticks = [0, 0, 0, 0], []
    runners = [clock.runner(s, calls, k) for k, s in enumerate([0.002, 0.0021, 0.004, 0.002])]
    fast, close, slow, again = interleaved_samples(runners, repeats=8, race_after=3, control=(0, 3),
                                                   after_each=lambda: ticks.append(1))
    assert (len(fast), len(close), len(slow), len(again)) == (8, 8, 3, 8)  # close: 5% slower, never left out
    assert calls[2] == 1 + 3 * 2  # a warm-up call, then three rounds of a lead-in and a timed call
    assert len(ticks) == 4 * 8  # the progress of every sample asked, those skipped included
    # without race_after every runner runs every round
    assert [len(s) for s in interleaved_samples(runners[:3], repeats=4)] == [4, 4, 4]


def test_a_noisier_control_widens_the_race_margin():
    # the control 5% from what it repeats: the margin is three times that, 15% (10% in a quiet run)
    samples = [[10.0, 10.0, 10.0], [11.2, 11.2, 11.2], [10.5, 10.4, 10.6], [11.6, 11.6, 11.6]]
    assert race_leavers(samples, [0, 1, 2, 3], (0, 2)) == [3]
    samples[3] = [11.4, 11.6, 11.6]  # one sample within 15%: kept
    assert race_leavers(samples, [0, 1, 2, 3], (0, 2)) == []
    samples[2] = [10.1, 10.0, 10.1]  # a quiet run: 10%
    assert race_leavers(samples, [0, 1, 2, 3], (0, 2)) == [1, 3]


def _raced(samples: list[list[float]], race_after: int, control: tuple[int, int]) -> list[list[float]]:
    """``samples`` as a race would have left them: each runner's cut at the round it was left out."""
    running, stop = list(range(len(samples))), {}
    for round_ in range(race_after, len(samples[0]) + 1):
        so_far = [s[:round_] for s in samples]
        for i in race_leavers(so_far, running, control):
            stop[i] = round_
        running = [i for i in running if i not in stop]
    return [s[:stop.get(i, len(s))] for i, s in enumerate(samples)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(0.6, 2.0), st.sampled_from([1.0, 1.05, 1.1, 1.12])), min_size=2, max_size=7),
       st.sampled_from([0.005, 0.02, 0.05, 0.15, 0.3]), st.booleans(), st.sampled_from([1.0, 1.2, 1.5]),
       st.integers(5, 14), st.integers(0, 2**32 - 1))
def test_a_race_keeps_the_choice_of_timing_every_round(speeds, spread, slowed_rounds, slower, from_round, seed):
    """Against the independent reference of timing every configuration every round (15 rounds, the control
    timed twice, opsched.noise.choose on the run's same-program spread), on runs from quiet to 30% noise, some with
    a round in seven slowed by half, some where the machine slows from a later round on: the race, whose left-out
    configurations are neither chosen nor tied (as opsched.evaluation.evaluate has it), chooses the same."""
    rng = random.Random(seed)

    def sample(speed: float, round_: int) -> float:
        return 10 * speed * (1 + abs(rng.gauss(0, spread))) * (1.5 if slowed_rounds and round_ % 7 == 3 else 1) \
            * (slower if round_ >= from_round else 1)

    samples = [[sample(speed, r) for r in range(15)] for speed in [*speeds, speeds[0]]]
    control = (0, len(speeds))
    floor = same_program_spread(samples[0], samples[-1])
    names = [f"c{i}" for i in range(len(speeds))]
    everything = choose(dict(zip(names, samples)), names, floor)
    raced = _raced(samples, 5, control)
    timed_through = [n for n, s in zip(names, raced) if len(s) == 15]
    chosen = choose(dict(zip(names, raced)), timed_through, floor)
    assert chosen[0] == everything[0], (everything, chosen)


def test_a_lead_in_repeats_a_short_call_until_it_lasts_the_time_asked_at_most_fifty_calls(clock):
    for lead_in, per_sample in ((0.0, 1), (1.0, 50)):
        calls = [0]
        interleaved_samples([clock.runner(0.0, calls, 0)], repeats=4, warmup=1, lead_in_seconds=lead_in)
        assert calls[0] == 1 + 4 * (per_sample + 1)  # the warm-up, then each round's lead-in and sample


class _Wake:
    """Two configurations where the second runs slow in the wake of the first: ``slow`` seconds a call until
    ``lasting`` seconds have passed on ``clock`` since the first's last call, ``fast`` after."""

    def __init__(self, clock: FakeClock, lasting: float, fast: float, slow: float, other: float):
        self.clock, self.lasting, self.fast, self.slow, self.other = clock, lasting, fast, slow, other
        self.other_ended = -1e9

    def other_run(self):
        self.clock.now += self.other
        self.other_ended = self.clock.now

    def run(self):
        self.clock.now += self.slow if self.clock.now - self.other_ended < self.lasting else self.fast


def test_an_evaluation_times_a_short_configuration_past_the_wake_of_the_one_before_it(clock):
    # a wake of 10 ms: with one lead-in call (2 ms) the fast configuration was timed in it, slower than the other
    import torch

    from opsched.evaluation import LEAD_IN_SECONDS, Candidate, evaluate

    assert LEAD_IN_SECONDS >= 0.02
    wake = _Wake(clock, lasting=0.010, fast=0.0005, slow=0.002, other=0.001)
    x = torch.ones(2)

    def answer(run):
        def call():
            run()
            return x
        return call

    ev = evaluate([Candidate("other", answer(wake.other_run), "peer"), Candidate("plan", answer(wake.run))], x,
                  repeats=5)
    assert ev.measured_ms["plan"] < 0.8 * ev.measured_ms["other"], ev.measured_ms
    assert ev.chosen == "plan"
