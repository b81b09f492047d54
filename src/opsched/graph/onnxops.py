"""Operators that torch.export records and PyTorch's TorchScript ONNX exporter has no symbolic for, written as
ones it has, so that the units holding them can still run on ONNX Runtime.

torch.export captures a batch norm in inference as ``aten.batch_norm`` or, timm's among others, as
``aten._native_batch_norm_legit_no_training``. Most fold into the convolution they follow (:mod:`opsched.graph.fold`),
but one that reads no convolution stays: RepVGG's identity branch, a batch norm of the block's input. The exporter refused every unit holding one, so ``--kernels auto``
offered none of timm's RepVGG-A0 blocks to ONNX Runtime and its plan ran 1.62x the time of ONNX Runtime's own
session of the model (docs/sweep_auto_untuned.md). It is ``aten.batch_norm`` with ``training=False``, the same
arithmetic, which the exporter takes.

>>> import operator, torch
>>> from torch import fx
>>> root = torch.nn.Module()
>>> for name in ("weight", "bias", "mean"):
...     root.register_buffer(name, torch.randn(3))
>>> root.register_buffer("var", torch.rand(3) + 0.5)
>>> g = fx.Graph()
>>> x = g.placeholder("x")
>>> norm = g.call_function(torch.ops.aten._native_batch_norm_legit_no_training.default,
...                        (x, *[g.get_attr(n) for n in ("weight", "bias", "mean", "var")], 0.1, 1e-5))
>>> _ = g.output(g.call_function(operator.getitem, (norm, 0)))
>>> gm = fx.GraphModule(root, g)
>>> exportable = exportable_batch_norms(gm)
>>> [str(n.target) for n in exportable.graph.nodes if n.op == "call_function"]
['aten.batch_norm.default']
>>> x = torch.randn(2, 3, 4, 4)
>>> torch.equal(exportable(x), gm(x))
True
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

_INFERENCE_NORM = torch.ops.aten._native_batch_norm_legit_no_training.default


def exportable_batch_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters) whose batch norms in inference are ``aten.batch_norm`` with
    ``training=False``. One whose saved statistics (its second and third outputs, empty in inference) are read
    is left as it is."""
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.target is not _INFERENCE_NORM:
            continue
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue
        x, weight, bias, mean, var, momentum, eps = node.args
        with graph.inserting_before(node):
            norm = graph.call_function(torch.ops.aten.batch_norm.default,
                                       (x, weight, bias, mean, var, False, momentum, eps, False))
        for user in users:
            norm.meta = dict(user.meta)
            user.replace_all_uses_with(norm)
            graph.erase_node(user)
        graph.erase_node(node)
    return fx.GraphModule(gm, graph)
