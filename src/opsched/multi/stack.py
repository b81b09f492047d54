"""Units of different models batched into one kernel (HiveMind's fusions): the same unit of several models,
same code and weight layout, runs once over the models' weights stacked along a new leading dimension.

- ``same_input``: the units read the same value (an ensemble's first layers). Batched, a convolution becomes
  one convolution with the models' filters stacked along its output channels, a linear layer one matmul.
- ``same_shape``: the units read different values of equal shapes (every later layer of an ensemble). The
  convolution becomes one grouped convolution, a linear layer one batched matmul, the rest batched
  element-wise operators.

The batched unit is made by ``torch.func.vmap`` over the unit's own code with the stacked weights, traced
with ``make_fx`` into plain ATen operators: vmap's batching rules do the rewriting (they are PyTorch's, and
exact), and the traced graph runs without vmap's per-operator interpretation. Its output is the members'
outputs stacked; a batched unit that reads a batched unit's output takes it stacked as it is, and a member
whose value is read elsewhere (or returned) gets a unit of its own name that selects it (a view, or a
contiguous copy where the batched layout interleaves the members).

>>> import torch
>>> from opsched.graph.interpret import all_values, run_graph
>>> from opsched.multi.combine import ModelBatch, combine
>>> models = [torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 2, 1))
...           for _ in range(4)]
>>> x = torch.randn(1, 3, 8, 8)
>>> g = combine(ModelBatch(models, [(x,)] * 4))
>>> groups = batchable_groups(g)
>>> [(fusion_kind(g, members), len(members)) for members in groups]
[('same_input', 4), ('same_shape', 4)]
>>> fused = batch_units(g, groups, all_values(g, [x]))
>>> [n.name for n in fused.nodes]
['m0-3/0', 'm0-3/2', 'm0/2', 'm1/2', 'm2/2', 'm3/2']
>>> with torch.no_grad():
...     all(torch.allclose(a, b, atol=1e-5) for a, b in zip(run_graph(fused, x), run_graph(g, x)))
True
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from opsched.graph.constfold import constants_folded
from opsched.graph.convbias import conv_biases_folded
from opsched.graph.fold import fold_batch_norms
from opsched.graph.ir import Graph, Node
from opsched.graph.maxpool import max_pools_by_slices, plain_max_pools
from opsched.multi.units import layout_key, local_name, model_of, tensors_of, weight_names

FUSIONS = ("same_input", "same_shape")


def batchable_groups(graph: Graph) -> list[list[int]]:
    """Groups of units (indices, ordered by model) that can run as one batched unit: units of different
    models with the same layout (code and weights up to their names, see :func:`layout_key`) and equally
    shaped inputs, none a predecessor of another, and no set of groups forming a cycle once each is one unit.

    Which unit of one model goes with which of another is decided without names first: units that compute
    the same function of the same inputs (the same :func:`computations`, whatever the modules were called)
    are matched, the k-th of each model with the k-th of every other; units left unmatched are then matched
    by their name in their model, so different architectures that share a layer's name and layout still
    batch it."""
    keys = [layout_key(node) for node in graph.nodes]
    batchable = [i for i, node in enumerate(graph.nodes) if keys[i] is not None and model_of(node.name) is not None]
    shapes = [tuple(_shape_of(graph, a) for a in node.args) for node in graph.nodes]
    computed = computations(graph, keys)
    by_computation: dict[Any, list[int]] = {}
    for i in batchable:
        by_computation.setdefault((computed[i], shapes[i]), []).append(i)
    groups = [g for members in by_computation.values() for g in _kth_of_each_model(graph, members)]
    grouped = {i for g in groups for i in g}
    by_name: dict[Any, list[int]] = {}
    for i in batchable:
        if i not in grouped:
            by_name.setdefault((local_name(graph.nodes[i].name), keys[i], shapes[i]), []).append(i)
    groups += [g for members in by_name.values() for g in _kth_of_each_model(graph, members)]
    groups.sort(key=lambda members: members[0])
    return _acyclic(graph, groups)


def computations(graph: Graph, keys: Sequence[Any]) -> list[int]:
    """For every unit, a number that is the same for units computing the same function (equal ``keys``) of
    the same computations, down to the inputs (known by their names inside a model, ``x0``): equal for the
    corresponding units of two copies of a network however their modules are named."""
    ids: dict[Any, int] = {}
    known = {name: ids.setdefault(("input", local_name(name)), len(ids)) for name in graph.inputs}
    result = []
    for node, key in zip(graph.nodes, keys):
        what = key if key is not None else ("opaque", node.name)
        number = ids.setdefault((what, tuple(known[a] for a in node.args)), len(ids))
        known[node.name] = number
        result.append(number)
    return result


def _kth_of_each_model(graph: Graph, members: Sequence[int]) -> list[list[int]]:
    """``members`` (in graph order) as groups: the k-th member of each model with the k-th of every other,
    dropping any that depends on one already in its group; groups of one are left out."""
    per_model: dict[int, list[int]] = {}
    for i in members:
        per_model.setdefault(model_of(graph.nodes[i].name), []).append(i)
    groups = []
    for k in range(max(map(len, per_model.values()), default=0)):
        chosen: list[int] = []
        for model in sorted(per_model):
            if k < len(per_model[model]):
                i = per_model[model][k]
                if all(not (graph.ancestors[i] >> j & 1 or graph.ancestors[j] >> i & 1) for j in chosen):
                    chosen.append(i)
        if len(chosen) > 1:
            groups.append(chosen)
    return groups


def _shape_of(graph: Graph, name: str) -> Any:
    node = graph.nodes[graph.index[name]] if name in graph.index else None
    return (node.shape, node.dtype) if node is not None else name


def _acyclic(graph: Graph, groups: list[list[int]]) -> list[list[int]]:
    """Drop groups, the latest first, until contracting each group to one unit leaves a DAG (two groups whose
    members depend on each other across models would otherwise each wait for the other)."""
    groups = list(groups)
    while True:
        owner = {i: ("g", k) for k, members in enumerate(groups) for i in members}
        contracted = nx.DiGraph()
        contracted.add_nodes_from(owner.get(i, i) for i in range(len(graph)))
        contracted.add_edges_from((owner.get(j, j), owner.get(i, i)) for j, i in graph.edges
                                  if owner.get(j, j) != owner.get(i, i))
        try:
            cycle = nx.find_cycle(contracted)
        except nx.NetworkXNoCycle:
            return groups
        worst = max(k for edge in cycle for end in edge if isinstance(end, tuple) for k in [end[1]])
        del groups[worst]


def fusion_kind(graph: Graph, members: Sequence[int]) -> str:
    """``same_input`` when every member reads the same values, else ``same_shape``."""
    return "same_input" if len({graph.nodes[i].args for i in members}) == 1 else "same_shape"


def batch_units(graph: Graph, groups: Sequence[Sequence[int]], values: Mapping[str, Any]) -> Graph:
    """``graph`` with each group run as one batched unit; ``values`` holds an example value of every unit
    and input (see :func:`opsched.graph.interpret.all_values`), what the batched code is traced on."""
    group_of = {i: (g, k) for g, members in enumerate(groups) for k, i in enumerate(members)}
    names = [batched_name(graph, members) for members in groups]
    nodes: list[Node] = [n for i, n in enumerate(graph.nodes) if i not in group_of]
    outputs: dict[str, Any] = {}  # each batched unit's output, as later batched units will read it
    for g, members in enumerate(groups):
        args, dims = _batched_args(graph, members, groups, group_of, names)
        first = graph.nodes[members[0]]
        module = batched_module([graph.nodes[i] for i in members], dims,
                                [outputs[a] if a in outputs else values[a] for a in args])
        with torch.no_grad():
            outputs[names[g]] = module(*[outputs[a] if a in outputs else values[a] for a in args])
        nodes.append(Node(
            names[g], "batched", tuple(args), (len(members), *first.shape) if first.shape else None, first.dtype,
            sum(graph.nodes[i].flops for i in members), sum(graph.nodes[i].bytes_read for i in members),
            sum(graph.nodes[i].bytes_written for i in members), sum(graph.nodes[i].param_bytes for i in members),
            {"fusion": fusion_kind(graph, members), "members": tuple(graph.nodes[i].name for i in members),
             "op": first.attrs.get("op")}, first.ops, None, module))
    read = {a for n in nodes for a in n.args} | set(graph.outputs)
    for i, (g, k) in group_of.items():
        member = graph.nodes[i]
        if member.name in read:
            nodes.append(Node(member.name, "elementwise", (names[g],), member.shape, member.dtype,
                              attrs={"post": ("select",)}, ops=("select",), run=_select_module(k)))
    return Graph(nodes, graph.inputs, graph.outputs, graph.name, graph.out_spec)


def batched_name(graph: Graph, members: Sequence[int]) -> str:
    models = [model_of(graph.nodes[i].name) for i in members]
    span = f"m{models[0]}-{models[-1]}" if models == list(range(models[0], models[-1] + 1)) else \
        "m" + ",".join(map(str, models))
    return f"{span}/{local_name(graph.nodes[members[0]].name)}"


def _batched_args(graph: Graph, members: Sequence[int], groups: Sequence[Sequence[int]],
                  group_of: Mapping[int, tuple[int, int]], names: Sequence[str]) -> tuple[list[str], list[Any]]:
    """The batched unit's arguments and how each of the unit's inputs is made from them: ``None`` (one value
    every member reads), ``0`` (a batched unit's stacked output, member ``k`` at index ``k``) or ``"stack"``
    (one value per member, stacked when the unit runs)."""
    args: list[str] = []
    dims: list[Any] = []
    for p in range(len(graph.nodes[members[0]].args)):
        read = [graph.nodes[i].args[p] for i in members]
        producers = [group_of.get(graph.index[a]) if a in graph.index else None for a in read]
        if len(set(read)) == 1:
            args.append(read[0])
            dims.append(None)
        elif (producers[0] is not None and len(groups[producers[0][0]]) == len(members)
              and producers == [(producers[0][0], k) for k in range(len(members))]):
            args.append(names[producers[0][0]])
            dims.append(0)
        else:
            args += read
            dims.append("stack")
    return args, dims


def batched_module(members: Sequence[Node], dims: Sequence[Any], examples: Sequence[Any]) -> fx.GraphModule:
    """One GraphModule computing every member's unit on the members' stacked weights: called with the
    arguments ``dims`` describes (see :func:`_batched_args`), it returns the members' outputs stacked."""
    count = len(members)
    # Batch norm folded into its convolution per member first: batched, its element-wise pass over the
    # stacked output cost as much as the convolution (16 small CNNs at batch 1, measured).
    units = [fold_batch_norms(m.run) if isinstance(m.run, fx.GraphModule) else m.run for m in members]
    weights = weight_names(units[0])
    by_position = [[tensors_of(u)[name].detach() for name in weight_names(u)] for u in units]
    stacked = {f"w{j}": torch.stack([w[j] for w in by_position]) for j in range(len(weights))}
    template = _batch_norm_decomposed(units[0])

    def one(w: Sequence[torch.Tensor], *args: Any) -> Any:
        return torch.func.functional_call(template, dict(zip(weights, w)), args, strict=True)

    in_dims = (0, *[0 if d == "stack" else d for d in dims])
    batched = torch.func.vmap(one, in_dims=in_dims)

    def run(*flat: Any) -> Any:
        w, rest = flat[:len(weights)], flat[len(weights):]
        args, at = [], 0
        for d in dims:
            if d == "stack":
                args.append(torch.stack(rest[at:at + count]))
                at += count
            else:
                args.append(rest[at])
                at += 1
        return batched(w, *args)

    with torch.no_grad(), _quiet_fallback():
        traced = make_fx(run)(*stacked.values(), *examples)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"][:len(weights)]
    for name, tensor in stacked.items():
        traced.register_buffer(name, tensor)
    if placeholders:
        with traced.graph.inserting_before(placeholders[0]):
            attributes = [traced.graph.get_attr(name) for name in stacked]
        for p, attribute in zip(placeholders, attributes):
            p.replace_all_uses_with(attribute)
            traced.graph.erase_node(p)
    traced.graph.eliminate_dead_code()  # first: the indices vmap's pooling returns are read by dead views
    plain_max_pools(traced.graph)
    max_pools_by_slices(traced.graph)
    batched_unit = fx.GraphModule(traced, traced.graph, class_name="Batched")
    conv_biases_folded(batched_unit, examples)
    constants_folded(batched_unit)  # vmap's views and scalings of the stacked weights, done once
    return batched_unit


@contextlib.contextmanager
def _quiet_fallback() -> Iterator[None]:
    """vmap warns on stderr for every operator without a batching rule (it then loops over the members, which
    is still exact); the warning is PyTorch's note to itself, not something our user can act on."""
    set_warning = torch._C._functorch._set_vmap_fallback_warning_enabled
    set_warning(False)
    try:
        yield
    finally:
        set_warning(True)


def _batch_norm_decomposed(unit: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``unit`` with inference batch norm as a scale and shift: torch.export captures it as
    ``_native_batch_norm_legit_no_training``, which has no batching rule, and vmap would run it member by
    member."""
    op = torch.ops.aten._native_batch_norm_legit_no_training.default
    if not any(n.target is op for n in unit.graph.nodes):
        return unit
    unit = copy.deepcopy(unit)
    graph = unit.graph
    for node in list(graph.nodes):
        if node.target is not op:
            continue
        x, weight, bias, mean, var, _momentum, eps = node.args
        with graph.inserting_before(node):
            normalized = graph.call_function(batch_norm_inference, (x, weight, bias, mean, var, eps))
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(normalized)
    graph.eliminate_dead_code()
    unit.recompile()
    return unit


def batch_norm_inference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch norm with running statistics, as the element-wise operators vmap batches."""
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return x * scale.reshape(shape) + shift.reshape(shape)


def _select_module(k: int) -> fx.GraphModule:
    """A unit returning member ``k`` of a batched unit's stacked output (a view where that is contiguous)."""
    g = fx.Graph()
    stacked = g.placeholder("stacked")
    # contiguous: the readers' code was captured on contiguous values and may view them (a flatten)
    g.output(g.call_method("contiguous", (g.call_function(torch.ops.aten.select.int, (stacked, 0, k)),)))
    return fx.GraphModule({}, g, class_name="Select")
