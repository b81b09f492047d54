"""Compiled regions: the units a schedule runs back to back on one stream, fused into one unit, so that a
compiler (``--kernels inductor`` or ``onnxruntime``) sees them whole and fuses across their boundaries, where
compiling unit by unit stops at every unit. Below, for a staged schedule; a stream schedule's runs are its
streams.

A *run* is a maximal sequence of consecutive one-group stages. It is cut into regions so that every value a
region makes for the outside is its last unit's (the graph of units has one output per unit): after any
unit read by a later stage outside its region, or returned by the graph. A region of two or more units
becomes one :class:`~opsched.graph.ir.Node` whose ``run`` is a GraphModule with the units' operators
inlined and named after its last unit (whose value it returns); concurrent and merge stages keep their
units. The result is a new graph and the same schedule on it, run by the usual backends;
:class:`~opsched.runtime.module.OptimizedModule` applies it to a plan whose ``run.regions`` is set.

>>> import torch
>>> from opsched.graph.capture import capture
>>> from opsched.cost.table import TableCost
>>> from opsched.schedulers import make_schedule
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)).eval()
>>> x = torch.randn(1, 3, 8, 8)
>>> graph = capture(model, (x,))
>>> for n in graph.nodes: n.latency = 1.0
>>> fused, plan = compiled_regions(graph, make_schedule("sequential", graph, TableCost(graph)))
>>> len(graph), len(fused), [st.groups for st in plan.stages]
(2, 1, [[['2']]])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx

from opsched.cost.table import TableCost
from opsched.graph.ir import Graph, Node, indices
from opsched.graph.ops import get_attr_value
from opsched.runtime.kernels import COMPILED
from opsched.schedule import Schedule, from_stages, from_streams


def compiled_regions(graph: Graph, schedule: Schedule, each_stage: bool = False,
                     kernels: Mapping[str, str] | None = None) -> tuple[Graph, Schedule]:
    """The graph with each region of ``schedule`` fused into one unit, and the schedule on that graph (see
    the module docstring). A stream schedule's runs are its streams (a mapped plan, whose units are placed on
    devices, is returned unchanged). With ``each_stage``, every one-group stage is a run of its own instead
    of joining the one-group stages around it (how the measured cost model profiles one region per block).
    ``kernels``: each unit's kernel where they were chosen unit by unit (``--kernels auto``): a region then
    holds consecutive units of one compiled kernel, and units on the others stay units."""
    if schedule.stages is None:
        return _stream_regions(graph, schedule, kernels)
    index = graph.index
    stages = [(st.strategy, [[index[u] for u in g] for g in st.groups], st.threads) for st in schedule.stages]
    regions = _regions(graph, stages, each_stage, kernels)
    fused_of = {u: k for k, region in enumerate(regions) for u in region}
    fused, name_of = _fused_graph(graph, schedule, regions)
    new_stages: list[tuple[str, list[list[int]]]] = []
    threads: list[Any] = []
    for strategy, groups, stage_threads in stages:
        if strategy == "concurrent" and len(groups) == 1:  # part of a run: unit by unit, a region at its start
            for position, u in enumerate(groups[0]):
                k = fused_of[u]
                if name_of[k] is None:
                    new_stages.append(("concurrent", [[fused.index[graph.nodes[u].name]]]))
                    threads.append([[stage_threads[0][position]]] if stage_threads else None)
                elif u == regions[k][0]:  # the region runs where its first unit did, on every core
                    new_stages.append(("concurrent", [[fused.index[name_of[k]]]]))
                    threads.append(None)
            continue
        new_stages.append((strategy, [[fused.index[graph.nodes[u].name] for u in g] for g in groups]))
        threads.append(stage_threads)
    plan = from_stages(fused, _CarriedCost(fused), schedule.method, new_stages)
    for stage, chosen in zip(plan.stages, threads):
        stage.threads = chosen
    plan.cost, plan.device, plan.batch = schedule.cost, schedule.device, schedule.batch
    plan.options, plan.run = dict(schedule.options), dataclasses.replace(schedule.run, regions=True)
    return fused, plan


def _stream_regions(graph: Graph, schedule: Schedule,
                    kernels: Mapping[str, str] | None = None) -> tuple[Graph, Schedule]:
    """A stream schedule with each stream's units cut into regions as a run's are: a region's value read on
    another stream is its last unit's, so the streams wait for regions as they waited for units (and the
    regions form no cycle: nothing reads into a region from its own last unit). Each region runs where its
    units ran, with the threads the streams beside it leave."""
    if schedule.devices is not None:
        return graph, schedule
    index = graph.index
    streams = [[index[u] for u in units] for units in schedule.streams()]
    regions = _cut_runs(graph, _one_kernel_runs(graph, [units for units in streams if units], kernels))
    first_of = {region[0]: k for k, region in enumerate(regions)}
    fused, name_of = _fused_graph(graph, schedule, regions)
    fused_streams = [[fused.index[name_of[first_of[u]] or graph.nodes[u].name] for u in units if u in first_of]
                     for units in streams]
    plan = from_streams(fused, _CarriedCost(fused), schedule.method, fused_streams)
    plan.cost, plan.device, plan.batch = schedule.cost, schedule.device, schedule.batch
    plan.options, plan.run = dict(schedule.options), dataclasses.replace(schedule.run, regions=True)
    return fused, plan


def _fused_graph(graph: Graph, schedule: Schedule, regions: Sequence[Sequence[int]]) -> tuple[Graph, dict]:
    """The graph with every region of two or more units one unit, and each region's name (None for one unit).
    A region is named after its last unit, whose value it returns: readers, the graph's outputs and the
    example values compilers are given keep their names."""
    fused_of = {u: k for k, region in enumerate(regions) for u in region}
    durations = {o.name: o.finish - o.start for o in schedule.ops}
    name_of = {k: graph.nodes[region[-1]].name if len(region) > 1 else None for k, region in enumerate(regions)}
    nodes: list[Node] = []
    for u, node in enumerate(graph.nodes):
        k = fused_of.get(u)
        if k is None or name_of[k] is None:
            nodes.append(dataclasses.replace(node, latency=durations[node.name]))
        elif u == regions[k][0]:
            nodes.append(_fused_node(graph, regions[k], durations))
    return Graph(nodes, inputs=graph.inputs, outputs=graph.outputs, name=graph.name, out_spec=graph.out_spec), name_of


class _CarriedCost(TableCost):
    """The schedule's own predicted durations, carried over to the fused graph (as unit latencies): a
    merge stage keeps the duration its units were predicted to share."""

    def merge_latency(self, units: Sequence[int]) -> float:
        return max(self.op_latency(u) for u in units)


def _regions(graph: Graph, stages: Sequence[tuple[str, list[list[int]], Any]], each_stage: bool,
             kernels: Mapping[str, str] | None = None) -> list[list[int]]:
    """The regions of the runs of one-group stages, each cut after a unit read outside its region."""
    runs: list[list[int]] = []
    current: list[int] = []
    for strategy, groups, _ in stages:
        if strategy == "concurrent" and len(groups) == 1:
            current.extend(groups[0])
            if each_stage:
                runs.append(current)
                current = []
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return _cut_runs(graph, _one_kernel_runs(graph, runs, kernels))


def unit_by_unit(kernels: Any) -> dict[str, str] | None:
    """Each unit's kernel where ``kernels`` (an operator) chose them unit by unit (``--kernels auto``); else
    None, one kernel running every region."""
    return dict(kernels.choice) if getattr(kernels, "asked", None) == "auto" else None


def _one_kernel_runs(graph: Graph, runs: list[list[int]], kernels: Mapping[str, str] | None) -> list[list[int]]:
    """``runs`` cut where the kernel changes (``kernels``: each unit's, None where one kernel runs them all), a
    unit on a kernel that is not compiled a run of its own: it stays as it is."""
    if kernels is None:
        return runs
    pieces: list[list[int]] = []
    for run in runs:
        first = len(pieces)  # this run's first piece
        for u in run:
            kernel = kernels[graph.nodes[u].name]
            if len(pieces) > first and kernel in COMPILED and kernels[graph.nodes[pieces[-1][-1]].name] == kernel:
                pieces[-1].append(u)
            else:
                pieces.append([u])
    return pieces


def _cut_runs(graph: Graph, runs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each run (units in an order that respects the graph) cut into regions, after every unit read outside
    its region or returned by the graph."""
    returned = {graph.index[o] for o in graph.outputs if o in graph.index}
    regions = []
    for run in runs:
        cuts = {len(run) - 1}
        changed = True
        while changed:  # a cut can put a reader in another region than its producer: cut there too
            changed = False
            region_of = _region_of(run, cuts)
            for position, u in enumerate(run):
                if position in cuts:
                    continue
                readers = list(indices(graph.succs[u]))
                if u in returned or any(region_of.get(v) != region_of[u] for v in readers):
                    cuts.add(position)
                    changed = True
        start = 0
        for position in sorted(cuts):
            regions.append(list(run[start:position + 1]))
            start = position + 1
    return regions


def _region_of(run: Sequence[int], cuts: set[int]) -> dict[int, int]:
    region, out = 0, {}
    for position, u in enumerate(run):
        out[u] = region
        if position in cuts:
            region += 1
    return out


def _fused_node(graph: Graph, region: Sequence[int], durations: dict[str, float]) -> Node:
    """One unit running the operators of ``region``'s units in order, reading what they read outside it."""
    inside = {graph.nodes[u].name for u in region}
    args = list(dict.fromkeys(a for u in region for a in graph.nodes[u].args if a not in inside))
    g = fx.Graph()
    env: dict[str, fx.Node] = {a: g.placeholder(f"in{k}") for k, a in enumerate(args)}
    attributes: dict[str, Any] = {}
    for k, u in enumerate(region):
        unit = graph.nodes[u]
        module = unit.run
        inputs = iter(unit.args)
        mapping: dict[fx.Node, fx.Node] = {}
        for node in module.graph.nodes:
            if node.op == "placeholder":
                mapping[node] = env[next(inputs)]
            elif node.op == "output":
                env[unit.name] = mapping[node.args[0]]
            else:
                mapping[node] = g.node_copy(node, mapping.__getitem__)
                if node.op in ("get_attr", "call_module"):
                    # each unit names its attributes for itself (a batched unit's are w0, w1, ...): kept apart
                    name = f"u{k}_{str(node.target).replace('.', '_')}"
                    attributes[name] = get_attr_value(node, module)
                    mapping[node].target = name
    g.output(env[graph.nodes[region[-1]].name])
    last = graph.nodes[region[-1]]
    members = [graph.nodes[u] for u in region]
    return Node(name=last.name, kind="region", args=tuple(args), shape=last.shape,
                dtype=last.dtype, flops=sum(n.flops for n in members),
                bytes_read=sum(n.bytes_read for n in members), bytes_written=last.bytes_written,
                param_bytes=sum(n.param_bytes for n in members), ops=tuple(op for n in members for op in n.ops),
                latency=sum(durations[n.name] for n in members),
                run=fx.GraphModule(attributes, g, class_name="Region"))

