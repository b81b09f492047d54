"""Whether one configuration is faster than another, above the noise of the run that timed them both.

Timings on a shared machine move by several percent from one run to the next: two medians that differ by 5%
are no finding unless the run shows that its own noise is smaller. Two measures of that noise, both from the
run itself:

- the *same-program spread*: one program timed twice, as two configurations, in the same interleaved rounds;
  how far apart their medians land (``|a / b - 1|``) is what the run would report between two things that
  are one;
- a *bootstrap interval of the ratio*: rounds are paired (every configuration is timed once per round, so a
  burst of load that slows one round slows all of them alike); resampling the rounds gives the spread of the
  ratio of the two medians.

A configuration :func:`beats` another when the whole interval lies below 1 and its gain is larger than the
same-program spread. :func:`choose` keeps the simplest configuration that no other beats.

>>> fast, slow = [10.0, 10.2, 9.9, 10.1, 10.0], [12.0, 12.1, 11.9, 12.2, 12.0]
>>> beats(fast, slow, floor=0.02), beats(fast, [10.1, 10.0, 10.2, 9.9, 10.0], floor=0.02)
(True, False)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

RESAMPLES = 1000
CONFIDENCE = 0.99  # a false finding between two runs of one program in about 1 comparison of 150 (tests/test_noise.py)


def same_program_spread(first: Sequence[float], again: Sequence[float]) -> float:
    """How far apart the medians of one program timed twice landed, as a fraction.

    >>> round(same_program_spread([10.0, 10.0, 10.0], [10.3, 10.2, 10.4]), 3)
    0.029
    """
    a, b = statistics.median(first), statistics.median(again)
    return abs(a / b - 1.0) if b > 0 else 0.0


def ratio_interval(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """``median(a) / median(b)`` and its bootstrap ``confidence`` interval, resampling the paired rounds
    (``a[i]`` and ``b[i]`` were timed in the same round). Where one list is shorter (a configuration left out of
    the later rounds of a race, :func:`opsched.timing.interleaved_samples`), both are taken over the rounds they
    were both timed in. Seeded: the same samples give the same interval.

    >>> ratio, low, high = ratio_interval([10.0, 10.5, 9.8, 10.2], [20.0, 20.4, 19.9, 20.1])
    >>> round(ratio, 3), low < ratio < high < 0.52
    (0.504, True)
    """
    import numpy as np

    rounds = min(len(a), len(b))
    if not rounds:
        raise ValueError("ratio_interval needs two non-empty lists of paired samples")
    first, second = np.asarray(a[:rounds], dtype=np.float64), np.asarray(b[:rounds], dtype=np.float64)
    ratio = float(np.median(first) / np.median(second))
    picks = np.random.default_rng(seed).integers(0, len(first), size=(resamples, len(first)))
    ratios = np.sort(np.median(first[picks], axis=1) / np.median(second[picks], axis=1))
    tail = (1.0 - confidence) / 2.0
    return ratio, float(ratios[int(tail * (resamples - 1))]), float(ratios[int((1.0 - tail) * (resamples - 1))])


def beats(a: Sequence[float], b: Sequence[float], floor: float = 0.0) -> bool:
    """True when samples ``a`` are faster than ``b`` above the run's noise: the bootstrap interval of
    ``median(a) / median(b)`` lies wholly below 1, and the gain is larger than ``floor`` (the same-program
    spread)."""
    ratio, _, high = ratio_interval(a, b)
    return high < 1.0 and ratio < 1.0 - floor


def choose(samples: dict[str, Sequence[float]], simplest_first: Sequence[str], floor: float = 0.0
           ) -> tuple[str, list[str]]:
    """The configuration to keep and the ones tied at the top: of ``simplest_first`` (names of ``samples``, the
    simplest first), those that no other :func:`beats` (the fastest is always one: only a smaller median
    beats), and the first of them.

    Not merely those the fastest does not beat: a configuration whose samples spread widely beats nothing,
    and a slow one beside it would then count as tied with the fastest though a third beats it plainly.

    >>> samples = {"eager": [10.0, 10.1, 10.0], "plan": [9.9, 10.0, 9.9], "slow": [13.0, 13.1, 13.0]}
    >>> choose(samples, ["eager", "plan", "slow"], floor=0.02)
    ('eager', ['eager', 'plan'])
    """
    medians = {n: statistics.median(samples[n]) for n in simplest_first}
    tied = [n for n in simplest_first
            if not any(medians[m] < medians[n] and beats(samples[m], samples[n], floor) for m in simplest_first)]
    return tied[0], tied
