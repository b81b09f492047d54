"""K models of one architecture as one program in the channel-stacked layout (fused training's forward).

The architecture is traced once with ``torch.fx.symbolic_trace`` and rewritten node by node. Every value
that depends on the models' parameters lives stacked along its channel dimension: a per-model
``(N, C, H, W)`` is one ``(N, K*C, H, W)``, model ``k``'s channels at ``[k*C, (k+1)*C)``, from the first
layer to the last with no permute between layers. Per node:

- ``Conv1d/2d/3d`` becomes one convolution with the K weights concatenated along output channels (a view of
  the stacked weight) and the stacked bias given to the convolution itself. Reading the shared input, it
  keeps the layer's own ``groups`` and reads the input once; reading stacked channels, ``groups`` becomes
  ``K * groups``.
- ``BatchNorm1d/2d/3d`` becomes one ``F.batch_norm`` over ``K*C`` channels with the stacked weight, bias and
  running statistics (views of the stacked buffers, updated in place in training mode, and
  ``num_batches_tracked`` counted): per-channel batch statistics are exactly per-model statistics.
- Element-wise activations, pooling, ``Flatten(1)`` and ``view(N, -1)`` run unchanged on the stacked layout
  (a flattened ``(N, K*F)`` still holds model ``k`` at block ``k``). Residual ``+``/``*`` between values of
  one shape (or broadcast over spatial dimensions) are element-wise too.
- ``Linear`` reading the shared input is one matrix product with the K weights stacked (output ``(N, K*O)``,
  stacked channels). Reading stacked features ``(N, K*F)`` it is a batched matmul on ``(K, N, F)``, output
  ``(K, N, O)`` (the *models* layout), which later ``Linear`` layers and element-wise ops keep.
- Dropout draws one mask over the stacked tensor: each model gets its own independent mask, as it would
  alone, but not the random numbers it would draw alone (so with dropout active, fused and one-after-another
  training agree in distribution, not bit for bit). Dropout reading the shared input is first repeated per
  model, so that no two models share a mask.

For speed, a ReLU read only by a max pooling runs after it (:func:`_relus_before_max_pools`, exact), global
average pooling's backward is an expanded view (:class:`_GlobalAveragePool`, the same bits), and the
program runs in ``channels_last`` memory format (the same values up to the convolutions' summation order).

Anything else (an unknown module or function, a parameter used outside its module, a view that mixes the
batch and channel dimensions, several outputs, ...) raises :class:`NotStackable`, whose message names the
node; :class:`opsched.multi.train.FusedTraining` then falls back to ``vmap``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

SHARED, CHANNELS, MODELS = "shared", "channels", "models"  # the same for every model; (N, K*C, ...); (K, N, ...)


class NotStackable(Exception):
    """The architecture holds something the channel-stacked rewrite does not know; the message says what."""


_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
                        nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Identity)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                 nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.LPPool1d, nn.LPPool2d)
_DROPOUTS = {nn.Dropout: F.dropout, nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d}
_ELEMENTWISE_FUNCTIONS = {torch.relu, torch.relu_, F.relu, F.relu_, torch.sigmoid, torch.tanh, F.gelu, F.silu,
                          F.mish, F.leaky_relu, F.elu, F.selu, F.relu6, F.hardtanh, F.hardswish, F.hardsigmoid,
                          F.softplus}
_ELEMENTWISE_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "contiguous", "clone"}
_POOL_FUNCTIONS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1, F.avg_pool2d: 2,
                   F.avg_pool3d: 3, F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
                   F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3}  # spatial dims
_BINARY_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.imul,
                     torch.add, torch.sub, torch.mul, torch.div}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}


class _Value:
    """A rewritten value: its node in the new graph (or a Python constant), its layout and its shape in one
    model (``None`` for non-tensors)."""

    __slots__ = ("layout", "node", "shape")

    def __init__(self, node: Any, layout: str | None, shape: tuple[int, ...] | None = None):
        self.node, self.layout, self.shape = node, layout, shape


def trace(base: nn.Module, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """``base`` traced by ``torch.fx`` with every node's shape for one model on ``example_inputs``."""
    try:
        traced = fx.symbolic_trace(copy.deepcopy(base))
    except Exception as e:  # noqa: BLE001 - data-dependent control flow and the like; one line, then vmap
        raise NotStackable(f"torch.fx cannot trace the architecture: {type(e).__name__}: {e}") from None
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise NotStackable(f"the architecture takes {len(placeholders)} arguments, {len(example_inputs)} given")
    shapes = copy.deepcopy(traced).eval()
    try:
        with torch.no_grad():
            ShapeProp(shapes).propagate(*example_inputs)
    except Exception as e:  # noqa: BLE001 - the traced code fails where the module did not; one line, then vmap
        raise NotStackable(f"the traced architecture does not run: {type(e).__name__}: {e}") from None
    for mine, theirs in zip(traced.graph.nodes, shapes.graph.nodes):
        mine.meta["tensor_meta"] = theirs.meta.get("tensor_meta")
    return traced


