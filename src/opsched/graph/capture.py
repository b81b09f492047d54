"""Capture a PyTorch model as a :class:`~opsched.graph.ir.Graph` of schedule units.

torch.export.export is tried first (it traces models with Python control flow, such as timm's NASNet, that
torch.fx.symbolic_trace cannot), then torch.fx.symbolic_trace. The FX graph is then grouped into units:

1. every heavy operator (convolution, matmul, pooling, concatenation) starts a unit;
2. a light operator with one data input *follows* its producer's unit when it is that producer's only
   user (batch norm and ReLU after a convolution); a 1x1 convolution follows the depthwise convolution
   it reads the same way, giving one separable-convolution unit as in IOS ("Relu-SepConv");
3. a unit made only of light operators whose output feeds exactly one unit *precedes* that unit (the
   ReLU before a separable convolution, the sum that aggregates a RandWire node's inputs).

Only a unit's last operator is read by other units, so every unit has one output, and grouping keeps the
unit graph acyclic. Values that depend on no input (a weight passed through sigmoid) are recomputed
inside each unit that reads them. Each unit runs as its own small FX GraphModule over the operators it
holds, sharing the model's parameters, so running the units in order reproduces the captured program.

Example:

>>> import torch
>>> class Two(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b = torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(3, 4, 3, padding=1)
...     def forward(self, x):
...         return torch.cat([self.a(x).relu(), self.b(x)], 1)
>>> g = capture(Two(), (torch.randn(1, 3, 8, 8),))
>>> [(n.name, n.kind, n.args) for n in g.nodes]
[('a', 'conv', ('x',)), ('b', 'conv', ('x',)), ('cat', 'cat', ('a', 'b'))]
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from opsched.errors import CaptureError, first_line
from opsched.graph import ops
from opsched.graph.constants import fold_constants
from opsched.graph.fold import fold_batch_norms
from opsched.graph.ir import Graph, Node
from opsched.graph.maxpool import max_pools_by_slices
from opsched.graph.tracing import TRACING
from opsched.quiet import this_thread_quiet

_COMPUTE = ("call_function", "call_method", "call_module")


def capture(model: torch.nn.Module, example_inputs: Any, *, name: str | None = None) -> Graph:
    """Capture ``model`` run on ``example_inputs`` (a tensor or a tuple of arguments) as a unit graph.

    The model is put in eval mode. Raises :class:`~opsched.errors.CaptureError` naming the model and
    the reason when neither torch.export nor torch.fx can capture it. What PyTorch logs or prints while
    trying (a partial graph, symbolic-shape warnings) is kept from the user unless the ``opsched`` logger is
    enabled for DEBUG (``--verbose``); the reasons are in the error and its chain of causes.
    """
    label = name or type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"cannot capture {label}: expected a torch.nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    model.eval()
    with TRACING.tracing(), pytorch_quiet():  # opsched's calls on other threads wait (opsched.graph.tracing)
        gm, traced_with = _trace(model, args, label)
    graph = _group_units(fold_constants(gm), label)
    graph.traced_with = traced_with  # torch.fx's units hold the model's own modules; torch.export's do not
    return graph


_QUIET = threading.Lock()


@contextlib.contextmanager
def pytorch_quiet() -> Iterator[None]:
    """Silence PyTorch's own output while a capture is attempted: torch.export prints the partial graph of a
    failed export straight to stderr and logs symbolic-shape warnings, 27 lines before our one-line error. On the
    capturing thread only (:func:`opsched.quiet.this_thread_quiet`): a capture on a background build's thread
    that silenced the process swallowed, for the seconds it took, whatever every other thread warned, logged or
    wrote to stderr (the user's own lines, opsched's notes of the calls it answered meanwhile). Captures run one
    at a time."""
    if logging.getLogger("opsched").isEnabledFor(logging.DEBUG):
        yield
        return
    with _QUIET, this_thread_quiet():
        yield


def _trace(model: torch.nn.Module, args: tuple, label: str) -> tuple[fx.GraphModule, str]:
    try:
        with torch.no_grad():
            exported = torch.export.export(model, args)
    except Exception as export_error:  # noqa: BLE001 - any failure moves on to torch.fx
        return _fx_trace(model, args, label, export_error)
    functional = None
    if _may_write(exported):  # (rare: decomposing every model to be sure would cost seconds on the large ones)
        try:
            functional = exported.run_decompositions({})
        except Exception as e:  # a tensor attribute written ("register it as buffer"), say
            raise CaptureError(f"cannot capture {label}: torch.export cannot tell what its forward writes in place "
                               f"({first_line(e)})") from e
        signature = functional.graph_signature
        written = sorted([f"parameter {p}" for p in signature.parameters_to_mutate.values()]
                         + [f"buffer {b}" for b in signature.buffers_to_mutate.values()]
                         + [f"input {i}" for i in signature.user_inputs_to_mutate.values()])
        if written:
            # a plan runs on a copy of the model, which its calls would change and the model's would not (and each
            # of the model's own calls would be a weight change to the plans); its units run at once, in another
            # order, on the inputs: never the same answers (an input written in place failed every schedule's
            # verification, 0.9 of the output's magnitude apart)
            raise CaptureError(f"cannot capture {label}: its forward writes {', '.join(written)} in place; opsched "
                               "plans models whose forward leaves their state and inputs as it found them")
    try:
        gm = exported.module()
        if not _make_inplace_functional(gm):
            # Some in-place op is seen through an alias: let torch functionalize the whole program.
            gm = (functional or exported.run_decompositions({})).module()
            _make_inplace_functional(gm)
        return gm, "torch.export"
    except Exception as export_error:  # noqa: BLE001 - any failure moves on to torch.fx
        return _fx_trace(model, args, label, export_error)


def _may_write(exported: torch.export.ExportedProgram) -> bool:
    """Whether an exported forward may write in place into a buffer, a parameter or an input (``self.calls += 1``,
    ``self.buf[0] = x``, ``x.mul_(2)``): the program torch.export makes keeps such writes as in-place operators on
    their placeholders, or on what may alias them (a view, or ``to`` and ``reshape``, which alias only at times);
    its signature lists the writes only once functionalized."""
    placeholders = {n.name for n in exported.graph.nodes if n.op == "placeholder"}
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return True  # a region of its own (set_grad_enabled, autocast): its subgraph may write; let torch say
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        arguments = node.target._schema.arguments
        given = {**dict(zip((a.name for a in arguments), node.args)), **node.kwargs}
        for argument in arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = given.get(argument.name)
            for written in value if isinstance(value, (list, tuple)) else (value,):  # (Tensor(a!)[]: _foreach_)
                while isinstance(written, fx.Node) and written.op == "call_function" and _is_view(written) \
                        and written.args:
                    written = written.args[0]  # a write through a view writes its base
                if isinstance(written, fx.Node) and written.name in placeholders:
                    return True
    return False


def _fx_trace(model: torch.nn.Module, args: tuple, label: str,
              export_error: Exception) -> tuple[fx.GraphModule, str]:
    try:
        gm = fx.symbolic_trace(model)
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
        return gm, "torch.fx"
    except Exception as fx_error:
        raise CaptureError(f"cannot capture {label}: torch.export failed ({first_line(export_error)}); "
                           f"torch.fx failed ({first_line(fx_error)})") from fx_error


def _make_inplace_functional(gm: fx.GraphModule) -> bool:
    """Replace in-place ATen ops by their functional forms where nothing else sees the mutated tensor.

    Units run concurrently, so a unit must never write into a tensor another unit reads. Returns False,
    changing nothing, if some mutated tensor has other readers or aliases another tensor.
    """
    replacements = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        name = target._overloadpacket.__name__
        mutated = node.args[0] if node.args else None
        functional = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
        overload = getattr(functional, target._overloadname, None) if functional is not None else None
        if (overload is None or not isinstance(mutated, fx.Node) or mutated.op != "call_function"
                or len(mutated.users) != 1 or _is_view(mutated)):
            return False
        replacements.append((node, overload))
    for node, overload in replacements:
        node.target = overload
    gm.recompile()
    return True


# Activations that have an in-place form, and producers whose fresh output they may overwrite: the
# producer's own backward does not read its output, so autograd (a fused model in training) stays exact.
_IN_PLACE_ACTIVATIONS = ("relu", "hardtanh", "silu", "hardswish", "hardsigmoid", "leaky_relu", "gelu", "elu")
_FRESH_PRODUCERS = ("convolution", "conv1d", "conv2d", "conv3d", "batch_norm", "addmm", "linear", "mm", "bmm", "add", "sub",
                    "mul", "cat")


def _activations_in_place(g: fx.Graph) -> None:
    """Inside one unit, run an activation in place on its input when nothing else reads that input and the
    unit made it (a convolution's or batch norm's fresh output), as the model's own ``ReLU(inplace=True)``
    does: torch.export makes every op functional, and the extra allocation per activation is time the
    model's forward does not spend."""
    for node in g.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._overloadpacket.__name__
        in_place = getattr(getattr(torch.ops.aten, name + "_", None), target._overloadname, None)
        source = node.args[0] if node.args else None
        if (name in _IN_PLACE_ACTIVATIONS and in_place is not None and isinstance(source, fx.Node)
                and len(source.users) == 1 and _is_fresh(source)):
            node.target = in_place


