"""A plan's outputs handed back as the model's would be: the same values, as ordinary tensors outside inference
mode, and, in grad mode, requiring gradients where the model's do, with a backward pass through them refused.

A plan runs in inference mode, so its outputs are inference tensors. Handed back as they were:
- under ``torch.no_grad()``, an output changed in place (``logits.div_(t)``, ``boxes.clamp_(0)``) raised
  "Inplace update to inference tensor outside InferenceMode", where the model's output takes it;
- in grad mode, with the model's weights requiring gradients, they silently lost the gradients the model's
  outputs carry: ``cross_entropy`` on them gave a loss that needed none, and a loss adding a weight penalty
  trained the penalty alone.

Outside inference mode each output is now copied into an ordinary tensor (once per tensor: an output returned
twice stays one tensor), and in grad mode those the model's own outputs require gradients for go through a
function whose backward raises :class:`~opsched.errors.NoGradient`. Under ``torch.inference_mode()`` the
outputs are handed back as they are, as the model's would be inference tensors too.

>>> import torch
>>> layer = torch.nn.Linear(3, 2)
>>> with torch.inference_mode():
...     planned = layer(torch.ones(1, 3))
>>> out = as_the_model_gives(planned, [layer.weight])
>>> out.requires_grad, out.is_inference(), torch.equal(out, planned)
(True, False, True)
>>> out.sum().backward()
Traceback (most recent call last):
...
opsched.errors.NoGradient: the optimized module's outputs carry no gradient to the model's weights (its plans run in inference mode): train the model itself, or call the optimized module under torch.no_grad() or torch.inference_mode()
"""

from __future__ import annotations

from collections.abc import Sequence
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


def as_the_model_gives(outputs: Any, weights: Sequence[torch.Tensor], needs_grad: Sequence[bool] | None = None) -> Any:
    """A plan's ``outputs`` (nested as the model returns them) as the caller gets them; ``weights``: the model's,
    ``needs_grad``: for each output leaf, whether the model's requires gradients when its weights do (None: each
    floating-point or complex one)."""
    if torch.is_inference_mode_enabled():
        return outputs
    weight = next((t for t in weights if t.requires_grad), None) if torch.is_grad_enabled() else None
    if weight is None:  # the common calls, without pytree's walk (sixteen outputs: 21 µs a call against 37)
        if type(outputs) is torch.Tensor:
            return outputs.clone() if outputs.is_inference() else outputs
        if type(outputs) is tuple and set(map(type, outputs)) == _TENSOR and all(map(_INFERENCE, outputs)) \
                and len(set(map(id, outputs))) == len(outputs):
            return tuple(map(torch.Tensor.clone, outputs))
    leaves, structure = pytree.tree_flatten(outputs)
    copies: dict[int, torch.Tensor] = {}
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_inference():
            continue
        if id(leaf) not in copies:
            grad = weight is not None and (leaf.is_floating_point() or leaf.is_complex()) and \
                (needs_grad is None or k >= len(needs_grad) or needs_grad[k])
            copies[id(leaf)] = _Refused.apply(leaf, weight) if grad else leaf.clone()
        leaves[k] = copies[id(leaf)]
    return pytree.tree_unflatten(leaves, structure)


_TENSOR = {torch.Tensor}
_INFERENCE = torch.Tensor.is_inference


def grad_pattern(outputs: Any) -> tuple[bool, ...]:
    """For each leaf of the model's ``outputs`` (a call in grad mode), whether it requires gradients."""
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(outputs))