def channel_stacked(traced: fx.GraphModule, count: int, param_names: Sequence[str], buffer_names: Sequence[str],
                    training: bool, dropout: bool | None = None, channels_last: bool = True) -> fx.GraphModule:
    """The program ``program(params, buffers, *inputs)`` computing ``count`` models of ``traced``'s
    architecture at once: ``params`` and ``buffers`` are the stacked tensors (model ``k`` at index ``k``) in
    the order of ``param_names`` and ``buffer_names``; it returns the models' outputs as one tensor, model
    ``k``'s at index ``k``. ``training`` is batch norm's mode (batch statistics, running statistics
    updated) and, unless ``dropout`` says otherwise, dropout's. With ``channels_last``, a 4-D value entering
    the stacked layout is made ``torch.channels_last`` (convolution, batch norm and pooling keep it): the
    same values up to rounding (the convolutions sum in another order), and on this CPU max pooling and
    batch norm over ``K*C`` channels run several times faster vectorised over channels. Raises
    :class:`NotStackable`."""
    return _Rewrite(traced, count, param_names, buffer_names, training,
                    training if dropout is None else dropout, channels_last).run()


class _Rewrite:
    def __init__(self, traced: fx.GraphModule, count: int, param_names: Sequence[str], buffer_names: Sequence[str],
                 training: bool, dropout: bool, channels_last: bool):
        self.traced, self.k, self.training, self.dropout = traced, count, training, dropout
        self.channels_last = channels_last
        self.params = {n: i for i, n in enumerate(param_names)}
        self.buffers = {n: i for i, n in enumerate(buffer_names)}
        self.graph = fx.Graph()
        self.modules: dict[str, nn.Module] = {}
        self.env: dict[fx.Node, _Value] = {}
        self._fetched: dict[tuple[str, str], fx.Node] = {}

    # -- helpers ---------------------------------------------------------------------------------------------

    def fail(self, node: fx.Node, why: str) -> NotStackable:
        return NotStackable(f"node {node.name!r} ({node.op} {_target_name(node)}): {why}")

    def stacked(self, kind: str, name: str, node: fx.Node) -> fx.Node:
        index = (self.params if kind == "param" else self.buffers).get(name)
        if index is None:
            raise self.fail(node, f"{name} is not one of the models' own {kind}s (tied or shared?)")
        key = (kind, name)
        if key not in self._fetched:
            source = self.params_ph if kind == "param" else self.buffers_ph
            self._fetched[key] = self.graph.call_function(operator.getitem, (source, index))
        return self._fetched[key]

    def flat(self, kind: str, name: str, node: fx.Node) -> fx.Node:
        """The stacked ``(K, C, ...)`` tensor as ``(K*C, ...)`` (a view)."""
        return self.graph.call_method("flatten", (self.stacked(kind, name, node), 0, 1))

    def tensor(self, node: fx.Node, arg: Any) -> _Value:
        if not isinstance(arg, fx.Node) or self.env[arg].layout not in (SHARED, CHANNELS, MODELS):
            raise self.fail(node, "expected a tensor argument")
        return self.env[arg]

    def const(self, node: fx.Node, value: Any) -> Any:
        if _nodes(value):
            raise self.fail(node, "a tensor or computed value where a constant was expected")
        return value

    def channels(self, value: _Value) -> fx.Node:
        """The value in the channel-stacked layout (a shared value repeated once per model)."""
        if value.layout == CHANNELS:
            return value.node
        if value.layout == SHARED:
            repeated = self.graph.call_method("repeat", (value.node, 1, self.k, *[1] * (len(value.shape) - 2)))
            return self.entering(repeated, value.shape)
        raise AssertionError(value.layout)

    def entering(self, node: fx.Node, shape: tuple) -> fx.Node:
        """A value entering the stacked layout, in the memory format the program runs in."""
        if self.channels_last and len(shape) == 4:
            return self.graph.call_method("contiguous", (node,), {"memory_format": torch.channels_last})
        return node

    def models(self, value: _Value, expand: bool = False) -> fx.Node:
        """The value as ``(K, N, ...)`` (a view; a shared value broadcast, or expanded with ``expand``)."""
        if value.layout == MODELS:
            return value.node
        if value.layout == CHANNELS:
            split = self.graph.call_method("unflatten", (value.node, 1, (self.k, value.shape[1])))
            return self.graph.call_method("transpose", (split, 0, 1))
        unsqueezed = self.graph.call_method("unsqueeze", (value.node, 0))
        if not expand:
            return unsqueezed
        return self.graph.call_method("expand", (unsqueezed, self.k, *[-1] * len(value.shape)))

    # -- the walk ----------------------------------------------------------------------------------------------

    def run(self) -> fx.GraphModule:
        self.params_ph = self.graph.placeholder("params")
        self.buffers_ph = self.graph.placeholder("buffers")
        self.relu_after = {pool: relu for relu, pool in _relus_before_max_pools(self.traced)}
        deferred = set(self.relu_after.values())
        for node in self.traced.graph.nodes:
            if node in deferred:  # computed after the max pooling that is its only reader
                self.env[node] = self.env[node.args[0]]
                continue
            meta = node.meta.get("tensor_meta")
            shape = tuple(meta.shape) if isinstance(meta, fx.passes.shape_prop.TensorMetadata) else None
            if node.op == "placeholder":
                if shape is None:
                    raise self.fail(node, "an input that is not a tensor")
                self.env[node] = _Value(self.graph.placeholder(node.name), SHARED, shape)
            elif node.op == "output":
                self.output(node)
            elif node.op == "get_attr":
                raise self.fail(node, "a parameter or buffer used outside its module")
            elif node.op == "call_module":
                self.env[node] = self.module(node, self.traced.get_submodule(node.target), shape)
            elif node.op == "call_function":
                self.env[node] = self.function(node, shape)
            elif node.op == "call_method":
                self.env[node] = self.method(node, shape)
            else:
                raise self.fail(node, "unknown node kind")
        program = fx.GraphModule(self.modules, self.graph, class_name="ChannelStacked")
        program.graph.lint()
        return program

    def output(self, node: fx.Node) -> None:
        result = node.args[0]
        if not isinstance(result, fx.Node) or self.env[result].layout not in (SHARED, CHANNELS, MODELS):
            raise self.fail(node, "the architecture must return one tensor")
        value = self.env[result]
        if len(value.shape) < 2 and value.layout != MODELS:
            raise self.fail(node, "an output without batch and feature dimensions")
        self.graph.output(self.models(value, expand=True))

    def module(self, node: fx.Node, m: nn.Module, shape: tuple | None) -> _Value:
        g = self.graph
        if type(m) in _CONVS:
            return self.conv(node, m, shape)
        if type(m) in _NORMS:
            return self.norm(node, m, shape)
        if type(m) is nn.Linear:
            return self.linear(node, m, shape)
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            raise self.fail(node, f"{type(m).__name__} has parameters or buffers the rewrite does not know")
        x = self.tensor(node, node.args[0])
        if len(node.args) != 1 or node.kwargs:
            raise self.fail(node, "a module called with more than one argument")
        if type(m) in _ELEMENTWISE_MODULES:
            self.modules[node.target] = m
            return _Value(g.call_module(node.target, (x.node,)), x.layout, shape)
        if type(m) in _POOL_MODULES:
            if getattr(m, "return_indices", False):
                raise self.fail(node, "pooling that returns indices")
            if x.layout == MODELS:
                raise self.fail(node, "pooling after a Linear layer")
            self._batched(node, x, int(type(m).__name__[-2]))  # MaxPool2d: 2 spatial dimensions
            if type(m) is nn.AdaptiveAvgPool2d and m.output_size in (1, (1, 1)) and x.layout == CHANNELS:
                return _Value(g.call_function(global_average_pool, (x.node,)), x.layout, shape)
            self.modules[node.target] = m
            return self.pooled(node, g.call_module(node.target, (x.node,)), x.layout, shape)
        if type(m) is nn.Flatten:
            return self.flatten(node, x, m.start_dim, m.end_dim, shape)
        if type(m) in _DROPOUTS:
            return self.drop(node, x, _DROPOUTS[type(m)], m.p, m.inplace, shape)
        raise self.fail(node, f"{type(m).__name__} is not known to the channel-stacked rewrite")

    def pooled(self, node: fx.Node, out: fx.Node, layout: str, shape: tuple | None) -> _Value:
        """A pooling's result, with the ReLU before it applied now if it was moved past it."""
        if node in self.relu_after:
            out = self.graph.call_function(torch.relu, (out,))
        return _Value(out, layout, shape)

    def _batched(self, node: fx.Node, x: _Value, spatial: int) -> None:
        if len(x.shape) != spatial + 2:
            raise self.fail(node, f"an input of {len(x.shape)} dimensions where ({spatial + 2}, batched) were expected")

    def conv(self, node: fx.Node, m: nn.Module, shape: tuple | None) -> _Value:
        x = self.tensor(node, node.args[0])
        if m.padding_mode != "zeros":
            raise self.fail(node, f"padding_mode={m.padding_mode!r}")
        if x.layout == MODELS:
            raise self.fail(node, "a convolution after a Linear layer")
        self._batched(node, x, len(m.kernel_size))
        weight = self.flat("param", f"{node.target}.weight", node)
        bias = self.flat("param", f"{node.target}.bias", node) if m.bias is not None else None
        if x.layout == SHARED and m.groups == 1:  # the shared input read once, K*C_out filters
            groups, data = 1, self.entering(x.node, x.shape)
        else:
            groups, data = self.k * m.groups, self.channels(x)
        out = self.graph.call_function(_CONVS[type(m)], (data, weight, bias, m.stride, m.padding, m.dilation, groups))
        return _Value(out, CHANNELS, shape)

    def norm(self, node: fx.Node, m: nn.Module, shape: tuple | None) -> _Value:
        x = self.tensor(node, node.args[0])
        if x.layout == MODELS:
            raise self.fail(node, "batch norm after a Linear layer")
        if len(x.shape) < 2:
            raise self.fail(node, "batch norm of an unbatched input")
        if m.momentum is None and m.track_running_stats and self.training:
            raise self.fail(node, "batch norm with momentum=None (a cumulative average)")
        g = self.graph
        weight = self.flat("param", f"{node.target}.weight", node) if m.affine else None
        bias = self.flat("param", f"{node.target}.bias", node) if m.affine else None
        if m.track_running_stats:
            mean = self.flat("buffer", f"{node.target}.running_mean", node)
            var = self.flat("buffer", f"{node.target}.running_var", node)
            if self.training:
                g.call_method("add_", (self.stacked("buffer", f"{node.target}.num_batches_tracked", node), 1))
            batch_stats = self.training
        else:
            mean = var = None
            batch_stats = True
        out = g.call_function(F.batch_norm, (self.channels(x), mean, var, weight, bias, batch_stats,
                                             m.momentum or 0.0, m.eps))
        return _Value(out, CHANNELS, shape)

    def linear(self, node: fx.Node, m: nn.Linear, shape: tuple | None) -> _Value:
        x = self.tensor(node, node.args[0])
        g = self.graph
        if x.layout == SHARED:
            if len(x.shape) != 2:
                raise self.fail(node, "a Linear layer on a shared input of other than two dimensions")
            weight = self.flat("param", f"{node.target}.weight", node)
            bias = self.flat("param", f"{node.target}.bias", node) if m.bias is not None else None
            return _Value(g.call_function(F.linear, (x.node, weight, bias)), CHANNELS, shape)
        if len(x.shape) != 2:
            raise self.fail(node, "a Linear layer on other than (batch, features)")
        data = self.models(x)  # (K, N, F)
        weight = g.call_method("transpose", (self.stacked("param", f"{node.target}.weight", node), 1, 2))
        if m.bias is None:
            out = g.call_function(torch.bmm, (data, weight))
        else:
            bias = g.call_method("unsqueeze", (self.stacked("param", f"{node.target}.bias", node), 1))
            out = g.call_function(torch.baddbmm, (bias, data, weight))
        return _Value(out, MODELS, shape)

    def flatten(self, node: fx.Node, x: _Value, start: int, end: int, shape: tuple | None) -> _Value:
        ndim = len(x.shape)
        start, end = start % ndim if ndim else 0, end % ndim if ndim else 0
        if x.layout == SHARED:
            return _Value(self.graph.call_method("flatten", (x.node, start, end)), SHARED, shape)
        if x.layout == CHANNELS:
            if start != 1 or end != ndim - 1:
                raise self.fail(node, "a flatten other than of every dimension after the batch")
            return _Value(self.graph.call_method("flatten", (x.node, 1)), CHANNELS, shape)
        if start == 0:
            raise self.fail(node, "a flatten of the batch dimension after a Linear layer")
        return _Value(self.graph.call_method("flatten", (x.node, start + 1, end + 1)), MODELS, shape)

    def drop(self, node: fx.Node, x: _Value, fn: Any, p: float, inplace: bool, shape: tuple | None) -> _Value:
        if not self.dropout or p == 0:
            return x
        if fn is not F.dropout and x.layout == MODELS:
            raise self.fail(node, "channel dropout after a Linear layer")
        data = self.channels(x) if x.layout == SHARED else x.node  # every model its own mask
        layout = CHANNELS if x.layout == SHARED else x.layout
        return _Value(self.graph.call_function(fn, (data, p, True, inplace)), layout, shape)

    def function(self, node: fx.Node, shape: tuple | None) -> _Value:
        g, target = self.graph, node.target
        if target in _ELEMENTWISE_FUNCTIONS or target in _POOL_FUNCTIONS:
            x = self.tensor(node, node.args[0])
            rest, kwargs = self.const(node, node.args[1:]), self.const(node, dict(node.kwargs))
            if target in _POOL_FUNCTIONS:
                if x.layout == MODELS:
                    raise self.fail(node, "pooling after a Linear layer")
                if kwargs.get("return_indices") or any(a is True for a in rest):
                    raise self.fail(node, "pooling that returns indices")
                self._batched(node, x, _POOL_FUNCTIONS[target])
                if (target is F.adaptive_avg_pool2d and x.layout == CHANNELS and not kwargs
                        and tuple(rest) in ((1,), ((1, 1),))):
                    return _Value(g.call_function(global_average_pool, (x.node,)), x.layout, shape)
                return self.pooled(node, g.call_function(target, (x.node, *rest), kwargs), x.layout, shape)
            return _Value(g.call_function(target, (x.node, *rest), kwargs), x.layout, shape)
        if target in _BINARY_FUNCTIONS:
            return self.binary(node, target, node.args[0], node.args[1], shape, dict(node.kwargs))
        if target is torch.flatten:
            x = self.tensor(node, node.args[0])
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
            return self.flatten(node, x, self.const(node, start), self.const(node, end), shape)
        if target is torch.reshape:
            return self.reshape(node, node.args[0], node.args[1:], shape)
        if target is getattr and node.args[1] == "shape":
            x = self.tensor(node, node.args[0])
            return _Value(x, "shape")
        if (target is operator.getitem and isinstance(node.args[0], fx.Node)
                and self.env[node.args[0]].layout == "shape"):
            return self.size(node, self.env[node.args[0]].node, self.const(node, node.args[1]))
        raise self.fail(node, "a function the channel-stacked rewrite does not know")

    def method(self, node: fx.Node, shape: tuple | None) -> _Value:
        g, name = self.graph, node.target
        x = self.tensor(node, node.args[0])
        if name in _ELEMENTWISE_METHODS:
            rest, kwargs = self.const(node, node.args[1:]), self.const(node, dict(node.kwargs))
            return _Value(g.call_method(name, (x.node, *rest), kwargs), x.layout, shape)
        if name in _BINARY_METHODS:
            return self.binary(node, name, node.args[0], node.args[1], shape, dict(node.kwargs))
        if name == "size" and len(node.args) == 2 and not node.kwargs:
            return self.size(node, x, self.const(node, node.args[1]))
        if name == "flatten":
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
            return self.flatten(node, x, self.const(node, start), self.const(node, end), shape)
        if name in ("view", "reshape"):
            sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
            return self.reshape(node, node.args[0], sizes, shape)
        if name == "mean" or name == "sum":
            return self.reduce(node, x, name, shape)
        raise self.fail(node, "a method the channel-stacked rewrite does not know")

    def size(self, node: fx.Node, x: _Value, dim: Any) -> _Value:
        if not isinstance(dim, int):
            raise self.fail(node, "a size of other than one dimension")
        dim %= len(x.shape)
        if dim == 0:  # the batch: dynamic
            return _Value(self.graph.call_method("size", (x.node, 1 if x.layout == MODELS else 0)), "batch")
        if x.layout == MODELS:
            return _Value(self.graph.call_method("size", (x.node, dim + 1)), "int")
        if x.layout == CHANNELS and dim == 1:
            return _Value(x.shape[1], "int")
        return _Value(self.graph.call_method("size", (x.node, dim)), "int")

    def reshape(self, node: fx.Node, arg: Any, sizes: Sequence[Any], shape: tuple | None) -> _Value:
        x = self.tensor(node, arg)
        if x.layout == SHARED:
            if any(self.env[a].layout not in ("batch", "int") for a in _nodes(sizes)):
                raise self.fail(node, "a view or reshape to a computed shape")
            mapped = fx.node.map_arg(tuple(sizes), lambda a: self.env[a].node)
            return _Value(self.graph.call_method("reshape", (x.node, *mapped)), SHARED, shape)
        # only (N, ...) -> (N, everything else): the batch kept, the rest flattened, which keeps each model's block
        if shape is None or len(x.shape) < 2 or len(shape) != 2 or shape[0] != x.shape[0] or len(sizes) != 2:
            raise self.fail(node, "a view or reshape other than (batch, -1)")
        first = sizes[0]
        if not (isinstance(first, fx.Node) and self.env[first].layout == "batch") and first != -1:
            raise self.fail(node, "a view or reshape whose batch size is a constant")
        return self.flatten(node, x, 1, -1, shape)

    def reduce(self, node: fx.Node, x: _Value, name: str, shape: tuple | None) -> _Value:
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        if set(node.kwargs) - {"dim", "keepdim"} or len(node.args) > 3:
            raise self.fail(node, f"{name} with options other than dim and keepdim")
        dims = self.const(node, dims)
        dims = [dims] if isinstance(dims, int) else list(dims) if dims is not None else None
        if x.layout == SHARED:
            return _Value(self.graph.call_method(name, (x.node, dims, keep) if dims is not None else (x.node,)),
                          SHARED, shape)
        if not dims or any(d % len(x.shape) < 2 for d in dims) or not isinstance(keep, bool):
            raise self.fail(node, f"a {name} over the batch or channel dimension")
        shift = 1 if x.layout == MODELS else 0
        dims = [d % len(x.shape) + shift for d in dims]
        return _Value(self.graph.call_method(name, (x.node, dims, keep)), x.layout, shape)

    def binary(self, node: fx.Node, op: Any, left: Any, right: Any, shape: tuple | None, kwargs: dict) -> _Value:
        kwargs = self.const(node, kwargs)
        values = [self.env[a] if isinstance(a, fx.Node) else a for a in (left, right)]
        tensors = [v for v in values if isinstance(v, _Value)]
        if any(v.layout not in (SHARED, CHANNELS, MODELS) for v in tensors):
            raise self.fail(node, "arithmetic on sizes")
        if any(isinstance(v, torch.Tensor) for v in values):
            raise self.fail(node, "a constant tensor operand")
        method = isinstance(op, str)
        in_place = op in (operator.iadd, operator.imul) or (method and op.endswith("_"))
        if len(tensors) == 1:
            args = tuple(v.node if isinstance(v, _Value) else v for v in values)
            out = self.graph.call_method(op, args, kwargs) if method else self.graph.call_function(op, args, kwargs)
            return _Value(out, tensors[0].layout, shape)
        a, b = tensors
        if len(a.shape) != len(b.shape) or len(a.shape) < 2 or a.shape[:2] != b.shape[:2]:
            raise self.fail(node, "arithmetic that broadcasts over the batch or channel dimension")
        layouts = {a.layout, b.layout}
        if layouts == {SHARED}:
            layout, args = SHARED, (a.node, b.node)
        elif MODELS in layouts:
            layout, args = MODELS, (self.models(a), self.models(b))
        else:
            layout, args = CHANNELS, (self.channels(a), self.channels(b))
        if in_place and a.layout != layout:
            raise self.fail(node, "an in-place update of a value shared by the models")
        out = self.graph.call_method(op, args, kwargs) if method else self.graph.call_function(op, args, kwargs)
        return _Value(out, layout, shape)


