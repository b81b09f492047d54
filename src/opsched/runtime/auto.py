"""``--kernels auto`` (the default of ``opsched optimize`` and ``opsched multi``): which units run on ONNX Runtime,
chosen block by block from what each kernel measured, the units then scheduled on that choice.

ONNX Runtime's lead over eager PyTorch on the CPU comes from fusing across operators within one session: unit
by unit (a session per unit), MNASNet at 96 px measured about the same either way, whole it ran 2.6x faster.
So the choice is made over IOS's blocks (:func:`opsched.graph.blocks.split_blocks`: consecutive units ending
where every path meets), each costed as one ONNX Runtime session. On the CPU, with ONNX Runtime installed:

1. the units are profiled in place on the default kernels (eager ATen operators, convolutions reordered once
   where the graph allows: :mod:`opsched.runtime.choice`), and on ONNX Runtime, each block compiled as one
   session (a region, :mod:`opsched.runtime.regions`), and the whole graph as one; a block holding a unit ONNX
   cannot take, or whose region it cannot take, is not offered it, and ``not_offered`` says why;
2. a block on the default kernels costs its units' sum; a block on ONNX Runtime costs its session, less the
   cost of starting one where the block before it is on ONNX Runtime too, since a plan run back to back makes
   one session of both (that cost, fusions lost across the boundary included, is the blocks' sessions against
   the whole graph as one, per boundary); a value read across kernels costs a layout copy (reordered
   convolutions leave values ``channels_last``, a session reads NCHW), priced from this machine's copy speed
   (a graph that does not reorder crosses for free);
3. the cheapest labelling of the blocks is found exactly (:func:`opsched.schedulers.kernels.cheapest_kernels`,
   one minimum cut: the sessions' start is a cost on the edge between neighbouring blocks and on the ends);
4. a labelling that mixes the kernels is run, in place and interleaved with each kernel alone, before it is
   kept: where it ran slower than its costs said, the difference per switch between kernels is added to every
   switch and the blocks labelled again (at most ``MIX_ROUNDS`` mixes run); a mix is kept only where it ran
   faster than both kernels alone, else the faster of the two. A labelling of one kernel, where ONNX Runtime
   could take every block, is run so too, the whole graph on each kernel, and the faster kept: the default
   kernels' cost is their units' profiles summed, which leaves out what running them one after another adds;
5. the graph is profiled in place once more on a kept mix (every unit on one kernel was profiled so already),
   which the schedulers search on; plans run with compiled regions make each run of consecutive ONNX Runtime
   units one session, which the cost model prices and the evaluation measures (every block on ONNX Runtime:
   the sequential plan with regions is the model as one session).

Where no block is faster on ONNX Runtime, the choice and every figure are the default kernels'. On a GPU,
with simulated costs, and where ONNX Runtime is not installed (said once), ``auto`` is the default kernels; where
choosing fails (a session that compiles and fails to run), too, and ``not_offered`` says why. The profiles and
regions are cached (:mod:`opsched.cost.cache`) under their kernels (a mix under its own choice); the whole
graph's thread count, the mixes run beside each kernel alone and the copy speed are timed again on every search.

Inductor is offered for the whole graph only, as one region (:func:`inductor_offered`): it compiles for seconds
to a minute per graph, which a search over blocks cannot pay block by block. The pipeline then runs that
region beside the plans, verified and timed with them, where this choice says it may win.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import torch

from opsched.errors import first_line
from opsched.graph.blocks import split_blocks
from opsched.runtime.kernels import ChosenKernels, kernels_for
from opsched.runtime.profile import measured_cost
from opsched.schedulers.kernels import cheapest_kernels, labelling_cost

COPY_REPEATS = 15
# ONNX Runtime's whole graph over the default kernels' units, at or above which the whole graph is compiled by
# Inductor too (see inductor_offered)
INDUCTOR_FROM = 0.85
MIX_ROUNDS = 3  # mixes of kernels run before one is kept (see auto_cost)
MIX_TOLERANCE = 1.1  # a mix that runs within this factor of its costs is kept as costed
_said_missing = False


def onnxruntime_missing() -> bool:
    """Whether ONNX Runtime cannot be imported here; the first time, say so on stderr."""
    global _said_missing
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        if not _said_missing:
            _said_missing = True
            sys.stderr.write("opsched: ONNX Runtime is not installed, so --kernels auto chooses among eager "
                             "kernels only (pip install onnxruntime)\n")
        return True
    return False


def auto_cost(graph: Any, inputs: Sequence[Any], values: dict[str, Any], device: str = "cpu", *,
              cores: int | None = None, cache: Any = None,
              progress: Callable[[str, int], Any] | None = None) -> tuple[Any, ChosenKernels]:
    """The measured cost model of ``graph`` on the kernels chosen block by block (see the module docstring),
    and those kernels; ``values`` is every unit's output on ``inputs`` (flat). The cost model's
    ``kernel_choice`` describes the choice: units per kernel, blocks on ONNX Runtime, what each kernel measured
    block after block, the units ONNX Runtime could not take and why, and the seconds choosing took beyond the
    default kernels' profile."""
    default = kernels_for(graph, "eager", device, values.__getitem__)
    options = {"progress": progress, "values": values, "cores": cores, "cache": cache}
    first = measured_cost(graph, inputs, default, device, **options)
    if device != "cpu" or onnxruntime_missing():
        return first, default
    started = time.perf_counter()
    try:
        return _with_onnxruntime(graph, inputs, values, device, first, default, options, started)
    except Exception as e:  # noqa: BLE001 - a session that compiles but fails to run: never a failed optimize
        first.kernel_choice = {"units": _counts(default.choice), "not_offered": {"onnxruntime": {
            "(every unit)": f"choosing failed: {first_line(e)}"}}, "seconds": round(time.perf_counter() - started, 3)}
        return first, default


