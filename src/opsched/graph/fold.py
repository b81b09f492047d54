"""Inference batch norm folded into the convolution before it.

With running statistics, batch norm is a per-channel scale and shift, and a convolution followed by it is a
convolution with scaled filters and a shifted bias: one kernel instead of a convolution and an element-wise
pass over its output. The result equals the two up to floating-point rounding. The IOS operator merge
(:mod:`opsched.runtime.merge`) folds before it stacks filters; a model batch (:mod:`opsched.multi.stack`)
folds before it batches the models' units, where the batch norm's element-wise pass is as slow as the
convolutions it follows.

>>> import torch
>>> from opsched.graph.capture import capture
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
>>> _ = model[1].running_mean.uniform_(), model[1].running_var.uniform_(1, 2)
>>> x = torch.randn(1, 3, 8, 8)
>>> unit = capture(model, (x,)).nodes[0].run
>>> folded = fold_batch_norms(unit)
>>> [n.target.__name__ for n in folded.graph.nodes if n.op == "call_function"]
['conv2d.default', 'relu_.default']
>>> torch.allclose(folded(x), unit(x), atol=1e-5)
True
"""

from __future__ import annotations

import copy
import hashlib
import operator
import weakref
from typing import Any, NamedTuple

import torch
from torch import fx

from opsched.graph.ops import get_attr_value

aten = torch.ops.aten
_CONVOLUTIONS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default}


class BatchNorm(NamedTuple):
    """An inference batch norm of an FX graph: its operands (nodes, or None) and the node of its output."""

    input: Any
    weight: Any
    bias: Any
    mean: Any
    var: Any
    eps: float
    output: fx.Node


def inference_batch_norm(node: fx.Node) -> BatchNorm | None:
    """``node`` as an inference batch norm: ``aten.batch_norm`` with ``training=False``, or the value of
    ``_native_batch_norm_legit_no_training`` (what torch.export captures); None for anything else."""
    if node.op != "call_function":
        return None
    if node.target in (aten.batch_norm.default, torch.nn.functional.batch_norm):
        args = _batch_norm_args(node)
        if args["training"]:
            return None
        return BatchNorm(args["input"], args["weight"], args["bias"], args["running_mean"], args["running_var"],
                         args["eps"], node)
    if node.target is aten._native_batch_norm_legit_no_training.default:
        x, weight, bias, mean, var, _momentum, eps = node.args
        values = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        if len(values) != 1 or len(node.users) != 1:
            return None
        return BatchNorm(x, weight, bias, mean, var, eps, values[0])
    return None


