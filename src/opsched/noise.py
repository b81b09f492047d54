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
same-program spread. :func:`choose` keeps the simplest configuration that the fastest one does not beat.

>>> fast, slow = [10.0, 10.2, 9.9, 10.1, 10.0], [12.0, 12.1, 11.9, 12.2, 12.0]
>>> beats(fast, slow, floor=0.02), beats(fast, [10.1, 10.0, 10.2, 9.9, 10.0], floor=0.02)
(True, False)
"""

from __future__ import annotations

import random
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
    (``a[i]`` and ``b[i]`` were timed in the same round). Seeded: the same samples give the same interval.

    >>> ratio, low, high = ratio_interval([10.0, 10.5, 9.8, 10.2], [20.0, 20.4, 19.9, 20.1])
    >>> round(ratio, 3), low < ratio < high < 0.52
    (0.504, True)
    """
    if len(a) != len(b) or not a:
        raise ValueError("ratio_interval needs two equally long, non-empty lists of paired samples")
    ratio = statistics.median(a) / statistics.median(b)
    rng = random.Random(seed)
    n = len(a)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median([a[i] for i in picks]) / statistics.median([b[i] for i in picks]))
    ratios.sort()
    tail = (1.0 - confidence) / 2.0
    return ratio, ratios[int(tail * (resamples - 1))], ratios[int((1.0 - tail) * (resamples - 1))]


def beats(a: Sequence[float], b: Sequence[float], floor: float = 0.0) -> bool:
    """True when samples ``a`` are faster than ``b`` above the run's noise: the bootstrap interval of
    ``median(a) / median(b)`` lies wholly below 1, and the gain is larger than ``floor`` (the same-program
    spread)."""
    ratio, _, high = ratio_interval(a, b)
    return high < 1.0 and ratio < 1.0 - floor


def choose(samples: dict[str, Sequence[float]], simplest_first: Sequence[str], floor: float = 0.0
           ) -> tuple[str, list[str]]:
    """The configuration to keep and the ones tied with the fastest: of ``simplest_first`` (names of
    ``samples``, the simplest first), the first that the fastest does not :func:`beats`.

    >>> samples = {"eager": [10.0, 10.1, 10.0], "plan": [9.9, 10.0, 9.9], "slow": [13.0, 13.1, 13.0]}
    >>> choose(samples, ["eager", "plan", "slow"], floor=0.02)
    ('eager', ['eager', 'plan'])
    """
    fastest = min(simplest_first, key=lambda n: statistics.median(samples[n]))
    tied = [n for n in simplest_first if n == fastest or not beats(samples[fastest], samples[n], floor)]
    return tied[0], tied