def _with_onnxruntime(graph: Any, inputs: Sequence[Any], values: dict[str, Any], device: str, first: Any,
                      default: ChosenKernels, options: dict[str, Any], started: float) -> tuple[Any, ChosenKernels]:
    """:func:`auto_cost` once the default kernels are profiled (``first``): ONNX Runtime's blocks measured,
    labelled, a mix run before it is kept, and the cost model of the choice."""
    onnx = kernels_for(graph, "onnxruntime", device, values.__getitem__, keep_exports=options["cache"] is not False)
    second = measured_cost(graph, inputs, onnx, device, **options)
    blocks = [list(b.units) for b in split_blocks(graph)]
    failures = onnx.onnxruntime.region_failures
    sessions = second.region_latencies(blocks)  # each block one session, measured in place
    failed_blocks = {name for name, _ in failures}  # (a region is named after its last unit)
    failed = len(failures)
    whole = second.region_latencies([list(range(len(graph)))]) if len(blocks) > 1 else sessions
    if sessions is None or len(failures) > failed:  # timed as they fell back: no session's cost to learn from
        whole = None
    why_not = dict(onnx.onnxruntime.why_eager)
    refused = {u for u, n in enumerate(graph.nodes) if n.name in why_not}
    refused |= {units[-1] for units in blocks if len(units) > 1 and graph.nodes[units[-1]].name in failed_blocks}
    # what starting a session costs, fusions across its boundary lost included: the blocks' sessions against
    # the graph as one, per boundary (MNASNet at 96 px: 28 blocks summed 4.19 ms, the graph as one 2.3 ms)
    start_ms = max(0.0, (sum(sessions) - whole[0]) / (len(blocks) - 1)) if sessions and whole and len(blocks) > 1 \
        else 0.0
    block_of = {u: k for k, units in enumerate(blocks) for u in units}
    crossing = crossing_ms(graph, values, default.packs)
    on_default = {k: sum(first.best[u] for u in units) for k, units in enumerate(blocks)}
    on_onnx = {k: math.inf if sessions is None or refused & set(units) else sessions[k]
               for k, units in enumerate(blocks)}

    def chain_and_costs(switch_ms: float) -> tuple[nx.DiGraph, dict[int, float]]:
        return block_chain(graph, blocks, crossing, start_ms, switch_ms), _less_starts(on_onnx, start_ms)

    def choice_of(labels: dict[int, int]) -> dict[str, str]:
        return {n.name: "onnxruntime" if labels[block_of[u]] else default.choice[n.name]
                for u, n in enumerate(graph.nodes)}

    # A mix of kernels is run before it is kept: beside each kernel alone, in place, interleaved. Where it runs
    # slower than its costs said, what a switch between kernels cost beyond them (one engine's threads still
    # spinning while the other's wake, caches) is added to every switch, and the blocks labelled again (ResNet-18
    # at 96 px: 8 of 11 blocks on ONNX Runtime ran slower than either kernel alone).
    switch_ms, rounds = 0.0, {}  # labels run: (the mix's, the default kernels', ONNX Runtime's milliseconds)
    chain, costs = chain_and_costs(switch_ms)
    labels = cheapest_kernels(chain, on_default, costs)
    every_onnx = onnx.chosen_as(choice_of(dict.fromkeys(labels, 1)))  # every block on ONNX Runtime, run as such
    for _ in range(MIX_ROUNDS):
        key = tuple(labels.values())
        if key in rounds:
            break
        if len(set(key)) < 2:
            if not rounds and not refused and sessions is not None:
                # One kernel for every block, on costs that sum the default kernels' units but measure ONNX
                # Runtime's whole graph as it runs: each kernel's whole graph is run, as a mix is, and the
                # faster kept (BERT, 4 layers: the default kernels' units summed 7.70 ms and the whole graph
                # ran 8.7 as a plan, where ONNX Runtime's whole graph measured 8.46 in place and 7.9 as a peer).
                default_ms, onnx_ms = sequential_ms(graph, [default, every_onnx], first)
                rounds[key] = (onnx_ms if key[0] else default_ms, default_ms, onnx_ms)
            break
        alone = [default] + ([] if refused else [every_onnx])
        times = sequential_ms(graph, [onnx.chosen_as(choice_of(labels)), *alone], first)
        rounds[key] = (times[0], times[1], times[2] if len(times) > 2 else math.inf)
        predicted = labelling_cost(chain, labels, on_default, costs)
        if times[0] <= MIX_TOLERANCE * predicted:
            break
        switches = sum(labels[k - 1] != labels[k] for k in range(1, len(blocks)))
        switch_ms += max(0.0, times[0] - predicted) / max(1, switches)
        chain, costs = chain_and_costs(switch_ms)
        labels = cheapest_kernels(chain, on_default, costs)
    labels = dict(zip(labels, _kept(tuple(labels.values()), rounds)))
    choice = choice_of(labels)
    mixed = onnx.chosen_as(choice)
    if mixed.asked == "eager":
        cost, kernels = first, default
    elif all(kernel == "onnxruntime" for kernel in choice.values()):  # profiled so already
        cost, kernels = second, onnx
    else:
        cost, kernels = measured_cost(graph, inputs, mixed, device, **options), mixed
    cost.kernel_choice = {
        "units": _counts(kernels.choice), "blocks_on_onnxruntime": f"{sum(labels.values())} of {len(blocks)}",
        "block_after_block_ms": {"default": round(sum(on_default.values()), 4),
                                 "onnxruntime": round(sum(sessions), 4) if sessions is not None else None},
        "whole_graph_onnxruntime_ms": round(whole[0], 4) if whole else None,
        "session_start_ms": round(start_ms, 4), "switch_ms": round(switch_ms, 4),
        "mixes_run_ms": [{"blocks_on_onnxruntime": sum(k), "mix": round(a, 4), "default": round(b, 4),
                          "onnxruntime": round(c, 4) if c < math.inf else None} for k, (a, b, c) in rounds.items()],
        "not_offered": {"onnxruntime": {**why_not, **{f"block ending at {name}": why for name, why in failures
                                                      if name in failed_blocks}}} if refused else {},
        "seconds": round(time.perf_counter() - started, 3)}  # beyond the default kernels' profile
    if second.region_error:
        cost.kernel_choice["not_offered"]["onnxruntime blocks"] = second.region_error
    return cost, kernels


