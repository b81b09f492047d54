"""Dimensions declared dynamic (torch.export's ``dynamic_shapes``): which sizes of a call one schedule serves.

A plan is made for one call signature, sizes included. A user whose model is called with many sizes along one
dimension (a sequence length, a batch) declares it the way torch.export takes it, and opsched then makes each
size's plan from the schedule already made for another size: the model captured at the new size, the same
schedule compiled, verified against the model and timed beside it (``opsched.jobs.OptimizeBuilder.resize``),
instead of a search of its own. :func:`dynamic_dims` reads the declaration, :func:`check_with_export` asks
torch.export whether the model keeps those dimensions free, and :func:`served_by` says whether a call is of the
sizes a plan's schedule serves.

>>> import torch
>>> from torch.export import Dim
>>> x = torch.zeros(2, 16, 8)
>>> dims = dynamic_dims(({1: Dim("length", min=4, max=64)},), (x,))
>>> dims
({1: (4, 64)},)
>>> from opsched.runtime.guards import call_signature
>>> served_by(call_signature((torch.zeros(2, 40, 8),)), call_signature((x,)), dims)
''
>>> served_by(call_signature((torch.zeros(2, 80, 8),)), call_signature((x,)), dims)
"input 0: dim 1 is 80, outside dynamic_shapes' range 4..64"
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.errors import CaptureError, OpschedError, first_line
from opsched.models.sharing import sharing_copy

Dims = tuple  # one entry per flat input (pytree leaf): {dim: (lowest, highest)} (empty: sizes fixed)


def dynamic_dims(spec: Any, inputs: Sequence[Any], model: Any = None) -> Dims:
    """The dimensions ``spec`` declares dynamic, for a call with positional arguments ``inputs``, each with its
    range, one entry per flat input (an argument that nests tensors has one per tensor, none of them dynamic).
    ``spec`` is as torch.export takes it: a tuple with one entry per positional argument, or a dict keyed by the
    names of ``model``'s forward arguments; an entry is None, a dict ``{dim: Dim}``, or a tuple with one ``Dim``,
    int (static, the example's size) or None per dimension. A named ``Dim`` gives its range; ``Dim.AUTO`` and
    ``Dim.DYNAMIC`` theirs (any size unless bounded). Raises :class:`~opsched.errors.OpschedError` for a
    declaration that does not fit the inputs."""
    inputs = tuple(inputs)
    if isinstance(spec, Mapping):
        spec = _by_position(spec, inputs, model)
    if not isinstance(spec, (tuple, list)) or len(spec) != len(inputs):
        raise OpschedError(f"dynamic_shapes must have one entry per input ({len(inputs)}), got {spec!r}")
    dims: list[dict] = []
    for i, (entry, x) in enumerate(zip(spec, inputs)):
        if entry is None:
            dims.extend({} for _ in pytree.tree_leaves(x))
            continue
        if not isinstance(x, torch.Tensor):
            raise OpschedError(f"dynamic_shapes: input {i} is a {type(x).__name__}: opsched takes dimensions "
                               "declared for tensor arguments only")
        if isinstance(entry, (tuple, list)):
            if len(entry) != x.dim():
                raise OpschedError(f"dynamic_shapes: input {i} has {x.dim()} dimensions, its entry {len(entry)}")
            entry = dict(enumerate(entry))
        if not isinstance(entry, Mapping):
            raise OpschedError(f"dynamic_shapes: input {i}: expected a dict {{dim: Dim}} or a tuple, got {entry!r}")
        ranges = {}
        for d, dim in entry.items():
            if not isinstance(d, int) or not -x.dim() <= d < x.dim():
                raise OpschedError(f"dynamic_shapes: input {i} has {x.dim()} dimensions, not a dimension {d!r}")
            found = _range(dim, f"input {i} dim {d}", x.shape[d])
            if found is None:
                continue
            low, high = found
            if not low <= x.shape[d] <= high:
                raise OpschedError(f"dynamic_shapes: input {i} dim {d} is {x.shape[d]} in the example, outside "
                                   f"its range {low}..{_bound(high)}")
            ranges[d % x.dim()] = found
        dims.append(ranges)
    return tuple(dims)


def _by_position(spec: Mapping, inputs: tuple, model: Any) -> list:
    """A dict of torch.export's form (keyed by the forward's argument names) as one entry per position."""
    if model is None:
        raise OpschedError("dynamic_shapes given by argument names needs the model")
    names = list(inspect.signature(model.forward).parameters)[:len(inputs)]
    unknown = set(spec) - set(names)
    if unknown:
        raise OpschedError(f"dynamic_shapes names {sorted(unknown)}, which the model's forward does not take as "
                           f"its first {len(inputs)} arguments ({', '.join(names)})")
    return [spec.get(name) for name in names]


def _range(dim: Any, where: str, size: int) -> tuple[int, float] | None:
    """A declared dimension's (lowest, highest) size (highest ``inf`` where unbounded), or None for one that is
    static (None, an int, ``Dim.STATIC``)."""
    if dim is None:
        return None
    if isinstance(dim, int) and not isinstance(dim, bool):
        if dim != size:
            raise OpschedError(f"dynamic_shapes: {where} is declared static at {dim}, the example's is {size}")
        return None
    hint = getattr(dim, "type", None)  # Dim.AUTO, Dim.DYNAMIC, Dim.STATIC, bounded or not (torch's _DimHint)
    if hint is not None and getattr(hint, "name", None) in ("AUTO", "DYNAMIC", "STATIC"):
        if hint.name == "STATIC":
            return None
        low, high = getattr(dim, "min", None), getattr(dim, "max", None)
        return int(low or 0), math.inf if high is None else _finite(high)
    low, high = getattr(dim, "min", None), getattr(dim, "max", None)
    if low is None or high is None:
        raise OpschedError(f"dynamic_shapes: {where}: expected a torch.export.Dim, got {dim!r}")
    return int(low), _finite(high)


def _finite(value: Any) -> float:
    """A declared bound as a number: torch.export keeps an unbounded max as sympy's infinity."""
    if isinstance(value, int):
        return value
    bound = float(value)
    return math.inf if math.isinf(bound) else int(bound)


