"""MILP-SPLIT (DiviML Section IV-B): cut the graph into modules, solve each module's MILP for every pair
(device its inputs come from, device its outputs go out on), and join the modules with a dynamic program.

dp[t][w] is the best latency of modules 1..t with module t's outputs on device w:
``dp[t][w] = min over v of dp[t - 1][v] + OPT(module t, inputs on v, outputs on w)``. A pair (v, w) whose
solve cannot win, its chain longer than another's by more than the module could gain from it, is not solved
(``_dominated``).

How channel endpoints are fixed: the values a module reads from earlier modules enter as zero-cost units
pinned on the input device v (their transfers to the module's units are costed as usual), and every unit of
the module read by a later module is pinned on the output device w. With one channel (modules bounded by
cut units, see ``modules.py``) every unit of module t + 1 waits for the cut, which waits for all of module t,
so the modules run one after another, the devices all free at each cut: the DP is exact and, when every
module MILP is proven, so is the mapping (``optimal``). With several channels the pinning (all of a
boundary's outputs on one device) and the modules' one-after-another timing are approximations; the joined
mapping is replayed as a whole, so later modules may start early where the data allows. For throughput the
modules' batch pieces may overlap across a boundary in the replay; the DP's sum is then an estimate only.
With several channels, or a memory budget that can bind (a device smaller than the whole graph needs: the
modules then compete for memory, and one module's best mapping depends on what the others left), the modules
are solved one after another instead, each with what the modules before left of every device's memory (and
its share of it, see ``_chained``) and its inputs pinned where they were put; MILP-SPLIT is then not exact. Every module's MILP breaks the
symmetry of the devices its pins leave interchangeable (``symmetry.py``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from opsched.graph.ir import Graph, Node, indices
from opsched.mapping import MappingError
from opsched.mapping.heft import heft
from opsched.mapping.heuristics import HEURISTICS, SEARCHES, heuristic
from opsched.mapping.milp import held, milp, rounding_slack, within_caps
from opsched.mapping.modules import Decomposition, decompose
from opsched.mapping.plan import Job, Mapping, check
from opsched.mapping.platform import Platform
from opsched.mapping.problem import Problem
from opsched.mapping.replay import replay
from opsched.mapping.symmetry import balanced

# Of the time limit, what each search heuristic (SA, EA) may take before the modules' solves: at their default
# 4000 iterations they take 2-6 s on the benchmark graphs, so with a 60 s limit they finish as run alone.
SEARCH_SHARE = 0.1


@dataclass
class SplitResult:
    mapping: Mapping
    optimal: bool
    decomposition: Decomposition
    solves: int
    seconds: float
    symmetry_factor: int = 1   # the largest reduction the symmetry constraints of one module's model gave
    heuristics: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (makespan, seconds)
    taken_from: str = "milp-split"  # or the heuristic whose whole mapping beat the modules' joined one


@dataclass(frozen=True)
class Start:
    """A whole-graph mapping a heuristic found, and when each of its jobs began: where the modules' MILPs start
    from (:func:`_restricted`)."""

    mapping: Mapping
    began: dict[Job, float]


def milp_split(problem: Problem, time_limit: float = 60.0, channels: int | None = None, symmetry: str = "none",
               min_module: int = 4, progress: Callable[[int, int], None] | None = None,
               heuristics: Sequence[str] = HEURISTICS, seed: int = 0) -> SplitResult:
    """MILP-SPLIT within ``time_limit`` seconds. ``heuristics`` map the whole graph too (the searches with at most
    :data:`SEARCH_SHARE` of the limit each, ``seed`` theirs, and only where MILP-SPLIT has no proof): each
    module's MILP starts from the best of their mappings of that module (and HEFT's own of it), and the result
    is never worse than the best of them (``taken_from`` names it where it won; ``optimal`` is then true only if
    the modules' proof still holds within the MILP's rounding).

    >>> from opsched.graph.ir import Graph, Node
    >>> from opsched.mapping.platform import platform_from_dict
    >>> from opsched.mapping.problem import build_problem
    >>> g = Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=4.0), Node("c", args=("a",), latency=4.0),
    ...            Node("d", args=("b", "c"), latency=1.0), Node("e", args=("d",), latency=4.0),
    ...            Node("f", args=("d",), latency=4.0), Node("g", args=("e", "f"), latency=1.0)])
    >>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y"}], "links": {"default": {"bandwidth": 1}}})
    >>> r = milp_split(build_problem(g, p), time_limit=10, min_module=1)
    >>> r.decomposition.modules, r.optimal, replay(build_problem(g, p), r.mapping).makespan
    ([[0], [1, 2, 3], [4, 5, 6]], True, 11.0)
    """
    started = time.perf_counter()
    deadline = started + time_limit
    # cutting the graph may take half the limit (past it, decompose cuts by live values, in milliseconds), so
    # that the modules' solves have the rest
    parts = decompose(problem.graph, channels, min_size=min_module, deadline=started + time_limit / 2)
    joinable = parts.single_channel and not memory_binds(problem)  # the DP over (input, output) devices
    provable = joinable and problem.objective == "latency"
    # The list heuristics (milliseconds) run first. The searches (seconds) run first too where MILP-SPLIT cannot
    # prove its mapping; where it can, only once it has not (a proven optimum no heuristic beats), in the time
    # kept for them.
    searches = [name for name in heuristics if name in SEARCHES]
    search_limit = time_limit * SEARCH_SHARE
    found = _run_heuristics(problem, [name for name in heuristics if name not in SEARCHES or not provable], seed,
                            search_limit)
    starts = [Start(mapping, replay(problem, mapping).start) for mapping, _, _ in found.values()]
    taken_from = "milp-split"
    try:
        if joinable:
            kept = len(searches) * search_limit if provable else 0.0
            mapping, solves, factor, proven = _joined(problem, parts.modules, deadline - kept, symmetry, progress,
                                                      starts)
            proven &= provable
            if provable and not proven and searches:
                found |= _run_heuristics(problem, searches, seed, max(0.0, min(
                    search_limit, (deadline - time.perf_counter()) / len(searches))))
        else:
            mapping, solves, factor = _chained(problem, parts.modules, deadline, symmetry, progress, starts)
            proven = False
    except MappingError:
        # Solved in order, the modules can leave a later one no memory where a mapping of the whole graph fits
        # (random 4-unit DAGs with a tight budget): a heuristic's mapping, else the whole MILP's, is the answer.
        if not found:
            began = time.perf_counter()
            whole = milp(problem, time_limit=max(0.05, deadline - began), symmetry=symmetry)
            found["milp"] = (whole.mapping, replay(problem, whole.mapping).makespan, time.perf_counter() - began)
        taken_from = min(found, key=lambda name: found[name][1])
        mapping, solves, factor, proven = found[taken_from][0], 0, 1, False
    tried = {name: (makespan, seconds) for name, (_, makespan, seconds) in found.items()}
    return _no_worse(problem, SplitResult(mapping, proven, parts, solves, 0.0, factor, tried, taken_from), found,
                     started)


def _run_heuristics(problem: Problem, names: Sequence[str], seed: int, search_limit: float
                    ) -> dict[str, tuple[Mapping, float, float]]:
    """Each heuristic's whole-graph mapping, its makespan and the seconds it took; one that finds no mapping
    (memory) is left out."""
    found = {}
    for name in names:
        began = time.perf_counter()
        try:
            mapping = heuristic(problem, name, seed=seed, time_limit=search_limit)
            check(problem, mapping)
        except MappingError:
            continue
        found[name] = (mapping, replay(problem, mapping).makespan, time.perf_counter() - began)
    return found


def _no_worse(problem: Problem, result: SplitResult, found: dict[str, tuple[Mapping, float, float]],
              started: float) -> SplitResult:
    """``result``, or the best heuristic's mapping where it is faster than the modules' joined one."""
    joined = replay(problem, result.mapping).makespan
    best = min(found, key=lambda name: found[name][1], default=None)
    if best is not None and found[best][1] < joined:
        # a proof of the joined mapping holds for the heuristic's only within the MILP's rounding
        result = replace(result, mapping=found[best][0], taken_from=best,
                         optimal=result.optimal and joined - found[best][1] <= rounding_slack(problem))
    return replace(result, seconds=time.perf_counter() - started)


def _joined(problem: Problem, modules: list[list[int]], deadline: float, symmetry: str,
            progress: Callable[[int, int], None] | None, starts: list[Start]) -> tuple[Mapping, int, int, bool]:
    """Single channel: the DP over the modules' (input device, output device) solves (the module docstring);
    the mapping, the solves made, the largest symmetry factor and whether every solve that counts was proven."""
    k = problem.devices
    position = {u: t for t, units in enumerate(modules) for u in units}
    outputs = [[u for u in units if any(position[v] > t for v in indices(problem.graph.succs[u]))]
               for t, units in enumerate(modules)]
    entries = [sorted({a for u in units for a in indices(problem.graph.preds[u]) if position[a] < t})
               for t, units in enumerate(modules)]
    total_solves = sum((k if entries[t] else 1) * (k if outputs[t] else 1) for t in range(len(modules)))
    solves = done = 0
    factor = 1
    proven = True
    dp: dict[int | None, tuple[float, list[Mapping]]] = {None: (0.0, [])}  # exit device -> (latency, per module)
    for t, units in enumerate(modules):
        ins = list(dp) if entries[t] else [None]
        outs = list(range(k)) if outputs[t] else [None]
        before = {v: dp[v] if v in dp else dp[None] for v in ins}  # the chain the module's inputs come from
        length = {v: before[v][0] for v in ins}
        found: dict[tuple[int | None, int | None], tuple] = {}
        # the shortest chains first: a solve whose chain is longer than one solved already by more than moving
        # the module's inputs and that solve's gap cannot win (_dominated), and is skipped (28 of the 78 solves
        # of the 10-module RandWire chain on the diviml platform: inputs on the Xeon)
        for v in sorted(ins, key=length.get):
            for w in outs:
                done += 1
                if not _dominated(problem, units, entries[t], v, w, found, length):
                    solves += 1
                    left = (deadline - time.perf_counter()) / max(1, total_solves - done + 1)
                    found[(v, w)] = _solve_module(problem, units, entries[t], outputs[t], v, w, left, symmetry,
                                                  starts)
                if progress:
                    progress(done, total_solves)
        nxt: dict[int | None, tuple[float, list[Mapping]]] = {}
        for v in ins:  # in the devices' order, so that ties go where they went before the skipping
            for w in outs:
                solved = found.get((v, w))
                if solved is None:
                    continue
                latency, mapping, optimal, reduction, _ = solved
                proven &= optimal
                factor = max(factor, reduction)
                if w not in nxt or length[v] + latency < nxt[w][0]:
                    nxt[w] = (length[v] + latency, before[v][1] + [mapping])
        if not nxt:
            raise MappingError(f"module {t} of the graph fits on no device with its inputs and outputs pinned")
        dp = nxt
    _, chain = min(dp.values(), key=lambda item: item[0])
    order: list[list[Job]] = [[] for _ in range(k)]
    for mapping in chain:
        for d in range(k):
            order[d].extend(mapping.order[d])
    return Mapping(order), solves, factor, proven


def _chained(problem: Problem, modules: list[list[int]], deadline: float, symmetry: str,
             progress: Callable[[int, int], None] | None, starts: list[Start]) -> tuple[Mapping, int, int]:
    """Several channels, or memory that binds: each module in turn, the values it reads pinned where the
    modules before put them, its outputs free, each device's memory what the modules before left of it; the
    modules' jobs follow one another on each device. (With memory that binds, the modules compete for it, so
    the DP's modules are not independent: solving them in order with what is left is what stays feasible.)"""
    k = problem.devices
    device_of: dict[int, int] = {}
    order: list[list[Job]] = [[] for _ in range(k)]
    position = {u: t for t, units in enumerate(modules) for u in units}
    left_memory = [d.memory for d in problem.platform.devices]
    # A module may hold its share, in proportion to what it needs at the least (every unit whole on one
    # device), of the memory the modules from it on can spare; else the first modules (their batch split,
    # their weights copied onto several devices) leave too little for the rest.
    need = [sum(problem.memory(u) for u in units) for units in modules]
    rest = [sum(need[t:]) for t in range(len(modules))]
    classes = problem.speed_classes()
    busy = [0.0] * k  # each device's time in the modules mapped so far
    factor = 1
    for t, units in enumerate(modules):
        entries = sorted({a for u in units for a in indices(problem.graph.preds[u]) if position[a] < t})
        platform = replace(problem.platform, devices=[replace(d, memory=m) for d, m in
                                                      zip(problem.platform.devices, left_memory, strict=True)])
        sub, back = module_problem(problem, units, entries, platform=platform)
        pinned = {i: device_of[entries[i]] for i, u in enumerate(back) if u is None}
        share = need[t] / rest[t] if rest[t] > 0 else math.inf
        # Each class of equally fast devices first gives the module its share of what it has left: a module
        # free to fill the fast devices (splitting its units' batch over them copies their weights, for a
        # gain of a few percent) leaves the last modules only the slow ones (GPT-3's head then took 7.8 ms
        # against 3.2). Where the module fits no such shares, each is raised to what HEFT's mapping with every
        # unit whole holds there (the module may not split beyond it); failing that, its share of all the memory.
        attempts = [[_cap(group, left_memory, share) for group in classes]]
        heft_of = _heft_of(sub, pinned)
        whole = heft_of(False)
        if whole is not None:  # a class's share smaller than a unit: raised to what the units hold whole there
            attempts.append([(group, max(cap, held(sub, whole, group))) for group, cap in attempts[0]])
        if len(classes) > 1:
            attempts.append([_cap(list(range(k)), left_memory, share)])
        candidates = [heft_of(True), whole] + [_restricted(sub, back, start, pinned) for start in starts]
        for attempt, caps in enumerate(attempts):
            last = attempt == len(attempts) - 1
            hint = _best_hint(sub, candidates, caps)
            if hint is None and not last:
                continue
            left = (deadline - time.perf_counter()) / (len(modules) - t)
            if hint is not None and left <= 0:
                chosen = hint  # out of time: the modules left take HEFT's mapping, so that the limit holds
                break
            try:
                result = milp(sub, time_limit=max(0.05, left), hint=hint, pinned=pinned, symmetry=symmetry,
                              memory_caps=caps)
            except MappingError as error:
                if not last:
                    continue
                raise MappingError(f"module {t} of {len(modules)} (from unit "
                                   f"{problem.graph.nodes[units[0]].name!r}): {error}") from None
            chosen = result.mapping
            factor = max(factor, result.symmetry_factor)
            break
        # The module's solve sees none of the modules' jobs before it: among devices it cannot tell apart, its
        # busiest contents go to the least busy (else every module's largest share lands on one device)
        chosen = balanced(sub, chosen, busy, fixed=pinned.values())
        for d in range(k):
            for j in chosen.order[d]:
                if back[j.unit] is not None:
                    order[d].append(Job(back[j.unit], d, j.pieces))
                    device_of[back[j.unit]] = d
                    left_memory[d] -= problem.memory(back[j.unit], len(j.pieces))
                    busy[d] += problem.time(back[j.unit], d, len(j.pieces))
        if progress:
            progress(t + 1, len(modules))
    return Mapping(order), len(modules), factor


