"""Schedulers, one algorithm per file; each is a function (graph, cost, options) -> Schedule.

``make_schedule`` runs one by name, times it, and attaches the lower bounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opsched.cost.base import CostModel
from opsched.errors import OpschedError
from opsched.graph.ir import Graph
from opsched.schedule import Schedule
from opsched.schedulers.bounds import lower_bounds
from opsched.schedulers.exact import exact
from opsched.schedulers.greedy import greedy
from opsched.schedulers.hivemind import hivemind
from opsched.schedulers.ios import ios
from opsched.schedulers.lios import lios
from opsched.schedulers.nimble import nimble
from opsched.schedulers.sequential import sequential

SCHEDULERS: dict[str, Callable[..., Schedule]] = {
    "sequential": sequential, "greedy": greedy, "lios": lios, "nimble": nimble, "ios": ios, "exact": exact,
    "hivemind": hivemind,
}


def make_schedule(method: str, graph: Graph, cost: CostModel, **options: Any) -> Schedule:
    """Run scheduler ``method`` with the options it takes; record search time and lower bounds.

    >>> from opsched.models.synthetic import independent_chains
    >>> from opsched.cost.table import TableCost
    >>> g = independent_chains(2, 3)
    >>> s = make_schedule("lios", g, TableCost(g), streams=2)
    >>> s.predicted_latency, s.bounds["lower_bound"]
    (3.0, 3.0)
    """
    if method not in SCHEDULERS:
        raise OpschedError(f"unknown method {method!r}; choose from {', '.join(SCHEDULERS)}")
    started = time.perf_counter()
    schedule = SCHEDULERS[method](graph, cost, **options)
    schedule.stats.setdefault("search_seconds", time.perf_counter() - started)
    schedule.stats.setdefault("states", None)
    schedule.stats.setdefault("transitions", None)
    schedule.bounds = lower_bounds(graph, cost, streams=options.get("streams", 0))
    return schedule


__all__ = ["SCHEDULERS", "exact", "greedy", "hivemind", "ios", "lios", "lower_bounds", "make_schedule", "nimble", "sequential"]