def _bound(value: float) -> str:
    return "inf" if value == math.inf else str(int(value))


def check_with_export(model: torch.nn.Module, inputs: tuple, spec: Any, dims: Dims) -> tuple[Dims, str]:
    """Ask torch.export whether ``model`` keeps the dimensions ``spec`` declares dynamic (``dims``, as
    :func:`dynamic_dims` read them) free, and take their ranges as torch.export found them: a forward that fixes
    a named dimension (``x.view(2, -1)`` say) is refused, raising :class:`~opsched.errors.CaptureError` with
    torch.export's reason; a declaration torch.export finds malformed raises
    :class:`~opsched.errors.OpschedError`; a ``Dim.AUTO`` torch.export made static, and one with no size a
    call could take, is left out. Returns the dimensions and a note, empty unless torch.export could not trace
    the model at all (the declared ranges then stand: each size's plan is still verified).

    torch.export takes sizes 0 and 1 for constants, so an example of size 0 or 1 along a declared dimension is
    given to it repeated to size 2 (where the range admits 2)."""
    from torch._dynamo.exc import UserError, UserErrorType

    from opsched.graph.capture import pytorch_quiet

    try:
        with pytorch_quiet():  # torch.export logs pages of symbolic-shape reasoning
            exported = torch.export.export(sharing_copy(model).eval(), _grown(tuple(inputs), dims),
                                           dynamic_shapes=spec, strict=False)
    except UserError as e:
        if e.error_type == UserErrorType.CONSTRAINT_VIOLATION:
            raise CaptureError(f"dynamic_shapes: torch.export finds the model does not keep those dimensions free: "
                               f"{_reason(str(e))}") from e
        if e.error_type == UserErrorType.INVALID_INPUT:
            raise OpschedError(f"dynamic_shapes: torch.export refuses the declaration: {_reason(str(e))}") from e
        return dims, f"torch.export could not check dynamic_shapes ({first_line(e)}); each size's plan is verified"
    except Exception as e:  # noqa: BLE001 - a model torch.export cannot trace: opsched may still capture it
        return dims, f"torch.export could not check dynamic_shapes ({first_line(e)}); each size's plan is verified"
    return _as_exported(exported, dims), ""


def _grown(inputs: tuple, dims: Dims) -> tuple:
    """``inputs`` with each declared dimension of size 0 or 1 repeated to size 2 where its range admits 2 (only
    for torch.export's check: it would take those sizes for constants)."""
    flat, structure = pytree.tree_flatten(inputs)
    for k, (x, ranges) in enumerate(zip(flat, dims)):
        for d, (low, high) in ranges.items():
            if x.shape[d] < 2 and low <= 2 <= high:
                shape = list(x.shape)
                shape[d] = 2
                x = x.expand(shape).clone() if x.shape[d] == 1 else x.new_zeros(shape)
        flat[k] = x
    return tuple(pytree.tree_unflatten(flat, structure))


