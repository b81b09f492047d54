"""Training several models of one architecture as one (HiveMind's hyperparameter-search workload).

:class:`FusedTraining` holds the models' parameters stacked (one tensor per parameter, model ``k`` at index
``k``) and runs their forward as one program: ``vmap`` over the architecture's ``functional_call``, traced
with ``make_fx`` into plain ATen operators (convolutions become grouped convolutions, linear layers batched
matmuls). The sum of the models' losses has, for each slice of a stacked parameter, exactly the gradient
that model's own loss gives it alone, so :meth:`FusedTraining.step` with one learning rate per model is K
independent SGD runs in one. Batch norm's running statistics are not carried over from the fused run
(training uses batch statistics either way; only evaluation after training would see the difference).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from opsched.multi.combine import MultiError
from opsched.multi.optimize import model_batch


class FusedTraining(torch.nn.Module):
    """K models of one architecture as one trainable module: ``forward(*inputs)`` returns a tuple with each
    model's output on the shared ``inputs``; ``step(lrs)`` applies SGD to every model with its own rate.

    >>> import torch
    >>> models = [torch.nn.Linear(4, 3) for _ in range(2)]
    >>> fused = FusedTraining(models, (torch.randn(5, 4),))
    >>> x = torch.randn(5, 4)
    >>> a, b = fused(x)
    >>> torch.allclose(a, models[0](x)) and torch.allclose(b, models[1](x))
    True
    """

    def __init__(self, models: Sequence[torch.nn.Module], example_inputs: Any):
        super().__init__()
        batch = model_batch(models, example_inputs)
        if not batch.same_architecture:
            raise MultiError("fused training needs models of one architecture reading one input (a sweep)")
        self.count = len(batch.models)
        params, buffers = torch.func.stack_module_state(list(batch.models))
        self.names = list(params)
        self.buffer_names = list(buffers)
        self.stacked = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone()) for p in params.values())
        self.buffers_ = [b.clone() for b in buffers.values()]
        base = copy.deepcopy(batch.models[0]).to("meta").train()

        def one(p: dict, b: dict, *args: Any) -> Any:
            return torch.func.functional_call(base, (p, b), args)

        batched = torch.func.vmap(one, in_dims=(0, 0, *[None] * len(batch.inputs)), randomness="different")

        def forward(plist: list, blist: list, *args: Any) -> Any:
            return batched(dict(zip(self.names, plist)), dict(zip(self.buffer_names, blist)), *args)

        self.program = make_fx(forward)(list(self.stacked), self.buffers_, *batch.inputs)

    def forward(self, *inputs: Any) -> tuple:
        out = self.program(list(self.stacked), self.buffers_, *inputs)
        return tuple(out[k] for k in range(self.count))

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> None:
        """SGD on every model with its own learning rate, then the gradients cleared."""
        rates = torch.tensor(_rates(lrs, self.count), dtype=self.stacked[0].dtype)
        for p in self.stacked:
            if p.grad is not None:
                p.sub_(p.grad * rates.view(-1, *[1] * (p.dim() - 1)))
                p.grad = None

    def parameters_of(self, k: int) -> dict[str, torch.Tensor]:
        """Model ``k``'s parameters by name."""
        return {name: p[k] for name, p in zip(self.names, self.stacked)}


def _rates(lrs: Sequence[float], count: int) -> list[float]:
    if len(lrs) == 1:
        return list(lrs) * count
    if len(lrs) != count:
        raise MultiError(f"{len(lrs)} learning rates for {count} models: give one, or one per model")
    return list(lrs)


def compare_training(models: Sequence[torch.nn.Module], inputs: Sequence[Any], steps: int = 20,
                     lrs: Sequence[float] = (0.01,), cores: int | None = None, repeats: int = 15) -> dict[str, Any]:
    """Train copies of ``models`` (SGD, each with its rate; cross-entropy against fixed seeded random labels)
    one after another and fused, step by step interleaved: milliseconds per step (medians) and the largest
    difference between their parameters after ``steps`` steps (``max_param_diff``)."""
    torch.set_num_threads(cores or torch.get_num_threads())
    rates = _rates(lrs, len(models))
    apart = [copy.deepcopy(m).train() for m in models]
    fused = FusedTraining([copy.deepcopy(m).train() for m in models], inputs)
    batch = model_batch(apart, inputs)
    args = batch.inputs
    with torch.no_grad():
        classes = apart[0](*args).shape[-1]
    labels = torch.randint(classes, (args[0].shape[0],), generator=torch.Generator().manual_seed(0))
    optimizers = [torch.optim.SGD(m.parameters(), lr=r) for m, r in zip(apart, rates)]
    loss = torch.nn.functional.cross_entropy

    def step_apart() -> None:
        for m, opt in zip(apart, optimizers):
            opt.zero_grad()
            loss(m(*args), labels).backward()
            opt.step()

    def step_fused() -> None:
        sum(loss(out, labels) for out in fused(*args)).backward()
        fused.step(rates)

    times: dict[str, list[float]] = {"sequential_models": [], "fused": []}
    for _ in range(steps):
        for name, run in (("sequential_models", step_apart), ("fused", step_fused)):
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1e3)
    diff = max((fused.parameters_of(k)[name] - p).abs().max().item()
               for k, m in enumerate(apart) for name, p in m.named_parameters())
    ms = {name: statistics.median(t[1:] or t) for name, t in times.items()}  # the first step warms up
    return {"steps": steps, "models": len(models), "max_param_diff": diff, "ms_per_step": ms,
            "speedup": ms["sequential_models"] / ms["fused"]}
