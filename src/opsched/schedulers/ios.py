"""IOS: the dynamic program over stages (Ding et al., MLSys 2021, Algorithm 1), over *all* endings.

A state S is the set of units still to schedule (a bitmask). An *ending* S' of S is a non-empty subset
with no edge from S' to S - S': it can run last. Then

    cost[S] = min over endings S' of S of  cost[S - S'] + stage_latency(S'),   cost[{}] = 0,

where a stage's latency is the better of running its groups (connected components) concurrently and
merging its units into one operator, when the graph says they can be merged. Pruning: an ending is tried
only if it has at most ``max_groups`` groups of at most ``max_group_size`` units each (0: no limit).

Endings are enumerated without repeats and without testing every subset: starting from nothing, a unit
may be added once all its successors inside S are in the ending; each step goes on only with the
candidates of higher index than the unit it added plus the units that unit newly enabled, so every ending
is reached along exactly one path. Group sizes only grow as units are added, so a unit that makes a group
too large cuts off every ending that would contain it. Groups are tracked in an array giving each taken
unit the mask of its group, undone on the way back; stage latencies are memoised by mask.

With compiled kernels (a cost model that prices ``region_latencies``), a block may instead run as one compiled
region, its units back to back, where the compiler fuses across them: a block takes the cheaper of its best
stages and its region. Then every run of one-group stages, which the runtime fuses into one region across
blocks too, is priced as that region, and the plan with regions is kept only if it beats the plan without.

Example: two independent chains of two units; the best schedule runs them side by side.

>>> from opsched.models.synthetic import independent_chains
>>> from opsched.cost.table import TableCost
>>> g = independent_chains(2, 2)
>>> s = ios(g, TableCost(g), max_group_size=0, max_groups=0)
>>> s.predicted_latency, s.stats["states"], s.stats["transitions"]
(2.0, 8, 27)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from opsched.cost.base import CostModel
from opsched.graph.blocks import DEFAULT_MAX_SIZE, split_blocks
from opsched.graph.ir import Graph, can_merge, components, indices, mask_of
from opsched.schedule import RunSettings, Schedule, from_stages, joined_runs

# A block's search stops past this many transitions and its halves are searched instead (see ios). The
# zoo's largest block, NASNet-A's, takes 2.5 million (6.2 s on a 2-core Xeon), which this leaves whole;
# 16 ResNet-18 fused for a server made a 17-unit block of 40.8 million, and a server's fused graph of them
# was still searching after 15 minutes.
DEFAULT_MAX_TRANSITIONS = 5_000_000


def ios(graph: Graph, cost: CostModel, max_group_size: int = 3, max_groups: int = 8, split: bool = True,
        max_block_size: int = DEFAULT_MAX_SIZE, merge: bool = True, concurrent: bool = True,
        max_transitions: int = DEFAULT_MAX_TRANSITIONS,
        progress: Callable[[int, int], None] | None = None) -> Schedule:
    """Schedule ``graph`` block by block (the whole graph as one block when ``split`` is False).

    ``merge``/``concurrent`` switch the two stage strategies (IOS-parallel is ``merge=False``, IOS-merge
    ``concurrent=False``, where a stage that cannot merge holds one unit). A block whose search would
    evaluate more than ``max_transitions`` transitions (0: no limit) is searched as the two halves of its
    topological order instead, and so on down (``stats["halved"]`` counts them; ``stats["transitions"]``
    includes those of the searches given up): the number of states grows with a block's width, not its
    size, and a 17-unit block of 16 ResNet-18 fused side by side took 40.8 million transitions.
    ``progress(done, total)`` is called after each block.
    """
    if max_group_size < 0 or max_groups < 0:
        raise ValueError("max_group_size and max_groups must be 0 (no limit) or positive")
    if max_transitions < 0:  # (a block of one unit takes one transition: any positive budget halves down to it)
        raise ValueError("max_transitions must be 0 (no limit) or positive")
    if not (merge or concurrent):
        raise ValueError("at least one of merge and concurrent must be allowed")
    n = len(graph)
    r = max_group_size or n
    s = max_groups or n
    stage_cost = StageCost(graph, cost, merge, concurrent)
    blocks = split_blocks(graph, max_block_size if split else 0, at_cuts=split)
    stages: list[tuple[str, list[list[int]]]] = []
    region_stages: list[tuple[str, list[list[int]]]] = []  # the same, with the blocks that pay as regions
    # With compiled kernels a block can also run as one compiled region, its units back to back: the
    # compiler fuses across them, which concurrent stages give up. The cost model prices each block so.
    # (the first time, a measured cost model profiles them: time not counted as search)
    region_ms = cost.region_latencies([list(b.units) for b in blocks])
    started = time.perf_counter()
    region_blocks = 0
    states = transitions = 0
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 50 * n + 1000))
    halved = 0

    def search(units: tuple[int, ...]) -> tuple[list[tuple[str, list[list[int]]]], float]:
        """The best stages of the block of ``units``, in order, and their latency: its own search, or where that
        goes over ``max_transitions``, its halves' one after the other."""
        nonlocal states, transitions, halved
        mask = mask_of(units)
        try:
            best, choice, block_transitions = search_block(graph, mask, r, s, stage_cost, max_transitions)
        except _OverBudget as over:
            transitions += over.transitions
            halved += 1
            half = len(units) // 2
            first, first_ms = search(units[:half])
            second, second_ms = search(units[half:])
            return first + second, first_ms + second_ms
        states += len(best) - 1
        transitions += block_transitions
        block_stages = []
        rest = mask
        while rest:
            ending = choice[rest]
            block_stages.append(stage_cost.plan(ending))
            rest ^= ending
        return block_stages[::-1], best[mask]

    try:
        for done, block in enumerate(blocks, 1):
            block_stages, block_ms = search(block.units)
            stages.extend(block_stages)
            if region_ms is not None and len(block) > 1 and region_ms[done - 1] < block_ms:
                block_stages = [("concurrent", [list(block.units)])]
                region_blocks += 1
            region_stages.extend(block_stages)
            if progress:
                progress(done, len(blocks))
    finally:
        sys.setrecursionlimit(old_limit)
    options = {"max_group_size": max_group_size, "max_groups": max_groups, "split": split,
               "max_block_size": max_block_size, "merge": merge, "concurrent": concurrent,
               "max_transitions": max_transitions}
    stats = {"states": states, "transitions": transitions, "blocks": len(blocks), "halved": halved,
             "stage_latencies_computed": len(stage_cost.memo)}
    schedule = from_stages(graph, cost, "ios", stages, stats=stats, options=options)
    if region_ms is not None:
        # The runs are priced as the regions they run as (profiled: not search time); the plan with regions
        # is kept only if it beats the plan without.
        searched = time.perf_counter() - started
        several = sum(1 for b in blocks if len(b) > 1)
        with_regions = from_stages(graph, cost, "ios", joined_runs(region_stages),
                                   stats={**stats, "region_blocks": region_blocks, "blocks_of_several": several},
                                   options=options, run=RunSettings(regions=True))
        started = time.perf_counter() - searched
        if with_regions.predicted_latency < schedule.predicted_latency:
            schedule = with_regions
    schedule.stats["search_seconds"] = time.perf_counter() - started
    return schedule


