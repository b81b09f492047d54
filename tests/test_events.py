"""The one event simulator against a reference written the plain way: jobs started in time order, one event at
a time (what the mapping replay did before it shared the simulator)."""

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.events import Deadlock, simulate


def reference(orders, duration, inputs):
    """Event-driven: a stream starts its head job when it is free and every input has arrived; events (job
    finishes) are processed in time order."""
    waiting = {job: list(inputs(job)) for jobs in orders for job in jobs}
    finish, start, head, free = {}, {}, [0] * len(orders), [0.0] * len(orders)
    events = [(0.0, k) for k in range(len(orders))]
    while events:
        now, k = heapq.heappop(events)
        if head[k] >= len(orders[k]) or free[k] > now:
            continue
        job = orders[k][head[k]]
        if any(p not in finish for p, _ in waiting[job]):
            continue
        ready = max([finish[p] + d for p, d in waiting[job]], default=0.0)
        if ready > now:
            heapq.heappush(events, (ready, k))
            continue
        start[job], finish[job] = now, now + duration(job)
        free[k] = finish[job]
        head[k] += 1
        for j in range(len(orders)):
            heapq.heappush(events, (max(finish[job], free[j]), j))
    return start, finish


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 14), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_simulate_matches_the_event_by_event_reference(n, streams, seed):
    rng = random.Random(seed)
    preds = {u: [j for j in range(u) if rng.random() < 0.35] for u in range(n)}
    orders = [[] for _ in range(streams)]
    for u in range(n):  # each stream in a topological order: no deadlock
        orders[rng.randrange(streams)].append(u)
    length = {u: rng.choice([0.0, 1.0, 2.5, rng.uniform(0, 5)]) for u in range(n)}
    delay = {(j, u): rng.choice([0.0, 0.5, rng.uniform(0, 3)]) for u in range(n) for j in preds[u]}

    def inputs(u):
        return [(j, delay[(j, u)]) for j in preds[u]]

    times = simulate(orders, length.__getitem__, inputs)
    start, finish = reference(orders, length.__getitem__, inputs)
    assert times.finish.keys() == finish.keys() == set(range(n))
    for u in range(n):
        assert times.start[u] == pytest.approx(start[u]) and times.finish[u] == pytest.approx(finish[u])


def test_orders_that_wait_on_each_other_deadlock():
    with pytest.raises(Deadlock) as raised:
        simulate([["b", "a"], ["c"]], lambda job: 1.0, lambda job: [("c", 0.0)] if job == "b" else
                 [("a", 0.0)] if job == "c" else [])
    assert raised.value.job in ("b", "c")
