"""A model batch as one Graph: every model captured, its units renamed ``m0/...``, ``m1/...``.

Models whose example inputs have the same shapes, dtypes and structure read one shared set of inputs (an
ensemble, a sweep, a cascade's first stage): the batch's inputs are then one model's inputs, and each model
is called on them. Otherwise each model reads its own inputs and the batch takes all of them, in order.

>>> import torch
>>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)
>>> batch = ModelBatch([a, b], [(torch.randn(1, 4),), (torch.randn(1, 4),)])
>>> batch.shared_input, len(batch.inputs)
(True, 1)
>>> g = combine(batch)
>>> [n.name for n in g.nodes], g.inputs
(['m0/linear', 'm1/linear'], ('x0',))
>>> [t.shape for t in batch(*batch.inputs)]
[torch.Size([1, 2]), torch.Size([1, 3])]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.errors import OpschedError
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node


class MultiError(OpschedError):
    """A model batch that cannot be built, fused or verified (the message says which model and why)."""


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def input_layout(inputs: tuple) -> tuple:
    """What makes two models' arguments one shared input of a batch: how they nest, and each tensor's shape,
    dtype and device."""
    leaves, spec = pytree.tree_flatten(inputs)
    return spec, tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else repr(t)
                       for t in leaves)


class ModelBatch(torch.nn.Module):
    """Several models run together; calling it runs each model's own forward one after another (the
    ``sequential_models`` way) and returns their outputs as a tuple, one entry per model.

    ``example_inputs`` holds one tuple of arguments per model. When they all have the same layout the
    batch reads one shared set (``inputs``, the first model's) and ``shared_input`` is true, unless
    ``separate_inputs``: then each model reads its own arguments whatever their layout (as a server's requests
    for several models do).

    ``preprocess`` (a module, say a ``torchvision.transforms.v2`` pipeline) runs once on the shared inputs,
    and every model reads what it returns: ``example_inputs`` are then the raw inputs."""

    def __init__(self, models: Sequence[torch.nn.Module], example_inputs: Sequence[Any],
                 preprocess: torch.nn.Module | None = None, separate_inputs: bool = False):
        super().__init__()
        if not models:
            raise MultiError("a model batch needs at least one model")
        if len(example_inputs) != len(models):
            raise MultiError(f"{len(models)} models but {len(example_inputs)} sets of example inputs")
        for k, m in enumerate(models):
            if not isinstance(m, torch.nn.Module):
                raise MultiError(f"model {k} is a {type(m).__name__}, not a torch.nn.Module")
        self.models = torch.nn.ModuleList(models)
        self.preprocess = preprocess
        per_model = [_as_tuple(i) for i in example_inputs]
        self.raw_inputs: tuple | None = None
        if preprocess is not None:
            if separate_inputs or len({input_layout(i) for i in per_model}) != 1:
                raise MultiError("preprocessing runs once on one input: the models must all read the same input")
            self.raw_inputs = per_model[0]
            with torch.no_grad():
                per_model = [_as_tuple(preprocess(*self.raw_inputs))] * len(models)
        devices = {t.device.type for i in per_model for t in pytree.tree_leaves(i) if isinstance(t, torch.Tensor)}
        devices |= {p.device.type for m in models for p in m.parameters()}
        if len(devices) > 1:
            raise MultiError(f"the models and inputs of a batch must be on one device, found {', '.join(sorted(devices))}")
        self.device = devices.pop() if devices else "cpu"  # a device type: cpu, cuda or meta
        self.shared_input = not separate_inputs and len({input_layout(i) for i in per_model}) == 1
        self.per_model = [per_model[0]] * len(models) if self.shared_input else per_model
        self.inputs = self.raw_inputs or (per_model[0] if self.shared_input else tuple(a for i in per_model for a in i))
        self._arity = [len(i) for i in per_model]

    def split(self, inputs: Sequence[Any]) -> list[tuple]:
        """The arguments each model gets from the batch's ``inputs`` (preprocessed, once)."""
        if self.preprocess is not None:
            return [_as_tuple(self.preprocess(*inputs))] * len(self.models)
        if self.shared_input:
            return [tuple(inputs)] * len(self.models)
        parts, at = [], 0
        for n in self._arity:
            parts.append(tuple(inputs[at:at + n]))
            at += n
        return parts

    def forward(self, *inputs: Any) -> tuple:
        return tuple(m(*args) for m, args in zip(self.models, self.split(inputs)))

    @property
    def same_architecture(self) -> bool:
        """Every model has the first one's type and parameter and buffer names and shapes, and they read one
        shared input: what ``torch.func.vmap`` over the stacked models needs."""
        def layout(m: torch.nn.Module) -> tuple:
            return (type(m), tuple((n, p.shape, p.dtype) for n, p in m.named_parameters()),
                    tuple((n, b.shape, b.dtype) for n, b in m.named_buffers()))

        first = layout(self.models[0])
        return all(layout(m) == first for m in self.models[1:]) and self.shared_input


def combine(batch: ModelBatch) -> Graph:
    """One Graph of every model of ``batch``: model ``k``'s units are ``mk/<unit>``; the graph's inputs are
    ``x0, x1, ...`` (shared) or ``mk/x0, ...`` (one set per model); its outputs are every model's outputs in
    order, and its ``out_spec`` rebuilds the batch's output (a tuple, one entry per model). The batch's
    preprocessing is captured once, its units named ``pre/<unit>``, and every model reads its outputs."""
    nodes: list[Node] = []
    inputs: list[str] = []
    outputs: list[str] = []
    structures = []
    model_inputs: list[str] | None = None  # what each model's inputs are, when they are the preprocessing's
    if batch.preprocess is not None:
        graph = capture(batch.preprocess, batch.raw_inputs, name=f"preprocessing ({type(batch.preprocess).__name__})")
        inputs = [f"x{j}" for j in range(len(graph.inputs))]
        rename = dict(zip(graph.inputs, inputs))
        rename.update((n.name, f"pre/{n.name}") for n in graph.nodes)
        nodes += [_renamed(n, rename) for n in graph.nodes]
        model_inputs = [rename[o] for o in graph.outputs]
    for k, (model, args) in enumerate(zip(batch.models, batch.per_model)):
        graph = capture(model, args, name=f"model {k} ({type(model).__name__})")
        prefix = f"m{k}/"
        flat_names = model_inputs or [f"x{j}" if batch.shared_input else f"{prefix}x{j}"
                                      for j in range(len(graph.inputs))]
        rename = dict(zip(graph.inputs, flat_names))
        rename.update((n.name, prefix + n.name) for n in graph.nodes)
        if model_inputs is None and (k == 0 or not batch.shared_input):
            inputs += flat_names
        nodes += [_renamed(n, rename) for n in graph.nodes]
        outputs += [rename[o] for o in graph.outputs]
        spec = graph.out_spec
        if spec is None:
            spec = pytree.tree_structure(0 if len(graph.outputs) == 1 else tuple(range(len(graph.outputs))))
        structures.append(pytree.tree_unflatten([0] * len(graph.outputs), spec))
    return Graph(nodes, inputs=inputs, outputs=outputs, name=f"{len(batch.models)} models",
                 out_spec=pytree.tree_structure(tuple(structures)))


def _renamed(node: Node, rename: dict[str, str]) -> Node:
    return Node(rename[node.name], node.kind, tuple(rename[a] for a in node.args), node.shape, node.dtype,
                node.flops, node.bytes_read, node.bytes_written, node.param_bytes, node.attrs, node.ops, node.latency,
                node.run)