def _cap(group: list[int], left_memory: list[float], share: float) -> tuple[list[int], float]:
    """``share`` of the memory the devices of ``group`` have left, as a cap on what a module holds there."""
    spare = sum(left_memory[d] for d in group)
    return group, spare * share if math.isfinite(spare) and math.isfinite(share) else math.inf


def _dominated(problem: Problem, units: list[int], entries: list[int], v: int | None, w: int | None,
               found: dict[tuple[int | None, int | None], tuple], length: dict[int | None, float]) -> bool:
    """Whether OPT(module, inputs on v, outputs on w) cannot win the DP: for some v2 solved for w,
    ``length[v2] + shift + gap < length[v]`` (``length``: the chains' latencies up to the module). ``shift`` is
    how much later the module's inputs arrive anywhere when they are on v2 rather than on v, so the module's
    optimum with inputs on v, delayed by it, is a schedule with inputs on v2: OPT(v2, w) <= OPT(v, w) + shift;
    and the v2 solve's latency is at most its gap (latency less the bound it proved) above OPT(v2, w). The
    chain through v is then longer than the one through v2."""
    if v is None:
        return False
    inside = set(units)
    for (v2, w2), solved in found.items():
        if w2 != w or v2 is None or solved is None:
            continue
        shift = max((problem.comm(a, b, v2, d, 1) - problem.comm(a, b, v, d, 1)
                     for a in entries for b in indices(problem.graph.succs[a]) if b in inside
                     for d in range(problem.devices)), default=0.0)
        if length[v2] + shift + solved[4] < length[v]:
            return True
    return False