def _is_fresh(node: fx.Node) -> bool:
    """A tensor the unit itself allocated: a heavy op's output, or batch norm's normalised output."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        producer = node.args[0]
        return (node.args[1] == 0 and isinstance(producer, fx.Node)
                and isinstance(producer.target, torch._ops.OpOverload)
                and "batch_norm" in producer.target._overloadpacket.__name__)
    return (isinstance(node.target, torch._ops.OpOverload)
            and node.target._overloadpacket.__name__ in _FRESH_PRODUCERS and not _is_view(node))


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns)
    return True


def _group_units(gm: fx.GraphModule, label: str) -> Graph:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    output = next(n for n in nodes if n.op == "output")
    flat_out, out_spec = pytree.tree_flatten(output.args[0])
    pytree_info = getattr(gm.graph._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.out_spec is not None:
        out_spec = pytree_info.out_spec

    live: set[fx.Node] = set()
    stack = [a for a in flat_out if isinstance(a, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    const: set[fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op in _COMPUTE and all(a in const for a in n.all_input_nodes)):
            const.add(n)
    compute = [n for n in nodes if n in live and n.op in _COMPUTE and n not in const]
    op_names = {n: ops.op_name(n, gm) for n in compute}
    outputs = {a for a in flat_out if isinstance(a, fx.Node)}

    def data_inputs(n: fx.Node) -> list[fx.Node]:
        return [a for a in dict.fromkeys(n.all_input_nodes) if a not in const]

    def readers(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u in live and u.op != "output"]

    members: dict[int, list[fx.Node]] = {}
    heavy: dict[int, fx.Node | None] = {}
    unit_of: dict[fx.Node, int] = {}
    last: dict[int, fx.Node] = {}
    sepconv: set[int] = set()

    for n in compute:
        name = op_names[n]
        data = data_inputs(n)
        producer = data[0] if len(data) == 1 else None
        uid = unit_of.get(producer) if producer is not None else None
        follows = (uid is not None and last[uid] is producer and len(readers(producer)) == 1
                   and producer not in outputs)
        if follows and not ops.is_heavy(name):
            members[uid].append(n)
        elif follows and heavy[uid] is producer and _is_pointwise_after_depthwise(n, producer, op_names, gm):
            members[uid].append(n)
            sepconv.add(uid)
        else:
            uid = len(members)
            members[uid] = [n]
            heavy[uid] = n if ops.is_heavy(name) else None
        unit_of[n] = uid
        last[uid] = n

    for uid in sorted(members, reverse=True):
        if heavy[uid] is not None or last[uid] in outputs:
            continue
        consumers = {unit_of[u] for u in readers(last[uid])}
        if len(consumers) == 1:
            (target,) = consumers
            members[target].extend(members[uid])
            members[target].sort(key=position.__getitem__)
            for m in members.pop(uid):
                unit_of[m] = target

    inputs = [n for n in nodes if n.op == "placeholder"]
    unit_names = _unit_names(members, heavy, op_names, gm)
    source_name = {n: n.name for n in inputs}
    for uid, unit in members.items():
        source_name[last[uid]] = unit_names[uid]

    graph_nodes = []
    for uid, unit in members.items():
        external = [a for m in unit for a in data_inputs(m) if unit_of.get(a) != uid]
        external = list(dict.fromkeys(external))
        for a in external:
            if a not in source_name:
                raise CaptureError(f"cannot capture {label}: operator {a.name} is read outside its unit")
        graph_nodes.append(_make_node(unit, heavy[uid], uid in sepconv, external, unit_names[uid],
                                      [source_name[a] for a in external], op_names, const, gm))
    out_names = []
    for k, a in enumerate(flat_out):
        if not isinstance(a, fx.Node):
            raise CaptureError(f"cannot capture {label}: output {k} is {a!r}, not a tensor; opsched plans forwards "
                               "whose outputs are tensors (a None, a number or a string among them is not planned)")
        if a not in source_name:
            raise CaptureError(f"cannot capture {label}: output {k} does not depend on the inputs")
        out_names.append(source_name[a])
    return Graph(graph_nodes, inputs=[n.name for n in inputs], outputs=out_names, name=label, out_spec=out_spec)


def _is_pointwise_after_depthwise(n: fx.Node, producer: fx.Node, op_names: dict, gm: fx.GraphModule) -> bool:
    if op_names[n] not in ops.CONV or op_names[producer] not in ops.CONV:
        return False
    dw = ops.conv_attrs(producer, op_names[producer], gm)
    pw = ops.conv_attrs(n, op_names[n], gm)
    return (bool(dw) and bool(pw) and dw["groups"] > 1 and dw["groups"] == dw["in_channels"]
            and pw["groups"] == 1 and all(k == 1 for k in pw["kernel"]))


def _module_path(n: fx.Node) -> tuple[str, bool]:
    """The innermost module a node ran in, and whether that module is a torch.nn built-in (a leaf)."""
    if n.op == "call_module":
        return str(n.target), True
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return "", False
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return path, cls_name.startswith("torch.nn.modules.")


def _unit_names(members: dict, heavy: dict, op_names: dict, gm: fx.GraphModule) -> dict[int, str]:
    """Readable unique names: the module path of the unit's main operator (``Mixed_5b.branch1x1.conv``),
    with the operator's name added when the module runs several operators (``Mixed_5b.cat``)."""
    names: dict[int, str] = {}
    used: set[str] = set()
    for uid, unit in members.items():
        main = heavy[uid] or unit[-1]
        path, leaf = _module_path(main)
        base = path if leaf and path else (f"{path}.{op_names[main]}" if path else op_names[main])
        candidate, k = base, 2
        while candidate in used:
            candidate, k = f"{base}_{k}", k + 1
        used.add(candidate)
        names[uid] = candidate
    return names


