"""The rewrites of a model batch, each made only where the cost model says it pays.

:func:`fuse_graph` combines the models into one Graph, computes shared work once (always: it only removes
work) and batches units across models (``same_input``, ``same_shape``, see :mod:`opsched.multi.stack`).
A batched unit is kept only when the cost model predicts it, with the units that select its members'
outputs, faster than its members one after another; the decision for every group is recorded. With compiled
kernels a graph's units run as regions that a compiler sees whole (:mod:`opsched.runtime.regions`), which a
unit's own cost does not show: the batched graph is then kept only when its regions are predicted faster than
the graph without batching's (``whole``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.cost.devices import is_simulated
from opsched.graph.ir import Graph
from opsched.multi.combine import ModelBatch, MultiError, combine
from opsched.multi.shared import share_work
from opsched.multi.stack import FUSIONS, batch_units, batchable_groups, batched_name, fusion_kind

REWRITES = ("shared", *FUSIONS)


@dataclass
class Fusion:
    """A model batch's graph after the rewrites that pay. ``combined`` is the graph before them; ``fused``
    counts the units each rewrite removed or made (``shared``: units computed once instead of again;
    ``same_input`` / ``same_shape``: batched units made); ``decisions`` holds, for every group of units that
    could be batched, its name, kind, member count, the predicted milliseconds batched and apart (``None``
    when no cost model was asked), and whether it was made."""

    batch: ModelBatch
    graph: Graph
    combined: Graph
    fused: dict[str, int] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rewrites: tuple[str, ...] = REWRITES
    whole: dict[str, float] | None = None  # with compiled kernels: each graph's regions, batched and apart, in ms

    @property
    def batched(self) -> list[str]:
        """The names of the batched units made: with ``rewrites``, what a plan records to rebuild this graph
        (see :func:`fuse_graph`'s ``made``)."""
        return [d["name"] for d in self.decisions if d["made"]]


def fuse_graph(batch: ModelBatch, rewrites: Sequence[str] = REWRITES,
               latencies: Callable[[Graph], list[float]] | None = None,
               made: Collection[str] | None = None,
               whole: Callable[[Graph], float | None] | None = None) -> Fusion:
    """The batch's graph with the ``rewrites`` named made; ``latencies(graph)`` (the predicted milliseconds
    of each unit, from a cost model) decides which batched units pay. Without it, every batchable group is
    batched. ``whole(graph)`` (the predicted milliseconds of the whole graph run in order with compiled
    regions, or None where it cannot say) then decides between the batched graph and the graph with no batched
    unit. ``made`` (the names of the batched units an earlier fusion made, as a plan records them) makes
    exactly those instead, with no cost model asked: the graph that plan was made for. A name this batch has
    no group for is a :class:`MultiError`."""
    unknown = set(rewrites) - set(REWRITES)
    if unknown:
        raise ValueError(f"unknown rewrite {min(unknown)!r}; choose from {', '.join(REWRITES)}")
    combined = combine(batch)
    graph, shared = share_work(combined) if "shared" in rewrites else (combined, 0)
    result = Fusion(batch, graph, combined, {"shared": shared, **{kind: 0 for kind in FUSIONS}},
                    rewrites=tuple(rewrites))
    groups = [g for g in batchable_groups(graph) if fusion_kind(graph, g) in rewrites]
    if made is not None:
        names = {batched_name(graph, g) for g in groups}
        missing = [name for name in made if name not in names]
        if missing:
            raise MultiError(f"batched unit {missing[0]!r} cannot be made in this batch (it has "
                             f"{len(names)} batchable group(s))")
        groups = [g for g in groups if batched_name(graph, g) in set(made)]
    if not groups:
        return result
    from opsched.graph.interpret import all_values

    with torch.no_grad():
        values = all_values(graph, pytree.tree_leaves(tuple(batch.inputs)))
    batched = batch_units(graph, groups, values)
    decisions = [{"name": batched_name(graph, g), "fusion": fusion_kind(graph, g), "members": len(g), "batched_ms": None, "apart_ms": None,
                  "made": True} for g in groups]
    if latencies is not None and made is None:
        apart, together = latencies(graph), latencies(batched)
        for d, members in zip(decisions, groups):
            selects = [graph.nodes[i].name for i in members if graph.nodes[i].name in batched.index]
            d["apart_ms"] = sum(apart[i] for i in members)
            d["batched_ms"] = together[batched.index[d["name"]]] + sum(together[batched.index[s]] for s in selects)
            d["made"] = d["batched_ms"] < d["apart_ms"]
        paying = [g for g, d in zip(groups, decisions) if d["made"]]
        if len(paying) != len(groups):
            batched = batch_units(graph, paying, values) if paying else graph
        if whole is not None and paying:
            together, apart = whole(batched), whole(graph)
            if together is not None and apart is not None:
                result.whole = {"batched_ms": together, "apart_ms": apart}
                if apart <= together:  # the models' own regions pay more than the batched units
                    batched = graph
                    for d in decisions:
                        d["made"] = False
    result.graph = batched
    result.decisions = decisions
    for d in decisions:
        result.fused[d["fusion"]] += d["made"]
    return result


class CostLatencies:
    """Each unit's predicted milliseconds under the cost model ``spec`` (measured on ``device``; see
    :func:`opsched.pipeline.cost_model`; ``replayed``: of plans replayed as CUDA graphs), called with a graph;
    :meth:`regions_ms`, the whole graph's."""

    def __init__(self, spec: str, inputs: Sequence[Any], kernels: str = "eager", cores: int | None = None,
                 cache: bool = True, progress: Any = None, device: str = "cpu", replayed: bool = False):
        self.spec, self.kernels, self.cores, self.cache, self.progress, self.device = \
            spec, kernels, cores, cache, progress, device
        self.replayed = replayed
        self.flat = pytree.tree_leaves(tuple(inputs))
        # by fingerprint, each cost model and the kernels it measured: fuse_graph and optimize both ask for the
        # combined graph
        self.models: dict[str, tuple[Any, Any]] = {}

    def cost(self, graph: Graph) -> Any:
        return self._measured(graph)[0]

    def _measured(self, graph: Graph) -> tuple[Any, Any]:
        from opsched.pipeline import cost_model

        if graph.fingerprint not in self.models:
            self.models[graph.fingerprint] = cost_model(graph, self.flat, self.spec, device=self.device,
                                                        kernels=self.kernels, cores=self.cores, cache=self.cache,
                                                        progress=self.progress, replayed=self.replayed)
        return self.models[graph.fingerprint]

    def __call__(self, graph: Graph) -> list[float]:
        cost = self.cost(graph)
        return [cost.op_latency(u) for u in range(len(graph))]

    def regions_ms(self, graph: Graph) -> float | None:
        """The whole graph's units run in order, as the compiled regions they form: predicted, its regions
        measured in place; None with eager kernels, or where a region fails to compile. Where ``auto``
        chose the default kernels for this graph, its units one after another: the batched graph and the graph
        apart may choose differently (batched units on eager kernels, the models apart on ONNX Runtime), and
        then it is their regions that the choice between them compares."""
        from opsched.pipeline import with_regions
        from opsched.schedulers import make_schedule

        # nothing to compile (eager kernels, or auto off the CPU, where it is the default kernels), or nothing runs
        if self.kernels == "eager" or (self.kernels == "auto" and self.device != "cpu") or is_simulated(self.spec):
            return None
        cost = self.cost(graph)
        plan = with_regions(make_schedule("sequential", graph, cost), graph, cost)
        return None if cost.region_error else plan.predicted_latency
