"""What capture needs to know about one FX node: its operator name, whether it is heavy, its FLOPs and
the hyper-parameters that decide merging.

FX graphs reach us at two levels: ATen ops from torch.export (``aten.conv2d.default``) and modules,
functions and methods from torch.fx.symbolic_trace (``nn.Conv2d``, ``torch.cat``, ``x.view``). Both are
reduced to one operator name (``conv2d``, ``cat``, ``view``) so that one grouping rule serves both.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

CONV = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d"}
MATMUL = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum", "scaled_dot_product_attention",
          "_scaled_dot_product_flash_attention_for_cpu", "embedding"}
POOL = {"max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d",
        "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
        "_adaptive_avg_pool2d", "adaptive_max_pool2d", "lp_pool2d"}
CONCAT = {"cat", "concat", "concatenate", "stack"}
HEAVY = CONV | MATMUL | POOL | CONCAT

# Module classes from torch.fx.symbolic_trace, named like the ATen operator they run.
_MODULE_OPS = {
    torch.nn.Conv1d: "conv1d", torch.nn.Conv2d: "conv2d", torch.nn.Conv3d: "conv3d",
    torch.nn.ConvTranspose2d: "conv_transpose2d", torch.nn.Linear: "linear",
    torch.nn.MaxPool2d: "max_pool2d", torch.nn.AvgPool2d: "avg_pool2d",
    torch.nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d", torch.nn.AdaptiveMaxPool2d: "adaptive_max_pool2d",
    torch.nn.MaxPool1d: "max_pool1d", torch.nn.AvgPool1d: "avg_pool1d", torch.nn.Embedding: "embedding",
    torch.nn.BatchNorm1d: "batch_norm", torch.nn.BatchNorm2d: "batch_norm", torch.nn.BatchNorm3d: "batch_norm",
    torch.nn.Identity: "identity", torch.nn.Dropout: "dropout", torch.nn.Flatten: "flatten",
}
_FUNCTION_OPS = {operator.getitem: "getitem", operator.add: "add", operator.mul: "mul", operator.sub: "sub",
                 operator.truediv: "div", operator.iadd: "add", operator.imul: "mul"}


def op_name(node: fx.Node, root: torch.nn.Module) -> str:
    """The operator an FX node runs, as a plain name shared by both FX levels."""
    if node.op == "call_module":
        mod = root.get_submodule(node.target)
        for cls, name in _MODULE_OPS.items():
            if type(mod) is cls:
                return name
        return type(mod).__name__.lower()
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    if target in _FUNCTION_OPS:
        return _FUNCTION_OPS[target]
    return getattr(target, "__name__", str(target))


def is_heavy(name: str) -> bool:
    return name in HEAVY


def tensor_meta(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of a node's tensor value, from torch.export's ``val`` or ShapeProp's ``tensor_meta``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), val.dtype
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(int(s) for s in tm.shape), tm.dtype
    return None


def numel(node: fx.Node) -> int:
    meta = tensor_meta(node)
    return math.prod(meta[0]) if meta else 0


def nbytes(node: fx.Node) -> int:
    meta = tensor_meta(node)
    if not meta:
        return 0
    return math.prod(meta[0]) * torch.empty((), dtype=meta[1]).element_size()


def _pair(v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v) if len(v) == n else tuple(int(v[0]) for _ in range(n))
    return tuple(int(v) for _ in range(n))


def conv_attrs(node: fx.Node, name: str, root: torch.nn.Module) -> dict[str, Any]:
    """Kernel, stride, padding, dilation, groups and channels of a convolution node."""
    if node.op == "call_module":
        mod = root.get_submodule(node.target)
        w_shape = tuple(mod.weight.shape)
        spatial = len(w_shape) - 2
        stride, padding, dilation, groups = mod.stride, mod.padding, mod.dilation, mod.groups
        transposed = isinstance(mod, torch.nn.modules.conv._ConvTransposeNd)
    else:
        kw = _kwargs(node)
        weight = kw.get("weight")
        if weight is None:
            return {}
        w_shape = tensor_meta(weight)[0] if isinstance(weight, fx.Node) and tensor_meta(weight) else None
        if w_shape is None:
            w_shape = tuple(get_attr_value(weight, root).shape)
        spatial = len(w_shape) - 2
        stride, padding = kw.get("stride", 1), kw.get("padding", 0)
        dilation, groups = kw.get("dilation", 1), kw.get("groups", 1)
        transposed = bool(kw.get("transposed", False)) or name.startswith("conv_transpose")
    kernel = tuple(int(k) for k in w_shape[2:])
    dilation = _pair(dilation, spatial)
    if isinstance(padding, str):
        # "same" pads by half the dilated kernel; "valid" not at all.
        padding = tuple((d * (k - 1)) // 2 for k, d in zip(kernel, dilation)) if padding == "same" else (0,) * spatial
    in_channels = int(w_shape[0] if transposed else w_shape[1] * int(groups))
    out_channels = int(w_shape[1] * int(groups) if transposed else w_shape[0])
    # the convolution's own output size: the unit's output may be smaller (a split or a pool after it)
    return {"kernel": kernel, "stride": _pair(stride, spatial), "padding": _pair(padding, spatial),
            "dilation": dilation, "groups": int(groups), "transposed": transposed,
            "in_channels": in_channels, "out_channels": out_channels, "out_elements": numel(node)}


def flops(node: fx.Node, name: str, root: torch.nn.Module) -> float:
    """Floating-point operations of one node (multiply-adds count two)."""
    out = numel(node)
    if name in CONV:
        attrs = conv_attrs(node, name, root)
        if not attrs:
            return 0.0
        per_output = 2 * attrs["in_channels"] // attrs["groups"] * math.prod(attrs["kernel"])
        if attrs["transposed"]:
            first = node.all_input_nodes[0]
            return float(numel(first) * 2 * attrs["out_channels"] // attrs["groups"] * math.prod(attrs["kernel"]))
        return float(out * per_output)
    if name in MATMUL:
        inputs = [a for a in node.all_input_nodes if tensor_meta(a)]
        if name == "linear" and node.op == "call_module":
            return float(2 * out * root.get_submodule(node.target).in_features)
        if name == "embedding":
            return 0.0
        if inputs:
            k = tensor_meta(inputs[0])[0][-1] if name not in {"addmm", "baddbmm"} else tensor_meta(inputs[1])[0][-1]
            return float(2 * out * k)
        return 0.0
    if name in POOL:
        first = node.all_input_nodes[0] if node.all_input_nodes else None
        if name.startswith(("adaptive", "_adaptive")) and first is not None:
            return float(numel(first))
        kw = _kwargs(node) if node.op == "call_function" else {}
        kernel = kw.get("kernel_size")
        if node.op == "call_module":
            kernel = getattr(root.get_submodule(node.target), "kernel_size", 1)
        return float(out * math.prod(_pair(kernel or 1, 2)))
    if name in CONCAT:
        return 0.0
    return float(out)


def _kwargs(node: fx.Node) -> dict[str, Any]:
    """A node's arguments by name (ATen schemas, or torch functions with known signatures)."""
    try:
        norm = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - a target with no known schema: fall back to positions below
        norm = None
    if norm is not None:
        return dict(norm.kwargs)
    names = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
    return {**dict(zip(names, node.args)), **node.kwargs}