class _GlobalAveragePool(torch.autograd.Function):
    """``adaptive_avg_pool2d(x, 1)`` whose gradient is the output's gradient divided by ``H*W`` as PyTorch's
    kernel divides it (the same bits), but expanded rather than written out. The ReLU's backward before it
    then reads it in the input's memory format: PyTorch's own backward writes it contiguous, and a
    ``channels_last`` ReLU backward reading that runs several times slower."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return F.adaptive_avg_pool2d(x, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return (grad / (ctx.shape[-2] * ctx.shape[-1])).expand(ctx.shape)  # the same bits as PyTorch's backward


def global_average_pool(x: torch.Tensor) -> torch.Tensor:
    """``F.adaptive_avg_pool2d(x, 1)``, its backward an expanded view (see :class:`_GlobalAveragePool`)."""
    return _GlobalAveragePool.apply(x)


def _is_relu(node: fx.Node, traced: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return type(traced.get_submodule(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in (torch.relu, F.relu) and len(node.args) == 1 and not node.kwargs.get("inplace")
    return node.op == "call_method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs


def _is_max_pool(node: fx.Node, traced: fx.GraphModule) -> bool:
    if node.op == "call_module":
        m = traced.get_submodule(node.target)
        return type(m) in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d) and not m.return_indices
    return (node.op == "call_function" and node.target in (F.max_pool1d, F.max_pool2d, F.max_pool3d)
            and not node.kwargs.get("return_indices") and not any(a is True for a in node.args[1:]))


def _relus_before_max_pools(traced: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """The (ReLU, max pooling) pairs where the ReLU's result is read by the pooling alone and its argument by
    the ReLU alone. ``max_pool(relu(x))`` is ``relu(max_pool(x))`` exactly, values and gradients: a window's
    maximum is positive in both or in neither, the first maximal position is the same when it is positive, and
    when it is not, the ReLU's gradient is zero either way. Swapped, the ReLU and its backward run on the
    pooled, smaller tensor."""
    pairs = []
    for node in traced.graph.nodes:
        if not _is_relu(node, traced) or len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
            continue
        (pool,) = node.users
        if _is_max_pool(pool, traced) and pool.args[0] is node and len(node.args[0].users) == 1:
            pairs.append((node, pool))
    return pairs


def _nodes(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _target_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)