def _as_exported(exported: Any, dims: Dims) -> Dims:
    """``dims`` narrowed to what torch.export found: each dimension's range as its range constraints say, and
    none that it made static."""
    names = set(exported.graph_signature.user_inputs)
    values = [n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder" and n.name in names]
    if len(values) != len(dims):  # inputs torch.export takes otherwise than flat: the declared ranges stand
        return dims
    found = []
    for value, ranges in zip(values, dims):
        kept = {}
        for d, (low, high) in ranges.items():
            size = value.shape[d]
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is None or expr.is_number:
                continue  # made static (Dim.AUTO)
            bounds = exported.range_constraints.get(expr)
            if bounds is not None:
                low, high = max(low, _finite(bounds.lower)), min(high, _finite(bounds.upper))
            kept[d] = (low, high)
        found.append(kept)
    return tuple(found)


def _reason(text: str) -> str:
    """The first line of a constraint violation that says something (torch.export's first lines are headers)."""
    lines = [line.strip(" -") for line in text.splitlines() if line.strip(" -")]
    useful = [line for line in lines if "Constraints violated" not in line and not line.startswith("Suggested")]
    return (useful or lines or ["(no reason given)"])[0]


def served_by(signature: tuple, planned: tuple, dims: Dims) -> str | None:
    """Whether a call of ``signature`` is of the sizes ``planned``'s schedule serves under ``dims``: ``''`` when
    it is (the same call but for the sizes of declared dimensions, one of them at least, within their ranges, and
    the same memory layout), the reason in words when it differs only in a declared dimension's size out of its range, and
    None when it differs otherwise."""
    inputs, *modes, structure = signature
    planned_inputs, *planned_modes, planned_structure = planned
    if modes != planned_modes or structure != planned_structure or len(inputs) != len(planned_inputs) \
            or len(dims) != len(inputs):
        return None
    out_of_range, resized = "", False
    for i, (a, b, ranges) in enumerate(zip(inputs, planned_inputs, dims)):
        if a == b:
            continue
        if len(a) != 5 or len(b) != 5 or a[2:] != b[2:] or len(a[0]) != len(b[0]):
            return None
        for d, (size, was) in enumerate(zip(a[0], b[0])):
            if size == was:
                continue
            if d not in ranges:
                return None
            resized = True
            low, high = ranges[d]
            if not low <= size <= high and not out_of_range:
                out_of_range = f"input {i}: dim {d} is {size}, outside dynamic_shapes' range {low}..{_bound(high)}"
        order = dense_order(a[0], a[1])
        if order is None or order != dense_order(b[0], b[1]):
            return None
    return out_of_range if resized else None


def schedule_at(schedule: Any, graph: Any) -> Any:
    """``schedule`` (made for another size of the dynamic dimensions) as a schedule of ``graph``, the model
    captured at this size: the same stages and streams, this graph's fingerprint, no prediction (one made at
    another size would mislead the runner's check of timings against predictions); None where the graph has other
    units at this size (control flow on a size)."""
    import dataclasses

    if {n.name for n in graph.nodes} != {op.name for op in schedule.ops}:
        return None
    return dataclasses.replace(schedule, fingerprint=graph.fingerprint, measured=None, predicted_latency=0.0,
                               options=dict(schedule.options), stats=dict(schedule.stats))


def dense_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The order of a dense tensor's dimensions from the outermost to the innermost in memory (contiguous:
    ``(0, 1, ..., n-1)``; channels_last: ``(0, 2, 3, 1)``), or None when its elements do not fill one block
    (a slice with a step, an expanded tensor). Dimensions of size 1 go where their stride puts them.

    >>> dense_order((2, 3, 4, 5), (60, 1, 15, 3)), dense_order((2, 3), (6, 2))
    ((0, 2, 3, 1), None)
    """
    order = sorted(range(len(shape)), key=lambda d: (stride[d], -d), reverse=True)
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return tuple(order)


def dims_record(dims: Dims) -> list[dict[str, list]]:
    """``dims`` as a plan file records them: per input, ``{"dim": [lowest, highest or null]}``."""
    return [{str(d): [low, None if high == math.inf else int(high)] for d, (low, high) in ranges.items()}
            for ranges in dims]


def dims_from_record(record: Any, where: str) -> Dims:
    """The dims a plan file recorded (:func:`dims_record`); raises :class:`~opsched.schedule.ScheduleError`
    naming ``where`` for a record that is not one."""
    from opsched.schedule import ScheduleError

    try:
        return tuple({int(d): (int(low), math.inf if high is None else int(high)) for d, (low, high) in entry.items()}
                     for entry in record)
    except (TypeError, ValueError, AttributeError) as e:
        raise ScheduleError(f"{where}: build.dynamic is not a record of dynamic dimensions ({e})") from e
