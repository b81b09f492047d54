"""A plan's outputs where the model's would carry gradients: the same values, and a backward pass through them
raises :class:`~opsched.errors.NoGradient` rather than leaving the weights without their gradients.

A plan runs in inference mode: its outputs are inference tensors, with no autograd history. Called in grad mode,
the model's outputs require gradients through its weights. Handed back as they are, a plan's outputs silently
lost those gradients: ``cross_entropy`` on them gave a loss that needed none, and a loss that added a weight
penalty trained the penalty alone. Each output is instead copied out of inference mode (an inference tensor
cannot join an autograd graph) through a function whose backward refuses, so that it requires gradients as the
model's does, and training through it fails in one line.

>>> import torch
>>> layer = torch.nn.Linear(3, 2)
>>> with torch.inference_mode():
...     planned = layer(torch.ones(1, 3))
>>> out = without_gradients(planned, layer.weight)
>>> out.requires_grad, torch.equal(out, planned)
(True, True)
>>> out.sum().backward()
Traceback (most recent call last):
...
opsched.errors.NoGradient: the optimized module's outputs carry no gradient to the model's weights (its plans run in inference mode): train the model itself, or call the optimized module under torch.no_grad() or torch.inference_mode()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.errors import NoGradient


class _Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise NoGradient("the optimized module's outputs carry no gradient to the model's weights (its plans run in "
                         "inference mode): train the model itself, or call the optimized module under "
                         "torch.no_grad() or torch.inference_mode()")


def without_gradients(outputs: Any, weight: torch.Tensor) -> Any:
    """``outputs`` (a plan's, nested as the model returns them), each floating-point tensor requiring gradients
    through ``weight`` (one of the model's weights that requires them) as the model's would, a backward pass
    through it raising :class:`~opsched.errors.NoGradient`."""
    return pytree.tree_map(lambda t: _Refused.apply(t, weight) if isinstance(t, torch.Tensor)
                           and (t.is_floating_point() or t.is_complex()) else t, outputs)


def in_grad_mode(outputs: Any, weights: list[torch.Tensor]) -> Any:
    """A plan's ``outputs`` as the caller gets them: as they are, unless grad mode is on and one of the model's
    ``weights`` requires gradients, in which case as :func:`without_gradients` gives them (a look at the flag
    where grad mode is off, a look at the weights' flags where it is on)."""
    if not torch.is_grad_enabled():
        return outputs
    weight = next((t for t in weights if t.requires_grad), None)
    return outputs if weight is None else without_gradients(outputs, weight)
