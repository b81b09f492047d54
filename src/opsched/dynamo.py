"""``torch.compile(model, backend="opsched")``: the same pipeline behind PyTorch's own front door.

Dynamo traces the model and hands each graph it captured (several, where the model has graph breaks) to
:func:`opsched_backend` with example inputs. Each graph goes through the pipeline: capture -> Graph -> cost
model -> scheduler -> Schedule -> OptimizedModule, and the compiled schedule replaces it. The backend is
registered under the name ``opsched`` through the ``torch_dynamo_backends`` entry point, so installing
opsched is enough::

    fast = torch.compile(model, backend="opsched")
    fast = torch.compile(model, backend="opsched", options={"method": "lios", "cost": "sim:v100"})

Options: ``method`` (default ``ios``), ``cost`` (``measured``, the default, profiled here and cached, or
``sim:NAME``), ``kernels`` (``eager`` or ``inductor``), ``verify`` (default True: the schedule's outputs
are compared with the graph's own on the example inputs, and a schedule that differs is not used).

opsched schedules inference: a graph that needs gradients, or that dynamo traced with symbolic shapes, runs
as dynamo gave it (a warning says why), as does a graph opsched cannot capture or verify. The compiled
schedule runs in inference mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

OPTIONS = {"method": "ios", "cost": "measured", "kernels": "eager", "verify": True}


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


def _unschedulable(example_inputs: Sequence[Any]) -> str | None:
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            return f"an input is a {type(x).__name__} (symbolic shapes), not a tensor"
        if x.requires_grad and torch.is_grad_enabled():
            return "the graph needs gradients and opsched schedules inference"
    return None


def _schedule(gm: torch.fx.GraphModule, inputs: tuple, options: dict[str, Any]) -> Callable[..., Any]:
    from opsched.compare import compare_outputs
    from opsched.errors import VerificationError
    from opsched.graph.capture import capture
    from opsched.pipeline import cost_model, method_options, search
    from opsched.runtime.module import OptimizedModule

    graph = capture(gm, inputs, name=f"dynamo-{type(gm).__name__}")
    device = "cuda" if inputs and inputs[0].is_cuda else "cpu"
    cost, kernels = cost_model(graph, inputs, options["cost"], device=device, kernels=options["kernels"])
    schedule = search(graph, cost, options["method"], **method_options(options["method"]))
    # the kernels the costs were measured with (a simulated cost measured none: the plan's own choice)
    module = OptimizedModule(graph, schedule, operator=kernels, device=device)
    if options["verify"]:
        with torch.inference_mode():
            verdict = compare_outputs(module(*inputs), gm(*inputs))
        if not verdict.ok:
            raise VerificationError(f"the schedule's outputs differ from the graph's: {verdict.why}")

    def run(*args: Any) -> Any:
        with torch.inference_mode():
            return module(*args)

    run.module = module  # for inspection: the schedule and program that run
    return run