def _solve_module(problem: Problem, units: list[int], entries: list[int], outputs: list[int], v: int | None,
                  w: int | None, time_limit: float, symmetry: str, starts: list[Start]):
    """OPT(module, inputs on v, outputs on w): (latency, the module's jobs in global units, proven, symmetry
    factor, gap: the latency less the bound proved on it). The MILP starts from the best of HEFT's mapping of
    the module and the ``starts`` restricted to it."""
    sub, back = module_problem(problem, units, entries)
    pinned = {i: v for i, u in enumerate(back) if u is None and v is not None}
    if w is not None:
        pinned.update({i: w for i, u in enumerate(back) if u in set(outputs)})
    for i, d in pinned.items():
        if math.isinf(sub.time(i, d)):
            return None
    heft_of = _heft_of(sub, pinned)
    hint = _best_hint(sub, [heft_of(True), heft_of(False)] + [_restricted(sub, back, s, pinned) for s in starts])
    if hint is not None and time_limit <= 0:  # out of time: HEFT's mapping, so that the limit holds
        latency = replay(sub, hint).makespan
        return latency, _global(hint, back), False, 1, latency
    try:
        result = milp(sub, time_limit=max(0.05, time_limit), hint=hint, symmetry=symmetry, pinned=pinned)
    except MappingError:  # an infeasible pinning is one DP option fewer, not a failure
        return None
    latency = replay(sub, result.mapping).makespan
    return latency, _global(result.mapping, back), result.optimal, result.symmetry_factor, latency - result.bound