def _batch_norm_args(node: fx.Node) -> dict[str, Any]:
    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    values = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    values.update(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    return values


# Folds made, by what the tensors they were made from hold (see _held): weak references to the tensors first
# folded, the folded pair
_FOLDS: dict[tuple, tuple[list, tuple[torch.Tensor, torch.Tensor]]] = {}
# a batch norm's statistics and a bias this small are told by their values: a copy of a model has buffers of its
# own, equal to the model's (a weight is told by its memory: a model batch finds shared work by it)
_BY_VALUE_BYTES = 1 << 16


def _folded_once(sources: list[torch.Tensor | None], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`folded_conv` of ``sources``, the very same tensors each time it is asked for unchanged tensors over
    the same memory: two models that share a module still share its folded weights, which is how a model batch
    finds their shared work (by storage, :mod:`opsched.multi.shared`), and the plans built from copies of one model
    (:func:`~opsched.models.sharing.sharing_copy`) hold one folded weight, not one each. A source changed in place
    since makes a new fold; a fold is forgotten when one of the tensors it was first made from is collected (its
    memory could then be another tensor's), and by :func:`forget_folds`."""
    present = [(k, t) for k, t in enumerate(sources) if t is not None]
    held = [_held(t, k > 0) if t is not None else None for k, t in enumerate(sources)]
    key = (tuple(held), eps)
    made = _FOLDS.get(key)
    if made is not None and all(ref() is not None and (ref() is t or _held(ref(), k > 0) == held[k])
                                for ref, (k, t) in zip(made[0], present, strict=True)):
        return made[1]
    with torch.no_grad():
        pair = folded_conv(*[t.detach() if t is not None else None for t in sources], eps)
    _FOLDS[key] = ([weakref.ref(t) for _, t in present], pair)
    for _, t in present:
        weakref.finalize(t, _FOLDS.pop, key, None)
    return pair


def forget_folds(tensors: list[torch.Tensor]) -> None:
    """Forget every fold made from the memory of one of ``tensors``: they were written where no version counter
    sees it (through ``.data``, or an inference tensor in inference mode); the folds of their old values are no
    use any more."""
    addresses = {t.data_ptr() for t in tensors if t.device.type != "meta"}
    for key in list(_FOLDS):
        if any(part is not None and part[0] in addresses for part in key[0]):
            _FOLDS.pop(key, None)


def _held(t: torch.Tensor, by_value: bool = True) -> tuple:
    """What makes two tensors the same values: with ``by_value``, their values where they are small; else the
    same memory read the same way, holding the same values (a hash of them: a write through ``.data`` or a NumPy
    view moves no version counter, and a fold found by memory and version alone answered with the weights before
    it, in a capture made after it). A ``meta`` tensor has neither values nor memory (every one's address is 0):
    itself."""
    if t.device.type == "meta":
        return id(t), t.shape
    values = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # (a 0-d tensor has no byte view)
    if by_value and t.numel() * t.element_size() <= _BY_VALUE_BYTES:
        return "values", t.shape, t.dtype, t.device, values.tobytes()
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, hashlib.sha256(memoryview(values)).hexdigest()


def folded_conv(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor | None,
                beta: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of a convolution (output channels first) followed by an inference batch norm."""
    scale = torch.rsqrt(var + eps)
    if gamma is not None:
        scale = scale * gamma
    shift = -mean * scale if beta is None else beta - mean * scale
    shape = (-1,) + (1,) * (weight.dim() - 1)
    return weight * scale.reshape(shape), shift if bias is None else bias * scale + shift


def fold_batch_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` in which every inference batch norm that is the only reader of a (not transposed)
    convolution, all of whose operands are attributes of ``gm``, is folded into that convolution; ``gm``
    itself if there is none. ``gm`` and its tensors are left as they are; the copy holds only the tensors its
    graph reads."""
    folded = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    graph = folded.graph
    folds = 0
    for node in list(graph.nodes):
        bn = inference_batch_norm(node)
        conv = bn.input if bn is not None else None
        if conv is None or not _foldable(conv, bn):
            continue
        conv_bias = conv.args[2] if len(conv.args) > 2 else None

        def value(n: Any) -> torch.Tensor | None:
            return get_attr_value(n, folded) if isinstance(n, fx.Node) else None

        tensors = _folded_once([value(conv.args[1]), value(conv_bias), value(bn.weight), value(bn.bias),
                                value(bn.mean), value(bn.var)], bn.eps)
        base = "".join(c if c.isalnum() else "_" for c in str(conv.args[1].target))  # named after the weight
        names = (f"{base}_folded_{folds}", f"{base}_folded_{folds}_bias")
        for name, tensor in zip(names, tensors):
            folded.register_buffer(name, tensor)
        with graph.inserting_before(conv):
            weight_node, bias_node = (graph.get_attr(name) for name in names)
        args = list(conv.args) + [None] * (3 - len(conv.args))
        conv.args = (args[0], weight_node, bias_node, *args[3:])
        bn.output.replace_all_uses_with(conv)
        folds += 1
    if not folds:
        return gm
    graph.eliminate_dead_code()
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name in [*dict(folded.named_parameters()), *dict(folded.named_buffers())]:
        if name not in read:  # the batch norm's statistics and the convolution's old weights
            owner, _, attribute = name.rpartition(".")
            delattr(folded.get_submodule(owner), attribute)
    folded.recompile()
    return folded


def _foldable(conv: Any, bn: BatchNorm) -> bool:
    if not isinstance(conv, fx.Node) or conv.target not in _CONVOLUTIONS or len(conv.users) != 1:
        return False
    if conv.target is aten.convolution.default and conv.args[6]:  # transposed: channels are not first
        return False
    operands = [conv.args[1], conv.args[2] if len(conv.args) > 2 else None, bn.weight, bn.bias, bn.mean, bn.var]
    return (isinstance(bn.mean, fx.Node) and isinstance(bn.var, fx.Node) and not conv.kwargs
            and all(o is None or (isinstance(o, fx.Node) and o.op == "get_attr") for o in operands))
