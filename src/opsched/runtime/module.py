"""``opsched.compile``: a model (or its captured graph) and a schedule become a callable module that runs
the schedule (``opsched.verify``, in :mod:`opsched.evaluation`, says how far its outputs are from the model's).

>>> import torch
>>> from opsched.graph.capture import capture
>>> from opsched.cost.table import TableCost
>>> from opsched.schedulers import make_schedule
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
>>> x = torch.randn(1, 3, 8, 8)
>>> graph = capture(model, (x,))
>>> for n in graph.nodes: n.latency = 1.0
>>> fast = compile(graph, make_schedule("greedy", graph, TableCost(graph)))
>>> torch.allclose(fast(x), model(x), atol=1e-6)  # the convolution ran with reordered weights: float32 rounding
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from opsched.errors import GraphError, OpschedError
from opsched.graph.ir import Graph
from opsched.graph.ops import draws_random
from opsched.graph.tracing import TRACING
from opsched.runtime import DEVICES, make_executor
from opsched.runtime.choice import check_choice
from opsched.runtime.guards import Guard
from opsched.runtime.kernels import ChosenKernels, Operator, plan_kernels
from opsched.runtime.outputs import as_the_model_gives
from opsched.runtime.packed import eager_layout, eager_strides
from opsched.runtime.program import StreamProgram, compile_program
from opsched.schedule import Schedule, validate


class OptimizedModule(torch.nn.Module):
    """Runs ``graph`` as ``schedule`` says: on the CPU with ``cores`` intra-op threads to share between the
    streams (default: PyTorch's current thread count), or on CUDA streams (``device="cuda"``, optionally
    replayed as one CUDA graph; see :mod:`opsched.runtime.cuda`); a plan mapped onto devices, on its devices.
    Inputs and outputs are structured as the model's.
    ``operator`` gives the callable of each run step: by default the kernels the plan recorded
    (:func:`~opsched.runtime.kernels.plan_kernels`); a job passes the
    :class:`~opsched.runtime.kernels.ChosenKernels` its cost model measured with, which must agree with what
    the plan records. A schedule with ``run.regions`` runs its back-to-back units as compiled regions
    (:mod:`opsched.runtime.regions`).

    ``guard`` (what :func:`compile` and every job give it) is the call signature the plan was made for and the
    watch on the weights it was built from (:mod:`opsched.runtime.guards`): a call with another signature raises
    :class:`~opsched.errors.SignatureMismatch`, and one after the weights changed
    :class:`~opsched.errors.StaleWeights`, instead of a wrong answer. :class:`~opsched.runtime.guarded.GuardedModule`
    (what ``opsched.optimize`` hands back) builds a plan per signature and follows the weights."""

    def __init__(self, graph: Graph, schedule: Schedule, cores: int | None = None,
                 operator: Operator | None = None, device: str = "cpu", cuda_graph: bool = False,
                 guard: Guard | None = None):
        super().__init__()
        if cuda_graph and device != "cuda":
            raise OpschedError(f"a CUDA graph needs device 'cuda', not {device!r}")
        missing = [n.name for n in graph.nodes if n.run is None]
        if missing:
            raise GraphError(f"unit {missing[0]!r} has no operator to run (graphs from DAG JSON cannot run)")
        for n in graph.nodes:
            drawn = draws_random(n.run) if isinstance(n.run, fx.GraphModule) else None
            if drawn:
                raise GraphError(f"unit {n.name!r} draws random numbers ({drawn}): a plan would draw others than "
                                 "the model (another order, other threads), so opsched does not plan models "
                                 "that draw them; the model itself answers")
        self.graph = graph
        self.schedule = schedule
        if operator is None:
            operator = plan_kernels(graph, schedule, device)
        elif isinstance(operator, ChosenKernels) and schedule.unit_kernels is not None:
            _check_same_kernels(operator, check_choice(schedule.unit_kernels, graph))
        if schedule.run.regions:
            # the units it runs back to back fused into regions that a compiler sees whole (see regions.py)
            from opsched.runtime.regions import compiled_regions, unit_by_unit

            validate(schedule, graph)
            graph, schedule = compiled_regions(graph, schedule, kernels=unit_by_unit(operator))
        self.program: StreamProgram = compile_program(schedule, graph, cores or torch.get_num_threads())
        self.units = torch.nn.ModuleList(n.run for n in graph.nodes if isinstance(n.run, torch.nn.Module))
        # a plan mapped onto devices runs each program stream on its device (program stream k is the k-th device
        # with units); onto CUDA devices, it takes the inputs on the host (see opsched.runtime.cuda.devices)
        where: str | list[int | None] = device
        if schedule.devices is not None:
            on = schedule.devices.devices
            where = [on[d].cuda_index for d in sorted({op.stream for op in schedule.ops})]
        self.executor = make_executor(self.program, operator, where, cuda_graph)
        # what runs, as the evaluation compares it: two schedules that compile to these same steps, kernels and
        # devices are one program (an IOS search that kept one unit per stage is the sequential schedule)
        self.program_key = (tuple(tuple(steps) for steps in self.program.describe()), repr(where), cuda_graph,
                            operator.key if isinstance(operator, ChosenKernels) else id(operator))
        # reordered convolutions leave values channels_last (see opsched.runtime.packed); outputs go back as eager's
        self.relayout = eager_strides(graph) if getattr(operator, "packs", False) else None

        self.guard = guard

    def forward(self, *inputs: Any) -> Any:
        if self.guard is None:
            return self.run(pytree.tree_leaves(inputs))
        outputs = self.run(self.guard.check(inputs))
        return as_the_model_gives(outputs, self.guard.weights.tensors if self.guard.weights is not None else [])

    def run(self, flat: list[Any]) -> Any:
        """Run the plan on the flat list of inputs, unchecked: for a caller that has checked the guard itself."""
        if len(flat) != len(self.graph.inputs):
            raise GraphError(f"{self.graph.name} takes {len(self.graph.inputs)} input tensors, got {len(flat)}")
        with TRACING.calling():  # never while a model is traced on another thread (opsched.graph.tracing)
            outputs = self.executor(*flat)
        if self.relayout is not None:
            outputs = eager_layout(outputs, self.relayout)
        if self.graph.out_spec is not None:
            return pytree.tree_unflatten(outputs, self.graph.out_spec)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def close(self) -> None:
        """End the backend's worker threads now instead of when the module is garbage collected (a later call
        starts them again)."""
        self.executor.close()


def compile(model_or_graph: torch.nn.Module | Graph, schedule: Schedule,
            example_inputs: Sequence[Any] | None = None, cores: int | None = None, device: str | None = None,
            operator: Operator | None = None, cuda_graph: bool = False) -> OptimizedModule:
    """A module that runs ``schedule``. Give the captured graph, or the model and the example inputs to
    capture it with (the schedule must have been made for that same graph).

    ``device`` is where it runs, ``cpu`` or ``cuda``; by default the device the schedule was made for
    (``cpu`` for a plan made for a simulated GPU or a table of latencies). With ``example_inputs``, the module
    refuses calls of another signature, and with the model, calls after its weights changed (see
    :class:`OptimizedModule`; ``opsched.optimize`` hands back a module that rebuilds instead). The model's weights and the
    inputs must already be there: a plan made for CUDA is never replayed on the CPU behind the caller's
    back. ``cuda_graph`` replays the whole program as one CUDA graph; ``operator`` gives the callable of
    each run step (default: the kernels the plan recorded; see :mod:`opsched.runtime.kernels`).
    """
    device = device or (schedule.device if schedule.device in DEVICES else "cpu")
    if device not in DEVICES:
        raise OpschedError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if isinstance(model_or_graph, Graph):
        graph = model_or_graph
    else:
        if example_inputs is None:
            raise OpschedError("compiling a model needs its example inputs (or pass the captured graph)")
        _check_device(pytree.tree_leaves(tuple(example_inputs)), device, "the example inputs")
        from opsched.graph.capture import capture

        graph = capture(model_or_graph, tuple(example_inputs))
    _check_device([t for n in graph.nodes if isinstance(n.run, torch.nn.Module)
                   for t in (*n.run.parameters(), *n.run.buffers())], device, "the model's weights")
    guard = None if example_inputs is None else Guard.of(
        tuple(example_inputs), None if isinstance(model_or_graph, Graph) else model_or_graph)
    if operator is None and example_inputs is not None:  # compiled kernels are compiled for the example inputs
        operator = plan_kernels(graph, schedule, device, pytree.tree_leaves(tuple(example_inputs)))
    return OptimizedModule(graph, schedule, cores, operator, device=device, cuda_graph=cuda_graph, guard=guard)


def _check_same_kernels(kernels: ChosenKernels, recorded: dict[str, str]) -> None:
    """Refuse to run a plan on other kernels than it records (a unit ONNX Runtime turned out not to take runs
    eagerly once compiled, which a plan recorded before may not say yet)."""
    for name, kernel in recorded.items():
        now = kernels.choice.get(name)
        if now != kernel and not (kernel == "onnxruntime" and now == "eager"):
            raise OpschedError(f"the plan runs unit {name!r} on {kernel} kernels, but the kernels given run it on "
                               f"{now}")


def _check_device(tensors: Sequence[Any], device: str, what: str) -> None:
    """Refuse tensors that are not where ``device`` runs them (``meta`` tensors pass: they stand for any
    device)."""
    if device == "cuda":
        from opsched.runtime.cuda import current_api

        expected = current_api().device.type  # ``cuda``, or the CPU for a stand-in in tests
    else:
        expected = device
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in (expected, "meta"):
            raise OpschedError(f"{what} are on {t.device.type}, but the module is to run on {device}: "
                               f"move the model and its inputs there first (model.to({device!r}))")