def inductor_offered(cost: Any) -> tuple[bool, str]:
    """Whether the whole graph should be compiled by Inductor as one region and run beside the plans, and why,
    from what ``auto`` measured (``cost.kernel_choice``; a cost model without one was not chosen by ``auto`` on
    the CPU, and is not offered Inductor).

    Inductor generates its own code for what lies between matrix products and convolutions, which it hands to
    the same oneDNN and MKL kernels as eager PyTorch; ONNX Runtime fuses that into its own kernels, which it
    holds for convolutional networks. So where ONNX Runtime's whole graph runs well below the default kernels'
    units, it is the one to beat and Inductor did not: in a sweep of 43 models nobody here tuned for
    (docs/sweep_auto_untuned.md), torch.compile beat the plan on the 7 where the whole graph on ONNX Runtime
    ran at 0.88-1.80x the default kernels' units (attention, 3-D convolutions), and on none of the 35 below
    0.85x. Compiling took 6-21 s a model here (DeiT-tiny 17.7 s with Inductor's cache cold, 7.2 s warm), so it
    is paid only at ``INDUCTOR_FROM`` and above, where ONNX Runtime cannot run the whole graph, and where it is not
    installed.

    >>> class Costed: kernel_choice = {"block_after_block_ms": {"default": 10.0}, "whole_graph_onnxruntime_ms": 5.0}
    >>> inductor_offered(Costed())
    (False, 'ONNX Runtime ran the whole graph at 0.500x the default kernels, below 0.85x: it is the one to beat')
    """
    if not hasattr(cost, "kernel_choice"):
        return False, "not measured on the CPU with --kernels auto"
    choice = cost.kernel_choice
    if choice is None:
        if onnxruntime_missing():
            return True, "ONNX Runtime is not installed"
        return False, "not measured on the CPU with --kernels auto"
    if "block_after_block_ms" not in choice:
        return True, "choosing ONNX Runtime's blocks failed"
    whole = choice.get("whole_graph_onnxruntime_ms")
    default = choice["block_after_block_ms"].get("default")
    if whole is None or not default:
        return True, "ONNX Runtime could not run the whole graph"
    ratio = whole / default
    if ratio < INDUCTOR_FROM:
        # three digits, rounded down: 0.846 is below 0.85, which two would print as "0.85x, below 0.85x"
        return False, (f"ONNX Runtime ran the whole graph at {math.floor(ratio * 1000) / 1000:.3f}x the default kernels, below "
                       f"{INDUCTOR_FROM:.2f}x: it is the one to beat")
    return True, f"ONNX Runtime ran the whole graph at {ratio:.3f}x the default kernels"