def get_attr_value(node: fx.Node, root: torch.nn.Module) -> torch.Tensor:
    obj: Any = root
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def draws_random(gm: fx.GraphModule) -> str | None:
    """The first operator of ``gm`` that draws random numbers (``randn_like``, ``bernoulli``, a dropout in
    training mode), by name; None where none does. A plan runs operators in another order than the model,
    on other threads, with values in other layouts: it would draw other numbers. An operator that draws only
    for a dropout it is told not to apply (``dropout(x, p, train=False)``, attention with ``dropout_p=0``, as
    in eval mode) draws nothing. ATen operators (torch.export's units) are read from their tags; the functions,
    methods and modules of torch.fx's units through the ATen operators of the same name."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if module.training and type(module).__name__ in _RANDOM_IN_TRAINING:
                return type(module).__name__
            continue
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            overloads = [node.target]
        elif node.op in ("call_function", "call_method"):
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            packet = getattr(torch.ops.aten, str(name), None)
            overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
        else:
            continue
        drawing = [op for op in overloads if torch.Tag.nondeterministic_seeded in op.tags]
        if drawing and not _told_not_to_draw(node, drawing[0]):
            return drawing[0]._overloadpacket.__name__
    return None


# modules that draw in training mode (a unit of torch.fx keeps the model's modules)
_RANDOM_IN_TRAINING = {"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
                       "RReLU", "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
                       "Transformer", "TransformerEncoder", "TransformerDecoder", "RNN", "LSTM", "GRU"}


def _told_not_to_draw(node: fx.Node, op: torch._ops.OpOverload) -> bool:
    """Whether ``node`` calls the drawing operator ``op`` (or its Python function) with its dropout off."""
    for flag in ("training", "train"):
        if flag in node.kwargs:
            return node.kwargs[flag] is False
    arguments = {a.name for a in op._schema.arguments}
    if "train" in arguments or "training" in arguments:
        # (a Python function's flag not given is its default: torch.nn.functional.dropout's is True)
        return _argument(node, op, "train" if "train" in arguments else "training") is False
    if "dropout_p" in node.kwargs:
        return node.kwargs["dropout_p"] == 0
    return "dropout_p" in arguments and _argument(node, op, "dropout_p") == 0


def _argument(node: fx.Node, op: torch._ops.OpOverload, name: str) -> Any:
    """The value ``node`` passes for ``op``'s argument ``name``: given by position or keyword, or its default."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            if i < len(node.args) and not argument.kwarg_only:
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return argument.default_value if argument.has_default_value() else None
    return None