def _make_node(unit: list[fx.Node], heavy: fx.Node | None, is_sepconv: bool, external: list[fx.Node],
               name: str, args: list[str], op_names: dict, const: set, gm: fx.GraphModule) -> Node:
    last = unit[-1]
    meta = ops.tensor_meta(last)
    params: dict[str, int] = {}
    seen: set[fx.Node] = set()
    stack = [a for m in unit for a in m.all_input_nodes if a in const]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if c.op == "get_attr":
            value = ops.get_attr_value(c, gm)
            if isinstance(value, torch.Tensor):
                params[str(c.target)] = value.numel() * value.element_size()
        stack.extend(c.all_input_nodes)
    for m in unit:
        if m.op == "call_module":
            for pname, p in gm.get_submodule(m.target).named_parameters():
                params[f"{m.target}.{pname}"] = p.numel() * p.element_size()
    param_bytes = sum(params.values())
    attrs: dict[str, Any] = {}
    if heavy is not None:
        hname = op_names[heavy]
        kind = ("sepconv" if is_sepconv else "conv") if hname in ops.CONV else (
            "linear" if hname in ops.MATMUL else "pool" if hname in ops.POOL else "cat")
        attrs["op"] = hname
        if hname in ops.CONV:
            attrs.update(ops.conv_attrs(heavy, hname, gm))
        hpos = unit.index(heavy)
        post = [m for m in unit[hpos + 1:] if not (is_sepconv and op_names[m] in ops.CONV)]
        attrs["pre"] = tuple(op_names[m] for m in unit[:hpos])
        attrs["post"] = tuple(op_names[m] for m in post)
        # What the operators do besides their names (an upsampling's scale, a clamp's bounds): units merge
        # only if they apply the very same operators around the convolution.
        attrs["pre_args"] = tuple(_constant_args(m) for m in unit[:hpos])
        attrs["post_args"] = tuple(_constant_args(m) for m in post)
    else:
        kind = "elementwise"
        attrs["post"] = tuple(op_names[m] for m in unit)
    return Node(
        name=name, kind=kind, args=tuple(args),
        shape=meta[0] if meta else None, dtype=str(meta[1]).removeprefix("torch.") if meta else None,
        flops=sum(ops.flops(m, op_names[m], gm) for m in unit),
        bytes_read=sum(ops.nbytes(a) for a in external) + param_bytes, bytes_written=ops.nbytes(last),
        param_bytes=param_bytes, attrs=attrs, ops=tuple(op_names[m] for m in unit),
        run=_unit_module(unit, external, const, gm, name),
    )


