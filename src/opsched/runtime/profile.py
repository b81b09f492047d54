"""The runs the measured cost model reads: a graph's units run in place, through the executor and on the kernels
the plan will run on, their timelines handed back as plain data.

The measured cost model (:mod:`opsched.cost.measure`) runs nothing itself. It asks an :class:`InPlaceRuns` for
what it needs, in its own terms (stages of unit indices, thread counts, copies of the graph side by side), and
reads the timelines: each run a list of (stream, units, start, finish) in seconds from the start of the call.
Every run is a warm-up, then ``repeats`` runs, interleaved when several programs are timed together (so that
a burst of load on a shared machine spreads over all of them instead of skewing one). The caller's intra-op
thread count is restored after every measurement: measuring a one-thread device of ``opsched map`` once left the
process on one thread, and eager was then timed on one thread (1.5x slower than on two).

>>> import torch
>>> from opsched.graph.capture import capture
>>> from opsched.runtime.kernels import kernels_for
>>> g = capture(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.randn(2, 8),))
>>> runs = InPlaceRuns(g, [torch.randn(2, 8)], kernels_for(g), repeats=2)
>>> timelines = runs.stages([[("concurrent", [[0]])]], [1], "a unit")[0]
>>> len(timelines), [units for _, units, _, _ in timelines[0]]
(2, [(0,)])
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opsched.exiting import stop_point
from opsched.graph.ir import Graph, Node
from opsched.runtime import make_executor
from opsched.runtime.kernels import ChosenKernels, unit_operator
from opsched.runtime.program import staged_program
from opsched.timing import interleaved_medians, medians_until_apart

Timeline = list[tuple[int, tuple[int, ...], float, float]]
MIN_SAMPLE_SECONDS = 0.002  # a sample of the hand-off probe repeats it until it lasts this long


class InPlaceRuns:
    """Runs of ``graph`` on its input values ``inputs`` (flat, in the graph's input order), on ``device``
    (``cpu`` or ``cuda``), every unit on the kernel ``kernels`` chose for it; ``progress(label, total)`` gives a
    context whose ``update(n)`` counts runs done. ``replayed`` (on ``cuda``): every timed run is queued behind
    a hold on the device (:func:`~opsched.runtime.cuda.hold_for`), so that its timeline is its device work
    without its launches, as it runs replayed in a CUDA graph; the runs a plan for ``--cuda-graph`` is costed
    on. (A timeline inside a real graph would need event nodes in it, which PyTorch records only as
    dependencies.)"""

    def __init__(self, graph: Graph, inputs: Sequence[Any], kernels: ChosenKernels, device: str = "cpu",
                 repeats: int = 9, progress: Callable[[str, int], Any] | None = None, replayed: bool = False):
        self.graph, self.inputs, self.kernels, self.device, self.repeats = graph, list(inputs), kernels, device, repeats
        self.progress = progress or (lambda what, total: _NoProgress())
        self.replayed = replayed and device == "cuda"

    @property
    def choice(self) -> dict[str, str]:
        """The kernel each unit runs on (see :mod:`opsched.runtime.choice`)."""
        return self.kernels.choice

    def device_description(self) -> str:
        """The GPU the runs are timed on (its name, compute capability, CUDA and PyTorch versions)."""
        from opsched.runtime.cuda import current_api

        return current_api().describe() + ("|launches hidden, as replayed" if self.replayed else "")

    def stages(self, orders: Sequence[Sequence[Any]], threads: Sequence[int], label: str,
               stage_threads: Sequence[Any] | None = None) -> list[list[Timeline]]:
        """The timelines of the graph run as each of ``orders`` (stages, see
        :func:`~opsched.runtime.program.staged_program`) with the intra-op ``threads`` given for it (and the
        per-stage ``stage_threads``, where given), interleaved: one list of ``repeats`` timelines per order."""
        programs = [staged_program(self.graph, order, t, stage_threads[k] if stage_threads else None)
                    for k, (order, t) in enumerate(zip(orders, threads))]
        return self.programs(programs, label)

    def programs(self, programs: Sequence[Any], label: str,
                 kernels: ChosenKernels | None = None) -> list[list[Timeline]]:
        """The timelines of ``programs`` (compiled StreamPrograms reading the graph's inputs; their units run on
        ``kernels``, by default the graph's), interleaved: one list of ``repeats`` timelines per program."""
        executors = [make_executor(p, kernels or self.kernels, self.device) for p in programs]
        timelines: list[list[Timeline]] = [[] for _ in programs]
        host_seconds = [0.0] * len(programs)  # what the host took for a timed run, the warm-up
        if self.replayed:
            from opsched.runtime.cuda import current_api, hold_for
        caller_threads = torch.get_num_threads()
        try:
            with self.progress(label, len(programs) * (self.repeats + 1)) as bar:
                for k, executor in enumerate(executors):
                    began = time.perf_counter()
                    executor(*self.inputs, record_timeline=self.replayed)
                    host_seconds[k] = time.perf_counter() - began
                    bar.update(1)
                for _ in range(self.repeats):
                    stop_point()  # a background build asked to stop (the interpreter exiting, its server stopping)
                    for k, executor in enumerate(executors):
                        if self.replayed:
                            hold_for(current_api(), host_seconds[k])
                        executor(*self.inputs, record_timeline=True)
                        timelines[k].append(executor.timeline)
                        bar.update(1)
        finally:
            for executor in executors:
                executor.close()
            torch.set_num_threads(caller_threads)
        return timelines

    def whole(self, thread_options: Sequence[int]) -> list[float]:
        """Median milliseconds of the whole graph run unit after unit at each of ``thread_options``, timed now
        and interleaved, the rounds stopping once the fastest is clear (:func:`~opsched.timing.medians_until_apart`;
        the choice is timed on every search, so its rounds count)."""
        order = [("concurrent", [[u]]) for u in range(len(self.graph))]
        return self.medians([make_executor(staged_program(self.graph, order, t), self.kernels, self.device)
                             for t in thread_options], until_apart=True)

    def medians(self, executors: Sequence[Any], until_apart: bool = False) -> list[float]:
        """Median milliseconds of each of ``executors`` (of programs reading the graph's inputs) called on the
        inputs, a warm-up and ``repeats`` interleaved rounds (``until_apart``: fewer where the fastest is clear
        sooner); the executors are closed after."""
        caller_threads = torch.get_num_threads()
        runners = [lambda e=e: e(*self.inputs) for e in executors]
        try:
            if until_apart:
                return medians_until_apart(runners, self.repeats)
            return interleaved_medians(runners, self.repeats, warmup=1)
        finally:
            for e in executors:
                e.close()
            torch.set_num_threads(caller_threads)

    def regions(self, schedule: Any, cores: int, label: str) -> tuple[list[str], list[Timeline]]:
        """The timelines of ``schedule`` (one stage per unit or run of units) run with its runs of units
        compiled as regions (:func:`~opsched.runtime.regions.compiled_regions`) on ``cores`` threads, and the
        name of each unit or region that ran, by index (a region is named after its last unit)."""
        from opsched.runtime.regions import compiled_regions, unit_by_unit

        fused, _ = compiled_regions(self.graph, schedule, each_stage=True, kernels=unit_by_unit(self.kernels))
        order = [("concurrent", [[k]]) for k in range(len(fused))]
        program = staged_program(fused, order, cores)
        return [n.name for n in fused.nodes], self.programs([program], label)[0]

    def handoff(self, cores: int) -> tuple[float, float]:
        """Milliseconds of one stage of two empty steps on one stream and on two: what an extra stream adds."""
        nodes = [Node("a", args=("x",), run=_identity), Node("b", args=("x",), run=_identity)]
        tiny = Graph(nodes, inputs=["x"])
        # One thread a step: empty steps open no parallel region, and a worker given several threads would be
        # ended after every call (see opsched.runtime.cpu), a cost a real call pays once, not per stage.
        one = make_executor(staged_program(tiny, [("concurrent", [[0, 1]])], cores, [[[1, 1]]]), unit_operator,
                            self.device)
        two = make_executor(staged_program(tiny, [("concurrent", [[0], [1]])], cores, [[[1], [1]]]),
                            unit_operator, self.device)
        try:
            if self.device == "cuda":  # the device's time, from events: the host's clock would count launches
                from opsched.runtime.cuda import current_api, time_cuda

                x = torch.zeros(1, device=current_api().device)
                return tuple(time_cuda(lambda run=run: run(x), repeats=self.repeats, queued=self.replayed)
                             for run in (one, two))
            x = torch.zeros(1)
            t_one, t_two = interleaved_medians([lambda: one(x), lambda: two(x)], self.repeats,
                                               min_sample_seconds=MIN_SAMPLE_SECONDS)
            return t_one, t_two
        finally:
            one.close()
            two.close()

    def copies(self, copies: int, label: str) -> list[Timeline]:
        """The timelines of ``copies`` copies of the graph side by side, each unit's copies run at once on as
        many streams (a stage per unit, in place), on one thread each; unit ``u + c * n`` is copy c of unit u."""
        n = len(self.graph)
        copied = [dataclasses.replace(node, name=f"{node.name}~copy{c}")
                  for c in range(1, copies) for node in self.graph.nodes]
        side_by_side = Graph(list(self.graph.nodes) + copied, inputs=self.graph.inputs,
                             name=f"{self.graph.name}~copies")
        stages = [("concurrent", [[u + c * n] for c in range(copies)]) for u in range(n)]
        kernels = self.kernels.copies({node.name: self.graph.nodes[k % n].name for k, node in enumerate(copied)})
        return self.programs([staged_program(side_by_side, stages, 1)], label, kernels)[0]


def measured_cost(graph: Graph, inputs: Sequence[Any], kernels: ChosenKernels | None = None, device: str = "cpu",
                  repeats: int = 9, progress: Callable[[str, int], Any] | None = None,
                  values: dict[str, Any] | None = None, replayed: bool = False, **options: Any) -> Any:
    """The measured cost model of ``graph`` on ``device`` (:class:`~opsched.cost.measure.MeasuredCost`, with
    ``options``: ``cores``, ``cache``), reading runs of its units on ``kernels`` (default: the eager choice,
    :func:`~opsched.runtime.kernels.kernels_for`) fed ``inputs`` (flat); ``values`` (every unit's output on
    ``inputs``) saves computing them again; ``replayed``: on a GPU, timed as a replayed CUDA graph runs, without
    launches (see :class:`InPlaceRuns`)."""
    from opsched.cost.measure import MeasuredCost
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import kernels_for

    values = values if values is not None else all_values(graph, inputs)
    runs = InPlaceRuns(graph, [values[name] for name in graph.inputs], kernels or kernels_for(graph, "eager", device),
                       device, repeats, progress, replayed)
    return MeasuredCost(graph, inputs, runs, values=values, **options)


def _identity(x: Any) -> Any:
    return x


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None