class StageCost:
    """Stage latency by mask, memoised: the better of concurrent and merged execution."""

    def __init__(self, graph: Graph, cost: CostModel, merge: bool, concurrent: bool):
        self.graph = graph
        self.cost = cost
        self.memo: dict[int, float] = {}
        self.merge = merge
        self.concurrent = concurrent
        self.conv_mask = sum(1 << i for i, nd in enumerate(graph.nodes) if nd.kind == "conv") if merge else 0

    def __call__(self, mask: int, group_masks: list[int]) -> float:
        """Latency of the stage ``mask`` whose groups (as masks) the search already knows."""
        latency, _ = self._evaluate(mask, [list(indices(g)) for g in group_masks])
        self.memo[mask] = latency
        return latency

    def _evaluate(self, mask: int, groups: list[list[int]]) -> tuple[float, str]:
        concurrent = math.inf
        if self.concurrent or (len(groups) == 1 and len(groups[0]) == 1):
            concurrent = self.cost.stage_latency(groups)
        merged = math.inf
        if (self.merge and mask.bit_count() > 1 and mask & self.conv_mask == mask
                and can_merge([self.graph.nodes[u] for u in indices(mask)])):
            m = self.cost.merge_latency(list(indices(mask)))
            merged = math.inf if m is None else m
        return (merged, "merge") if merged < concurrent else (concurrent, "concurrent")

    def plan(self, mask: int) -> tuple[str, list[list[int]]]:
        groups = components(self.graph, mask)
        _, strategy = self._evaluate(mask, groups)
        if strategy == "merge":
            return strategy, [[u] for u in indices(mask)]
        return strategy, groups