def _global(mapping: Mapping, back: list[int | None]) -> Mapping:
    """A module's mapping in the whole graph's units, its entries left out."""
    return Mapping([[Job(back[j.unit], j.device, j.pieces) for j in jobs if back[j.unit] is not None]
                    for jobs in mapping.order])


def _heft_of(sub: Problem, pinned: dict[int, int]) -> Callable[[bool], Mapping | None]:
    """HEFT's mapping of a module with its pins, the batch split or every unit whole (None where HEFT finds
    none within the devices' memory), each made once and only when asked for."""

    @functools.cache
    def mapping(split: bool) -> Mapping | None:
        try:
            return _pinned(heft(sub, split), pinned, sub.devices)
        except MappingError:
            return None

    return mapping


def _best_hint(sub: Problem, candidates: list[Mapping | None],
               memory_caps: list[tuple[list[int], float]] = ()) -> Mapping | None:
    """Where to start a module's MILP: the fastest of ``candidates`` that fits the devices and ``memory_caps``
    (devices, bytes), the first among equals; None when none does (the MILP then starts from nothing)."""
    best, best_makespan = None, math.inf
    for mapping in candidates:
        if mapping is None or not within_caps(sub, mapping, memory_caps):
            continue
        try:
            check(sub, mapping)
            makespan = replay(sub, mapping).makespan
        except MappingError:
            continue
        if makespan < best_makespan:
            best, best_makespan = mapping, makespan
    return best