def _counts(choice: dict[str, str]) -> dict[str, int]:
    return dict(Counter(choice.values()))


def _kept(labels: tuple[int, ...], rounds: dict[tuple[int, ...], tuple[float, float, float]]) -> tuple[int, ...]:
    """The labels to keep: with nothing run (the cut chose one kernel where ONNX Runtime could not take every
    block), ``labels``; else a mix only where it ran faster than each kernel alone in its own round (the fastest
    such), and otherwise the kernel that ran faster alone in the last round (for a labelling of one kernel, the
    only round)."""
    if not rounds:
        return labels
    good = {key: times[0] for key, times in rounds.items() if times[0] < min(times[1:])}
    if good:
        return min(good, key=good.get)
    _, default_ms, onnx_ms = list(rounds.values())[-1]
    return tuple([1 if onnx_ms < default_ms else 0] * len(labels))


def block_chain(graph: Any, blocks: Sequence[Sequence[int]], crossing: dict[int, float],
                start_ms: float, switch_ms: float = 0.0) -> nx.DiGraph:
    """The blocks as :func:`~opsched.schedulers.kernels.cheapest_kernels` labels them: an edge where a value
    crosses from one block to another, costing its ``crossing`` (the value's layout copy), and between
    neighbouring blocks half of ``start_ms``, what starting a session costs. Block b starts a session where it
    is on ONNX Runtime and the block before it is not: with s = 1 on ONNX Runtime, ``s(b) - s(a) s(b)``, which
    is ``|s(a) - s(b)| / 2`` (a cost of the two differing, which a cut prices) plus ``(s(b) - s(a)) / 2``; summed
    over the chain those halves leave half a start on each end block (:func:`_less_starts`). ``switch_ms``:
    what a switch between kernels costs beyond that, measured (see :func:`auto_cost`), on every neighbours'
    edge."""
    block_of = {u: k for k, units in enumerate(blocks) for u in units}
    chain = nx.DiGraph()
    chain.add_nodes_from(range(len(blocks)))

    def add(a: int, b: int, ms: float) -> None:
        chain.add_edge(a, b, crossing=chain.get_edge_data(a, b, {}).get("crossing", 0.0) + ms)

    for u, v in graph.edges:
        if block_of[u] != block_of[v] and crossing[u] > 0:
            add(block_of[u], block_of[v], crossing[u])
    for k in range(1, len(blocks)):
        add(k - 1, k, start_ms / 2 + switch_ms)
    return chain