class _OverBudget(Exception):
    """A block's search went over its transitions (``transitions``: those it had evaluated)."""

    def __init__(self, transitions: int):
        super().__init__(transitions)
        self.transitions = transitions


def search_block(graph: Graph, block: int, r: int, s: int, stage_cost: StageCost,
                 max_transitions: int = 0) -> tuple[dict, dict, int]:
    """The DP over the states of one block. Returns cost[S], choice[S] (the best last stage) and the
    number of transitions evaluated; raises _OverBudget past ``max_transitions`` of them (0: no limit)."""
    succs = [m & block for m in graph.succs]
    preds = [m & block for m in graph.preds]
    adj = [p | q for p, q in zip(preds, succs)]
    group_of = [0] * len(graph)  # for each unit in the ending being built, the mask of its group
    best: dict[int, float] = {0: 0.0}
    choice: dict[int, int] = {}
    memo = stage_cost.memo
    inf = math.inf
    transitions = 0
    limit = max_transitions or inf

    def extend(state: int, taken: int, allowed: int, groups: int, acc: list) -> None:
        nonlocal transitions
        while allowed:
            low = allowed & -allowed
            allowed ^= low
            u = low.bit_length() - 1
            near = adj[u] & taken
            group = low
            joined = None
            if near:
                joined = []
                rest = near
                while rest:
                    g = group_of[(rest & -rest).bit_length() - 1]
                    joined.append(g)
                    group |= g
                    rest &= ~g
                if group.bit_count() > r:
                    continue  # every ending holding u and what is taken has a group too large
                members = group
                while members:
                    m = members & -members
                    group_of[m.bit_length() - 1] = group
                    members ^= m
            else:
                group_of[u] = low
            count = groups + 1 - (len(joined) if joined else 0)
            ending = taken | low
            remaining = state ^ ending
            if count <= s:
                transitions += 1
                if transitions > limit:
                    raise _OverBudget(transitions)
                before = best.get(remaining)
                if before is None:
                    before = solve(remaining)
                stage = memo.get(ending)
                if stage is None:
                    group_masks = []
                    rest = ending
                    while rest:
                        g = group_of[(rest & -rest).bit_length() - 1]
                        group_masks.append(g)
                        rest &= ~g
                    stage = stage_cost(ending, group_masks)
                total = before + stage
                if total < acc[0]:
                    acc[0] = total
                    acc[1] = ending
            enabled = 0
            p = preds[u]
            while p:
                v = p & -p
                p ^= v
                if not succs[v.bit_length() - 1] & remaining:
                    enabled |= v
            if allowed | enabled:
                extend(state, ending, allowed | enabled, count, acc)
            if joined:
                # Give the units of the groups u joined their own groups back.
                for g in joined:
                    members = g
                    while members:
                        m = members & -members
                        group_of[m.bit_length() - 1] = g
                        members ^= m

    def solve(state: int) -> float:
        sinks = 0
        rest = state
        while rest:
            m = rest & -rest
            rest ^= m
            if not succs[m.bit_length() - 1] & state:
                sinks |= m
        acc = [inf, 0]
        extend(state, 0, sinks, 0, acc)
        best[state] = acc[0]
        choice[state] = acc[1]
        return acc[0]

    solve(block)
    return best, choice, transitions