def _restricted(sub: Problem, back: list[int | None], start: Start, pinned: dict[int, int]) -> Mapping:
    """A whole-graph mapping restricted to a module's sub-problem: the module's units where ``start`` put them,
    its entries and outputs moved where ``pinned`` says, each device's jobs in the order they began in
    ``start`` (an order every dependency keeps: a job begins no earlier than the jobs it reads; entries
    first)."""
    local = {u: i for i, u in enumerate(back) if u is not None}
    jobs: list[tuple[float, int, Job]] = [(-math.inf, i, Job(i, pinned.get(i, 0), tuple(range(sub.pieces))))
                                          for i, u in enumerate(back) if u is None]
    for d, row in enumerate(start.mapping.order):
        for job in row:
            if job.unit in local:
                i = local[job.unit]
                jobs.append((start.began[job], i, Job(i, pinned.get(i, d), job.pieces)))
    order: list[list[Job]] = [[] for _ in range(sub.devices)]
    for _, _, job in sorted(jobs, key=lambda item: item[:2]):
        order[job.device].append(job)
    return Mapping(order)


def _pinned(mapping: Mapping, pinned: dict[int, int], devices: int) -> Mapping:
    """``mapping`` with the pinned units moved to their devices (each device keeps its jobs' order)."""
    jobs = sorted(((i, j) for d in range(devices) for i, j in enumerate(mapping.order[d])),
                  key=lambda item: (item[0], item[1].unit))
    order: list[list[Job]] = [[] for _ in range(devices)]
    for _, job in sorted(jobs, key=lambda item: item[1].unit):
        d = pinned.get(job.unit, job.device)
        order[d].append(Job(job.unit, d, job.pieces))
    return Mapping(order)


