"""A copy of a model that shares its parameters' memory: what opsched captures instead of the model itself.

Capturing a model disturbs it while it runs (torch.export swaps its parameters for its own tensors, torch.fx
swaps its modules), so opsched never captures a model that may answer calls meanwhile: a plan's build in the
background, or a server preparing its plans while the model answers. It captures a copy. ``copy.deepcopy`` made
that copy with weights of its own, one more full set of weights per copy (a served ResNet-18 held three). The
copy here has new module objects and new ``Parameter`` objects over the very same memory, with the same version
counters (so a change made to the model in place is the copy's too, and a plan built from the copy sees it as a
change of weights, see :class:`~opsched.runtime.guards.WeightWatch`). Buffers are copied: a forward may write its
buffers (a counter, a cache), and the copy's writes must not reach the model.

Nothing opsched does writes a captured model's parameters in place; what trains (``opsched.multi.train``)
copies with ``copy.deepcopy``. A plan that shares the model's memory may only run while the model's weights
are watched on every call (a change is seen before a plan runs, and its plans are made again): where they are
not (``follow_weights=False``), plans are built from a copy of their own, :func:`build_copy`, so that a change
not announced is answered with the old weights, all of them, and never with a mix of old and new.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
>>> twin = sharing_copy(model)
>>> twin[0] is model[0], twin[0].weight is model[0].weight, twin[0].weight.data_ptr() == model[0].weight.data_ptr()
(False, False, True)
>>> twin[1].running_mean.data_ptr() == model[1].running_mean.data_ptr()
False
>>> with torch.no_grad():
...     _ = model[0].weight.mul_(2)
>>> twin[0].weight._version == model[0].weight._version, torch.equal(twin[0].weight, model[0].weight)
(True, True)
"""

from __future__ import annotations

import copy

import torch


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)``, except that each parameter of the copy is a new ``Parameter`` over the same
    memory as the model's (a parameter shared by two modules stays shared in the copy); a parameter of a subclass
    of its own, and one over an inference tensor (made in inference mode: a ``Parameter`` over it cannot be made
    outside), is copied as ``copy.deepcopy`` copies it. Raises what ``copy.deepcopy`` raises for a model that
    cannot be copied."""
    memo: dict[int, object] = {}
    for parameter in model.parameters():
        if type(parameter) is torch.nn.Parameter and not parameter.is_inference():
            memo[id(parameter)] = torch.nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad)
    return copy.deepcopy(model, memo)


def build_copy(model: torch.nn.Module, follow_weights: bool) -> torch.nn.Module:
    """The copy of ``model`` to build plans from: :func:`sharing_copy` where its weights are watched on every
    call (``follow_weights``), else ``copy.deepcopy`` (see the module's docstring)."""
    return sharing_copy(model) if follow_weights else copy.deepcopy(model)
