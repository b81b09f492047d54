"""``torch.compile(model, backend="opsched")``: the same pipeline behind PyTorch's own front door.

Dynamo traces the model and hands each graph it captured (several, where the model has graph breaks) to
:func:`opsched_backend` with example inputs. Each graph goes through the one runner, as ``opsched optimize``:
capture -> Graph -> cost model -> scheduler -> Schedule -> OptimizedModule, verified against the graph and
timed interleaved with it, and the compiled schedule replaces it where it is faster above the run's noise. The backend is
registered under the name ``opsched`` through the ``torch_dynamo_backends`` entry point, so installing
opsched is enough::

    fast = torch.compile(model, backend="opsched")
    fast = torch.compile(model, backend="opsched", options={"method": "lios", "cost": "sim:v100"})

Options: ``method`` (default ``ios``), ``cost`` (``measured``, the default, profiled here and cached, or
``sim:NAME``), ``kernels`` (``eager`` or ``inductor``), ``verify`` (default True: the schedule's outputs
are compared with the graph's own on the example inputs, and a schedule that differs is not used; with
measured costs it is also timed against the graph; False: neither), ``freeze`` (default False: the parameters
dynamo passes as graph inputs stay inputs, read afresh on every call; True: the plan holds them, as inductor's
``freezing`` does, so that its convolutions can be reordered once, and its guard watches them: a parameter
updated in place or replaced is answered by the graph, but a write through ``.data``, which PyTorch keeps off
the version counter, is not seen).

opsched schedules inference: a graph that needs gradients, or that dynamo traced with symbolic shapes, runs
as dynamo gave it (a warning says why), as does a graph opsched cannot capture or verify. The compiled
schedule runs in inference mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opsched.cost.devices import is_simulated

OPTIONS = {"method": "ios", "cost": "measured", "kernels": "eager", "verify": True, "freeze": False}


class OpschedBackendWarning(UserWarning):
    """A graph dynamo handed to opsched runs unscheduled; the message says why."""


def opsched_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                    mode: str | None = None) -> Callable[..., Any]:
    """The dynamo backend: schedule ``gm`` and return a callable with its signature (flat tensors in, the
    graph's outputs out)."""
    chosen = {**OPTIONS, **(options or {})}
    unknown = sorted(set(chosen) - set(OPTIONS))
    if unknown:
        from opsched.errors import OpschedError

        raise OpschedError(f"unknown opsched backend option {unknown[0]!r}; choose from {', '.join(OPTIONS)}")
    why = _unschedulable(example_inputs)
    if why:
        warnings.warn(f"opsched: {why}; this graph runs unscheduled", OpschedBackendWarning, stacklevel=2)
        return gm.forward
    try:
        return _schedule(gm, tuple(example_inputs), chosen)
    except Exception as e:  # noqa: BLE001 - never break the user's model: run the graph as dynamo gave it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"opsched: could not schedule this graph ({type(e).__name__}: {first}); it runs unscheduled",
                      OpschedBackendWarning, stacklevel=2)
        return gm.forward


class _HoldingWeights(torch.nn.Module):
    """``gm`` holding as its own the parameters dynamo passes it as inputs (with ``freeze``; else none), and
    called with the other inputs: a plan's units then hold their weights, as a model's units do (the reordered
    convolutions need weights a unit holds), and the plan's guard watches those same parameters (their version
    counters and storage), so that a weight updated in place is seen and the graph answers."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: Sequence[Any], freeze: bool = True):
        super().__init__()
        self.gm = gm
        self.held = [k for k, x in enumerate(inputs) if freeze and isinstance(x, torch.nn.Parameter)]
        self.weights = torch.nn.ParameterList([inputs[k] for k in self.held])  # the parameters themselves
        self.arity = len(inputs)

    def rest(self, inputs: Sequence[Any]) -> tuple:
        """The inputs of a call of ``gm`` other than the parameters held."""
        held = set(self.held)
        return tuple(x for k, x in enumerate(inputs) if k not in held)

    def holds(self, inputs: Sequence[Any]) -> bool:
        """Whether a call of ``gm`` passes the very parameters held."""
        return len(inputs) == self.arity and all(inputs[k] is w for k, w in zip(self.held, self.weights))

    def forward(self, *rest: Any) -> Any:
        args = list(rest)
        for k, weight in zip(self.held, self.weights):  # positions in ascending order: each lands where it was
            args.insert(k, weight)
        return self.gm(*args)


def _unschedulable(example_inputs: Sequence[Any]) -> str | None:
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            return f"an input is a {type(x).__name__} (symbolic shapes), not a tensor"
        if x.requires_grad and torch.is_grad_enabled():
            return "the graph needs gradients and opsched schedules inference"
    return None


def _schedule(gm: torch.fx.GraphModule, inputs: tuple, options: dict[str, Any]) -> Callable[..., Any]:
    """``gm`` through the one runner: captured, costed, scheduled, and, with measured costs, verified against
    ``gm`` and timed interleaved with it (:func:`opsched.pipeline.run_workload`): the graph as dynamo gave it
    answers where the plan is not faster above the run's noise. With simulated costs (nothing can be timed
    here) the plan is verified on the example inputs only. A call the plan was not made for (another stride,
    a weight ``gm`` holds changed) is answered by ``gm``."""
    from opsched.errors import SignatureMismatch, StaleWeights, VerificationError
    from opsched.graph.capture import capture
    from opsched.pipeline import Workload, method_options, run_workload
    from opsched.runtime.guards import Guard
    from opsched.runtime.module import OptimizedModule

    held = _HoldingWeights(gm, inputs, options["freeze"])
    rest = held.rest(inputs)
    graph = capture(held, rest, name=f"dynamo-{type(gm).__name__}")
    device = "cuda" if inputs and inputs[0].is_cuda else "cpu"
    method = options["method"]
    simulated = is_simulated(options["cost"])
    measure = options["verify"] and not simulated
    outcome = run_workload(Workload(held, rest, graph, {method: (method, method_options(method))},
                                    cost=options["cost"], device=device, kernels=options["kernels"],
                                    measure=measure))
    if measure:
        if outcome.plan() is None:
            raise VerificationError(f"the schedule does not reproduce the graph: "
                                    f"{outcome.evaluation.dropped.get(method)}")
        if outcome.evaluation.kinds[outcome.chosen] != "schedule":  # not faster than the graph above the noise
            return gm.forward
        module = outcome.modules[outcome.chosen]  # the method's plan, or the same with compiled regions
    else:
        # the kernels the costs were measured with (a simulated cost measured none: the plan's own choice)
        module = OptimizedModule(graph, outcome.schedules[method], operator=outcome.kernels, device=device,
                                 guard=Guard.of(rest, held))
        if options["verify"]:
            from opsched.compare import compare_outputs

            with torch.inference_mode():
                verdict = compare_outputs(module(*rest), gm(*inputs))
            if not verdict.ok:
                raise VerificationError(f"the schedule's outputs differ from the graph's: {verdict.why}")
    guard = module.guard

    def run(*args: Any) -> Any:
        with torch.inference_mode():
            try:
                if not held.holds(args):  # a parameter replaced by another tensor
                    return gm.forward(*args)
                flat = guard.check(held.rest(args))
            except (SignatureMismatch, StaleWeights):
                return gm.forward(*args)
            return module.run(flat)

    run.module = module  # for inspection: the schedule and program that run
    return run
