"""A clock only the code under test moves: runners advance it by their cost, so that timing logic (rounds, races,
ties, the noise floor) is tested without the machine's noise, the same on every machine and every run."""

import random
from collections.abc import Callable
from typing import Any


class FakeClock:
    """``perf_counter`` as ``opsched.timing`` reads it (``monkeypatch.setattr(opsched.timing, "time", clock)``);
    :meth:`runner` makes a call that costs ``seconds``, times a log-normal jitter of ``spread`` drawn from a seeded
    generator (the same draws every run)."""

    def __init__(self, seed: int = 0):
        self.now = 0.0
        self.rng = random.Random(seed)

    def perf_counter(self) -> float:
        return self.now

    def runner(self, seconds: float | Callable[[], float], calls: list[int] | None = None, k: int = 0,
               value: Any = None, spread: float = 0.0) -> Callable[[], Any]:
        """A call costing ``seconds`` (or what it returns, each call), counted in ``calls[k]``, returning ``value``."""
        def run():
            if calls is not None:
                calls[k] += 1
            cost = seconds() if callable(seconds) else seconds
            self.now += cost * (self.rng.lognormvariate(0.0, spread) if spread else 1.0)
            return value
        return run