def _less_starts(on_onnx: dict[int, float], start_ms: float) -> dict[int, float]:
    """Each block's session, less the session start its neighbours' edges price (:func:`block_chain`): every
    block measured one start; a middle block keeps none of it on itself, an end block half, a lone block all."""
    last = len(on_onnx) - 1
    return {k: ms - start_ms + start_ms * (0.5 * (k in (0, last)) + 0.5 * (last == 0)) for k, ms in on_onnx.items()}


def sequential_ms(graph: Any, kernel_sets: Sequence[ChosenKernels], cost: Any) -> list[float]:
    """Median milliseconds of ``graph`` run unit after unit on each of ``kernel_sets``, consecutive units on one
    compiled kernel as one region (a session), in place, interleaved, on the cores and inputs of ``cost`` (a
    measured cost model of the graph); the rounds stop once the fastest is clear, as for the whole graph's
    thread count (:meth:`~opsched.runtime.profile.InPlaceRuns.whole`): what is asked is which runs fastest."""
    from opsched.runtime import make_executor
    from opsched.runtime.program import staged_program
    from opsched.runtime.regions import compiled_regions
    from opsched.schedule import from_stages

    plan = from_stages(graph, cost, "sequential", [("concurrent", [list(range(len(graph)))])])
    executors = []
    for kernels in kernel_sets:
        fused, _ = compiled_regions(graph, plan, kernels=dict(kernels.choice))
        executors.append(make_executor(staged_program(fused, [("concurrent", [[k]]) for k in range(len(fused))],
                                                      cost.cores), kernels, "cpu"))
    return cost.runs.medians(executors, until_apart=True)


def crossing_ms(graph: Any, values: dict[str, Any], packs: bool) -> dict[int, float]:
    """Milliseconds each unit's value costs each reader on the other kernel: with reordered convolutions
    (``packs``), a copy of a 4-D value from one memory layout to the other, at the speed a copy of the graph's
    largest such value runs here; else nothing."""
    tensors = {u: values[n.name] for u, n in enumerate(graph.nodes)}
    four_d = {u: v for u, v in tensors.items() if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()}
    if not packs or not four_d:
        return {u: 0.0 for u in tensors}
    largest = max(four_d.values(), key=lambda v: v.numel() * v.element_size())
    ms_per_byte = _copy_ms(largest) / (largest.numel() * largest.element_size())
    return {u: four_d[u].numel() * four_d[u].element_size() * ms_per_byte if u in four_d else 0.0 for u in tensors}


def _copy_ms(value: torch.Tensor) -> float:
    """Median milliseconds of ``value`` copied into ``channels_last``."""
    samples = []
    with torch.inference_mode():
        value.contiguous(memory_format=torch.channels_last)  # warm-up
        for _ in range(COPY_REPEATS):
            began = time.perf_counter()
            value.contiguous(memory_format=torch.channels_last)
            samples.append((time.perf_counter() - began) * 1000.0)
    return statistics.median(samples)