def _constant_args(node: fx.Node) -> str:
    """An operator's arguments other than the values it reads, as text (values read are ``*``)."""
    def plain(a: Any) -> Any:
        return "*" if isinstance(a, fx.Node) else a

    return repr((fx.node.map_aggregate(node.args, plain), fx.node.map_aggregate(dict(node.kwargs), plain)))


def _unit_module(unit: Sequence[fx.Node], external: Sequence[fx.Node], const: set, gm: fx.GraphModule,
                 name: str) -> fx.GraphModule:
    """A GraphModule that runs exactly the unit's operators, reading its inputs as arguments."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(external):
        env[a] = g.placeholder(f"in{k}")
        if "val" in a.meta:  # the shape a pass below may choose by
            env[a].meta["val"] = a.meta["val"]

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            if a not in const:
                raise CaptureError(f"operator {a.name} is read by unit {name} but produced elsewhere")
            env[a] = g.node_copy(a, lookup)
        return env[a]

    for m in unit:
        env[m] = g.node_copy(m, lookup)
    g.output(env[unit[-1]])
    _activations_in_place(g)
    max_pools_by_slices(g)  # bit-identical, and on this CPU up to 5x faster than PyTorch's kernel
    # Weights (and, from torch.fx, leaf modules) are attributes of the unit itself, under flat names: read through the model's module path
    # (``self.trunk.block1["0"].f.se.fc1.weight``) each costs one nn.Module.__getattr__ per level, on every
    # call, which made a unit-by-unit run of RegNet 20% slower than the model's own forward.
    attributes: dict[str, Any] = {}
    for node in g.nodes:
        if node.op in ("get_attr", "call_module"):
            value = ops.get_attr_value(node, gm)
            flat = "".join(c if c.isalnum() else "_" for c in str(node.target))
            while flat in attributes and attributes[flat] is not value:
                flat += "_"
            attributes[flat] = value
            node.target = flat
    # Inference batch norms folded into their convolutions: one kernel instead of two passes over the output
    return fold_batch_norms(fx.GraphModule(attributes, g, class_name="Unit"))