def module_problem(problem: Problem, units: list[int], entries: list[int], platform: Platform | None = None
                   ) -> tuple[Problem, list[int | None]]:
    """The sub-problem of one module: a zero-cost unit for each value it reads from earlier modules, then
    its units; and, per sub-problem unit, the global unit (None for the entries). Its devices' memory is
    ``platform``'s, by default the problem's (DP modules never bind it: see :func:`milp_split`)."""
    graph = problem.graph
    inside = set(units)
    nodes: list[Node] = []
    back: list[int | None] = []
    for a in entries:
        nodes.append(Node(f"in:{graph.nodes[a].name}", latency=0.0))
        back.append(None)
    for u in units:
        node = graph.nodes[u]
        args = tuple((a if graph.index.get(a) in inside else f"in:{a}") for a in node.args
                     if graph.index.get(a) in inside or graph.index.get(a) in set(entries))
        nodes.append(replace(node, args=args))
        back.append(u)
    sub_graph = Graph(nodes, name=f"{graph.name}/module")
    local = {sub_graph.nodes[i].name: i for i in range(len(sub_graph))}
    index_of = [local[n.name] for n in nodes]  # Graph keeps this order (it is topological)
    assert index_of == list(range(len(nodes)))
    zero = [[0.0] * problem.pieces for _ in range(problem.devices)]
    times = [zero if u is None else problem.times[u] for u in back]
    position = {u: i for i, u in enumerate(back) if u is not None}
    entry_at = {a: i for i, a in enumerate(entries)}
    edge_bytes = {}
    for (a, b), nbytes in problem.edge_bytes.items():
        if b in position and (a in position or a in entry_at):
            edge_bytes[(position[a] if a in position else entry_at[a], position[b])] = nbytes
    activation = [0.0 if u is None else problem.activation_bytes[u] for u in back]
    weights = [0.0 if u is None else problem.weight_bytes[u] for u in back]
    return Problem(sub_graph, platform or problem.platform, times, edge_bytes, activation, weights, problem.objective, problem.batch,
                   problem.pieces, problem.time_unit, problem.simulated, handoff=problem.handoff,
                   co_running=problem.co_running), back


def memory_binds(problem: Problem) -> bool:
    """Whether some device's memory is too small for the whole graph (else no budget can bind)."""
    need = sum(problem.memory(u) for u in range(problem.n))
    return any(d.memory < need for d in problem.platform.devices)
