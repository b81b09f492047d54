"""What a plan assumes about its calls, checked on every call, as torch.compile's guards are.

A plan is made for one *call signature*: the number and kind of its inputs, each tensor's shape, strides,
dtype and device, the caller's autocast state and deterministic-algorithms setting, and whether the caller asks
for gradients through an input (plans run in inference mode and give none). It also rests on the model's
weights as they were when it was built (batch norms folded into convolutions, weights reordered for the
packed kernels, regions compiled), and on the model being in eval mode. :func:`call_signature` is the first,
computed per call in a few microseconds; :class:`WeightWatch` the second: each parameter's and buffer's
identity, version counter and storage, so that ``load_state_dict`` (also ``assign=True``), an in-place update
under ``torch.no_grad()``, an optimizer step, ``.to(dtype)``, ``.double()`` or ``.half()`` is seen at the next
call. A write through ``tensor.data`` bypasses PyTorch's version counter and is not seen: call
``refresh()`` on the optimized module after one.

>>> import torch
>>> a, b = call_signature((torch.zeros(2, 3),)), call_signature((torch.zeros(3, 3),))
>>> difference(b, a)
'input 0: batch 3, plan made for 2'
>>> model = torch.nn.Linear(3, 3).eval()
>>> watch = WeightWatch(model)
>>> with torch.no_grad():
...     _ = model.weight.mul_(2)
>>> watch.changed()
'weight changed (updated in place)'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dis
import functools
import inspect
import itertools
import operator
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle as _HANDLES  # (its next_id counts every hook registered)

from opsched.errors import SignatureMismatch, StaleWeights

_DEVICE_TYPES = ("cpu", "cuda")


def modes() -> tuple:
    """The caller's state a plan depends on: autocast per device type (and its dtype), the
    deterministic-algorithms setting, and whether PyTorch's fast path for ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` is on (``torch.backends.mha``): called without gradients, the model takes it,
    and with a padding mask it answers zeros at the padded positions, which a captured program does not take; a
    plan verified with it off answered otherwise once it was turned on; and the default dtype, of the tensors a
    forward makes itself (``torch.linspace``), which a captured program holds as it was then."""
    return (autocast_now(), torch.are_deterministic_algorithms_enabled(), torch.backends.mha.get_fastpath_enabled(),
            torch.get_default_dtype())


def flat_signature(inputs: tuple) -> tuple[list[Any], tuple]:
    """The flat list of a call's inputs (``inputs``: its positional arguments, nested as the model takes them)
    and the call's signature: hashable, equal for two calls exactly when one plan serves both. The structure
    of the inputs is part of it (``{"a": x, "b": y}`` is not ``(x, y)``)."""
    if type(inputs) is tuple and inputs and set(map(type, inputs)) == _PLAIN:
        # the common call, positional tensors only: the same signature as below without pytree's walk and one
        # Python step per tensor (this runs on every call: see docs/calls.md, "What the guard costs")
        flat = list(inputs)
        structure = _flat_structure(len(flat))
        grads = map(_REQUIRES_GRAD, flat) if torch.is_grad_enabled() else itertools.repeat(False)
        described = tuple(zip(map(_SHAPE, flat), map(torch.Tensor.stride, flat), map(_DTYPE, flat),
                              map(_DEVICE, flat), grads))
    else:
        flat, structure = pytree.tree_flatten(inputs)
        grad = torch.is_grad_enabled()
        described = tuple((t.shape, t.stride(), t.dtype, t.device, grad and t.requires_grad)
                          if isinstance(t, torch.Tensor) else (type(t), _hashable(t)) for t in flat)
    return flat, (described, *modes(), structure)


_PLAIN = {torch.Tensor}
_SHAPE, _DTYPE, _DEVICE = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@functools.cache
def _flat_structure(count: int) -> pytree.TreeSpec:
    """How ``count`` positional tensors nest, as pytree says (a tensor is one of its leaves)."""
    return pytree.tree_flatten(tuple(range(count)))[1]


def autocast_now() -> tuple:
    """The calling thread's autocast: (device type, dtype) for each device type it is on for."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES if torch.is_autocast_enabled(d))


def in_autocast(states: tuple) -> contextlib.AbstractContextManager:
    """The autocast ``states`` (as :func:`autocast_now` gives them), to enter on another thread: autocast is
    thread-local (nothing to enter where it is off)."""
    if not states:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device, dtype in states:
        stack.enter_context(torch.autocast(device, dtype))
    return stack


def without_autocast() -> contextlib.AbstractContextManager:
    """Autocast off on this thread for every device type it is on for now."""
    stack = contextlib.ExitStack()
    for device, _ in autocast_now():
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def autocast_of(signature: tuple) -> contextlib.AbstractContextManager:
    """The autocast a call of ``signature`` was made under (see :func:`in_autocast`)."""
    return in_autocast(signature[1])


def call_signature(inputs: tuple) -> tuple:
    """The signature of a call with positional arguments ``inputs`` (see :func:`flat_signature`)."""
    return flat_signature(inputs)[1]


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def describe(signature: tuple) -> str:
    """A signature in words, e.g. ``input 0 (2, 3, 224, 224) float32``."""
    inputs, autocast, deterministic, fastpath, default_dtype, _ = signature
    parts = [f"input {i} " + (f"{tuple(s[0])} {_dtype_name(s[2])}" if len(s) == 5 else repr(s[1]))
             for i, s in enumerate(inputs)]
    if autocast:
        parts.append(f"autocast {_autocast_words(autocast)}")
    if deterministic:
        parts.append("deterministic algorithms")
    if not fastpath:
        parts.append("attention's fast path off")
    if default_dtype != torch.float32:
        parts.append(f"default dtype {_dtype_name(default_dtype)}")
    return ", ".join(parts) or "no inputs"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _autocast_words(autocast: tuple) -> str:
    return ", ".join(f"{device} {_dtype_name(dtype)}" for device, dtype in autocast)


def difference(got: tuple, want: tuple) -> str:
    """What differs between a call's signature ``got`` and a plan's ``want``, in words: the first difference,
    e.g. ``input 0: batch 3, plan made for 2``."""
    inputs, autocast, deterministic, fastpath, default_dtype, structure = got
    planned, planned_autocast, planned_deterministic, planned_fastpath, planned_default_dtype, planned_structure = want
    if len(inputs) != len(planned):
        return f"{len(inputs)} inputs, plan made for {len(planned)}"
    if structure != planned_structure:
        return f"the inputs are nested otherwise ({structure}), plan made for {planned_structure}"
    for i, (a, b) in enumerate(zip(inputs, planned)):
        if a == b:
            continue
        if len(a) != len(b):
            return f"input {i}: a {'tensor' if len(a) == 5 else type(a[1]).__name__}, plan made for " \
                   f"{'a tensor' if len(b) == 5 else repr(b[1])}"
        if len(a) == 2:
            return f"input {i}: {a[1]!r}, plan made for {b[1]!r}"
        shape, stride, dtype, device, _ = a
        if shape != b[0]:
            if len(shape) == len(b[0]) and shape[1:] == b[0][1:]:
                return f"input {i}: batch {shape[0]}, plan made for {b[0][0]}"
            return f"input {i}: shape {tuple(shape)}, plan made for {tuple(b[0])}"
        if dtype != b[2]:
            return f"input {i}: {_dtype_name(dtype)}, plan made for {_dtype_name(b[2])}"
        if device != b[3]:
            return f"input {i}: on {device}, plan made for {b[3]}"
        if stride != b[1]:
            return f"input {i}: strides {stride}, plan made for {b[1]} (another memory layout)"
        return f"input {i}: asks for gradients, which a plan does not give (it runs in inference mode)"
    if autocast != planned_autocast:
        now = f"autocast on ({_autocast_words(autocast)})" if autocast else "autocast off"
        return now + (f", plan made under autocast ({_autocast_words(planned_autocast)})" if planned_autocast
                      else ", plan made with it off")
    if deterministic != planned_deterministic:
        return f"deterministic algorithms {'on' if deterministic else 'off'}, plan made with them " \
               f"{'on' if planned_deterministic else 'off'}"
    if fastpath != planned_fastpath:
        return f"attention's fast path (torch.backends.mha) {'on' if fastpath else 'off'}, plan made with it " \
               f"{'on' if planned_fastpath else 'off'}"
    if default_dtype != planned_default_dtype:
        return f"default dtype {_dtype_name(default_dtype)}, plan made with {_dtype_name(planned_default_dtype)}"
    return "nothing"


class WeightWatch:
    """The parameters and buffers of ``models`` as they are now; :meth:`changed` says, in words, what changed
    since (or None): a tensor replaced, added or removed (its module's table looked up), written in place (its
    version counter), given other storage (``.data =``, ``.to()``; the old storage is kept alive until the next
    :meth:`update`, so that its address cannot be handed out again and look unchanged), stepped by an optimizer
    (the fused ones write without moving version counters), a module replaced, a module that was in eval
    mode left it, a module's own attribute set to another value (a temperature, a flag, a convolution's padding;
    an equal plain value set again is not a change; of PyTorch's own layers, the settings their forward reads: see
    :func:`_attribute_slots`) or changed in place (a list's element, a config object's field, a plain tensor written: see :func:`snapshot`), a global
    the modules' code reads set or changed (see :func:`_global_slots`), or a forward hook added or removed
    (``attributes=False``: none of these). About 0.2 µs a tensor in a loop, 0.3 µs right
    after a plan's call (docs/calls.md).

    ``tensors=False`` watches the modules only (replaced, out of eval mode, their attributes and hooks, but not
    the settings of PyTorch's layers, which are made with the layer as its weights are), for weights that their
    owner promises not to change or to announce with :meth:`update`: about 2 µs a call for ResNet-18 (17
    attributes of torchvision's modules, the sizes of its 68 modules' attribute tables; its 138 hook tables counted
    only after a hook was registered somewhere), where its tensors' look takes about 17 more and its 196 settings
    about 6."""

    def __init__(self, *models: torch.nn.Module, tensors: bool = True, attributes: bool = True):
        self.models, self.watches_tensors, self.watches_attributes = models, tensors, attributes
        self.own_attributes: set[str] = set()  # those the models' forwards set themselves (see ignore)
        self.moved_in_builds: set[str] = set()  # the globals seen changing across the last build (see ignore)
        self._walk()

    def _walk(self) -> None:
        """Find the models' modules, parameters and buffers (again, after a module was given another)."""
        models = self.models
        self.slots = [(table, name, f"{path}.{name}" if path else name)
                      for model in models for path, module in model.named_modules()
                      for table in (module._parameters, module._buffers) for name in table]
        # the modules in eval mode now whose forward may read their mode (a container such as a model batch may
        # not be in eval mode: its models are)
        # (a module whose own forward never reads its mode is looked at all the same where the code of a module
        # holding it reads `training`: `if self.conv.training`)
        read_by_parent = {id(child) for model in models for parent in model.modules()
                          if "training" in _names_read_by_class(type(parent)) for child in parent.children()}
        evaluating = [(path, module) for model in models for path, module in model.named_modules()
                      if not module.training and (not _mode_free(module) or id(module) in read_by_parent)]
        self.module_paths = [path or type(module).__name__ for path, module in evaluating]
        self.modules = [module for _, module in evaluating]
        self.every_module = [module for model in models for module in model.modules()]
        # the modules' tables of submodules, what they held, and each module's class: a submodule deleted, popped,
        # set in the table directly (none of which PyTorch's registration hook sees) or given another class
        self.child_tables = [module._modules for module in self.every_module]
        self.children = list(itertools.chain.from_iterable(map(dict.values, self.child_tables)))
        self.classes = list(map(type, self.every_module))
        # the modules' own attributes a forward may read (stride, eps, a temperature, a flag), which a captured
        # program holds as they were, and the hooks that wrap their forwards
        attributes = [(table, key, where) for table, key, where in _watched_slots(models, self.watches_tensors)
                      if where not in self.own_attributes] if self.watches_attributes else []
        self.attribute_tables = [table for table, *_ in attributes]
        self.attribute_names = [key for _, key, _ in attributes]
        self.attribute_paths = [path for *_, path in attributes]
        self.hook_tables = [getattr(module, hooks) for module in self.every_module for hooks in _HOOKS
                            if isinstance(getattr(module, hooks, None), dict)] + _global_hooks() \
            if self.watches_attributes else []
        # the modules' attribute tables and their sizes: an attribute set that was not there when the slots were
        # found (a layer's forward replaced, a setting a forward reads with a default) moves a size
        self.module_tables = [module.__dict__ for module in self.every_module] if self.watches_attributes else []
        self.walked_sizes = list(map(len, self.module_tables))
        self.tables = [table for table, *_ in self.slots]
        self.names = [name for _, name, *_ in self.slots]
        self.update()

    def update(self) -> None:
        """Take the weights as they are now as the ones plans are built from."""
        if self._restructured() or list(map(len, self.module_tables)) != self.walked_sizes:
            self._walk()
            return
        self.steps = _STEPS_TAKEN[0]
        self.take_attributes()
        self.found = list(map(dict.get, self.tables, self.names))  # None where a module has no tensor by that name
        found = self.found
        present = [(slot, t) for slot, t in zip(self.slots, found) if t is not None]
        self.tensors = [t for _, t in present]
        self.ids = {id(t) for t in self.tensors}
        # inference tensors, and tensors whose data is one, have no version counter (they cannot be written
        # outside inference mode)
        versioned = [(slot, t) for slot, t in present if _has_version(t)]
        self.versioned_paths = [slot[2] for slot, _ in versioned]
        self.versioned = [t for _, t in versioned]
        self.versions = list(map(_VERSION, self.versioned))
        self.stored_paths = [slot[2] for slot, _ in present]
        self.storages = list(map(torch.Tensor.data_ptr, self.tensors))
        self.kept = [t.untyped_storage() for t in self.tensors]

    def changed(self) -> str | None:
        """What changed since :meth:`update`, in words, or None."""
        if any(map(_TRAINING, self.modules)):
            return self.in_training()
        if self._restructured():
            return "a module of the model was replaced, added or removed, or given another class"
        if not all(map(operator.is_, map(dict.get, self.attribute_tables, self.attribute_names),
                       self.attribute_values)):
            set_again = self._attribute_set()
            if set_again:
                return set_again
        objects, _, snapshots = self.deep  # (one tuple: another thread's ignore() replaces it whole)
        if objects and not unchanged(snapshots, objects):
            moved = self._moved_in_place()
            if moved:
                return differs_where(*moved[0])
        # a hook added anywhere moves the handles' count, one removed empties a table that held it: only then
        # are the models' hook tables counted (ResNet-18's 138 cost 2 µs, too much for every call)
        if (_HANDLES.next_id != self.handles or list(map(len, self.hooked)) != self.hooked_counts) and self.hook_tables:
            if list(map(tuple, self.hook_tables)) != self.hook_keys:  # (by handle: one removed, another added)
                return "a hook was added to or removed from a module of the model (plans run the forward as captured)"
            self.handles = _HANDLES.next_id  # (hooks of other modules)
        if not self.watches_tensors:
            return self._attribute_added()
        if not all(map(operator.is_, map(dict.get, self.tables, self.names), self.found)):
            return _which([slot[2] for slot in self.slots], list(map(id, map(dict.get, self.tables, self.names))),
                          list(map(id, self.found)),
                          "replaced (load_state_dict(assign=True), .to() or a new tensor), added or removed")
        try:
            versions = list(map(_VERSION, self.versioned))
        except RuntimeError:  # a tensor's data became an inference tensor's (.data = one): it changed
            return "a weight changed (its data replaced by an inference tensor)"
        if versions != self.versions:
            return _which(self.versioned_paths, versions, self.versions, "updated in place")
        storages = list(map(torch.Tensor.data_ptr, self.tensors))
        if storages != self.storages:
            return _which(self.stored_paths, storages, self.storages, "moved to new storage (.to(), .double(), "
                          ".data =)")
        if _STEPS_TAKEN[0] != self.steps:
            return self._stepped()
        return self._attribute_added()

    def ignore(self, paths: set[str], by_build: bool = False) -> None:
        """Stop watching the attributes at ``paths``: the models' forwards set them themselves (a counter, a size
        kept), which is no change of the user's to follow, and which a plan, not running the forward, never sets.
        ``by_build``: seen changing across a build (in the background, or before answering), whose copy of the
        model has its own attributes but shares the globals, which the user may have set meanwhile: a global is
        then left out only once seen changing across two builds in a row (a counter the forward keeps), so that a
        user's change is followed and the forward's own costs one rebuild, not one per call."""
        globals_moved = {path for path in paths if path.startswith("global ")}
        if by_build:
            twice = globals_moved & self.moved_in_builds
            self.moved_in_builds = globals_moved - twice
            paths = (paths - globals_moved) | twice
        with _IGNORING:
            if paths - self.own_attributes:
                self.own_attributes |= paths
                keep = [k for k, where in enumerate(self.attribute_paths) if where not in paths]
                self.attribute_tables = [self.attribute_tables[k] for k in keep]
                self.attribute_names = [self.attribute_names[k] for k in keep]
                self.attribute_paths = [self.attribute_paths[k] for k in keep]
                self.attribute_values = [self.attribute_values[k] for k in keep]
                objects, deep_paths, snapshots = self.deep
                keep = [k for k, path in enumerate(deep_paths) if path not in paths]
                self.deep = ([objects[k] for k in keep], [deep_paths[k] for k in keep], [snapshots[k] for k in keep])

    def attributes_now(self) -> tuple[list[Any], set[str]]:
        """The watched attributes' values now, and the paths of those changed in place since they were taken (see
        :meth:`forward_set`)."""
        return self.attribute_values_now(), {path for *_, path in self._moved_in_place()}

    def attribute_values_now(self) -> list[Any]:
        """The watched attributes' values now."""
        return list(map(dict.get, self.attribute_tables, self.attribute_names))

    def forward_set(self, before: tuple[list[Any], set[str]]) -> None:
        """After the model itself answered a call: the attributes its forward set to another value, or changed in
        place, since ``before`` (:meth:`attributes_now`) are its own (:meth:`ignore`), and the rest are taken as
        they are (but those changed in place before the call: a change of the user's, for the next call to see)."""
        values, moved_before = before
        now = self.attribute_values_now()
        if len(now) != len(values):  # (another thread's call left some out meanwhile)
            self.attribute_values = now
        elif not all(map(operator.is_, now, values)):
            self.ignore(_set_again(self.attribute_paths, now, values))
            self.attribute_values = self.attribute_values_now()
        moved = {path for *_, path in self._moved_in_place()} - moved_before
        if moved:
            self.ignore(moved)
        if not moved_before:  # (values set again, equal, are new objects: their snapshots are taken again)
            self._take_in_place()

    def take_attributes(self) -> None:
        """Take the modules' attributes (and what they hold), the globals and the hooks as they are now."""
        self.attribute_values = self.attribute_values_now()
        self._take_in_place()
        self.hook_keys = list(map(tuple, self.hook_tables))
        self.hooked = [table for table in self.hook_tables if table]
        self.hooked_counts = list(map(len, self.hooked))
        self.handles = _HANDLES.next_id

    def _attribute_set(self) -> str | None:
        """Which attribute of a module was set to another value since :meth:`update`, in words, or None where
        each was only set again to an equal plain value (a forward that caches a size), which is then taken."""
        now = self.attribute_values_now()
        moved = _set_again(self.attribute_paths, now, self.attribute_values)
        for path, value, was in zip(self.attribute_paths, now, self.attribute_values):
            if path in moved:
                return f"{path} changed (set to {_short(value)}, was {_short(was)})"
        in_place = self._moved_in_place()  # (before the snapshots are taken again below, which would hide it)
        if in_place:
            return differs_where(*in_place[0])
        self.attribute_values = now
        self._take_in_place()  # (an equal list set again is another object: its snapshot is taken again)
        return None

    def _take_in_place(self) -> None:
        """Snapshot the watched values that can change in place (:func:`snapshot`), each object once (a config
        object every layer holds is compared once a call)."""
        objects, paths, snapshots, seen = [], [], [], set()
        for path, value in zip(self.attribute_paths, self.attribute_values):
            if id(value) in seen or not _changes_in_place(value):
                continue
            seen.add(id(value))
            objects.append(value)
            paths.append(path)
            try:
                snapshots.append(snapshot(value))
            except Exception:  # noqa: BLE001 - changed while it was copied (another thread): by identity then
                snapshots.append(_Same(value))
        self.deep = (objects, paths, snapshots)

    def _moved_in_place(self) -> list[tuple[Any, Any, str]]:
        """(its snapshot, the value, its path) for each value changed in place since :meth:`_take_in_place`, as
        :func:`differs_where` takes them (at once where none did)."""
        objects, paths, snapshots = self.deep
        if not objects or unchanged(snapshots, objects):
            return []
        return [(was, value, path) for path, was, value in zip(paths, snapshots, objects)
                if not unchanged([was], [value])]

    def _attribute_added(self) -> str | None:
        """Which attribute a forward may read (:func:`_read_by_forward`) was set on a module since the watch found
        its slots, where it was not, in words; or None (an attribute no forward reads: a private cache)."""
        if list(map(len, self.module_tables)) == self.walked_sizes:
            return None
        known = set(self.attribute_paths)
        for model in self.models:
            for path, module in model.named_modules():
                for key in _read_by_forward(module, self.watches_tensors):
                    where = f"{path}.{key}" if path else key
                    if where not in known and where not in self.own_attributes:
                        return f"{where} set (set to {_short(module.__dict__.get(key))}, was not there)"
        # none a forward reads: the slots stay what they are (nothing is taken again, so that a change made on
        # another thread meanwhile is still seen at the next call)
        self.walked_sizes = list(map(len, self.module_tables))
        return None

    def _restructured(self) -> bool:
        """Whether the models' modules are other than they were: a submodule given another module, added, deleted
        or popped, or a module given another class (``module.__class__ = ...``)."""
        return list(itertools.chain.from_iterable(map(dict.values, self.child_tables))) != self.children \
            or list(map(type, self.every_module)) != self.classes

    def _stepped(self) -> str | None:
        """Whether an optimizer stepped one of the tensors since :meth:`update` (the fused ones write without
        moving version counters)."""
        steps = list(_STEPPED)
        if steps and steps[0][0] > self.steps + 1:  # more steps than are remembered: one may have been ours
            return "an optimizer stepped the weights (too many steps since the last call to tell whose)"
        for count, ids in steps:
            if count > self.steps and not ids.isdisjoint(self.ids):
                return "an optimizer stepped the weights"
        self.steps = _STEPS_TAKEN[0]
        return None

    def in_training(self) -> str | None:
        """Which module left eval mode, in words, or None."""
        for path, module in zip(self.module_paths, self.modules):
            if module.training:
                return f"{path} is in training mode (plans are made for eval mode)"
        return None


def _has_version(tensor: torch.Tensor) -> bool:
    try:
        tensor._version  # noqa: B018 - the question is whether it raises
    except RuntimeError:
        return False
    return True


def _which(names: Sequence[str], now: list[Any], before: list[Any], how: str) -> str:
    for name, a, b in zip(names, now, before):
        if a != b:
            return f"{name} changed ({how})"
    return f"a weight changed ({how})"


# PyTorch's own modules whose forward never reads self.training (their exact classes: a subclass may): a watch
# need not look at their mode on every call
_MODE_FREE_MODULES = {"torch.nn.modules.conv", "torch.nn.modules.linear", "torch.nn.modules.pooling",
                      "torch.nn.modules.flatten", "torch.nn.modules.padding", "torch.nn.modules.container",
                      "torch.nn.modules.pixelshuffle", "torch.nn.modules.upsampling", "torch.nn.modules.channelshuffle",
                      "torch.nn.modules.activation"}
_MODE_DEPENDENT = {"MultiheadAttention", "RReLU"}  # in those modules, but with dropout or a random slope


def _mode_free(module: torch.nn.Module) -> bool:
    kind = type(module)
    return kind.__module__ in _MODE_FREE_MODULES and kind.__name__ not in _MODE_DEPENDENT


def _attribute_slots(models: Sequence[torch.nn.Module], settings: bool = True) -> list[tuple[dict, str, str]]:
    """Each module's own attributes a forward may read, as (its ``__dict__``, the name, the path): of PyTorch's own
    layers, the settings their code reads (:func:`_settings_read`: a convolution's stride and padding, a norm's eps,
    a slope, a scale factor; not ``in_channels``, which PyTorch's code reads only in ``__init__``), unless
    ``settings`` is false; of every other module (torchvision's, timm's, the user's), and of a PyTorch layer whose
    ``forward`` was replaced on the instance, each public attribute, and the private ones its class's code reads
    (``self._scale``; not ``nn.Module``'s own: ``_parameters``, the hooks). Never ``training``, which is watched
    on its own."""
    return [(module.__dict__, key, f"{path}.{key}" if path else key)
            for model in models for path, module in model.named_modules()
            for key in _read_by_forward(module, settings)]


def _read_by_forward(module: torch.nn.Module, settings: bool = True) -> list[str]:
    """The names in ``module.__dict__`` its forward may read (see :func:`_attribute_slots`)."""
    kind, table = type(module), module.__dict__
    if kind.__module__.startswith("torch.nn.") and "forward" not in table:
        if not settings:
            return []
        read = _settings_read(kind)
        return [key for key in table if key in read and key != "training" and _setting(table[key])]
    read = _names_read_by_class(kind)
    return [key for key in table if key != "training"
            and (not key.startswith("_") or key in read and key not in _MODULE_INTERNALS)]


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # nn.Module's own: its tables and hooks


def _setting(value: Any) -> bool:
    """Whether ``value``, held by one of PyTorch's layers, is a setting: a plain value (:func:`_plain`), a list of
    them (an adaptive softmax's cutoffs) or a function; not an RNN's lists of its weights, watched as tensors."""
    return _plain(value) or callable(value) or type(value) is list and all(map(_plain, value))


def _names_read_by_class(kind: type) -> frozenset[str]:
    """The names the code of ``kind``'s ``forward`` reads, with its methods that this names and theirs, in its own
    classes (not PyTorch's or the standard library's)."""
    return _names_read_by_code_of(tuple(klass for klass in kind.__mro__ if not _foreign(klass.__module__)))


def _settings_read(kind: type) -> frozenset[str]:
    """The names the code of PyTorch's layer ``kind`` reads: its ``forward`` and the methods of its own that this
    names, and theirs, down to ``torch.nn.Module`` (whose call machinery reads the hooks, watched on their own, and
    ``forward``: a layer's own, set over its class's, is read too).

    >>> sorted(_settings_read(torch.nn.LeakyReLU) & set(vars(torch.nn.LeakyReLU(0.2))))
    ['inplace', 'negative_slope']
    >>> "in_channels" in _settings_read(torch.nn.Conv2d), "stride" in _settings_read(torch.nn.Conv2d)
    (False, True)
    """
    layers = tuple(klass for klass in kind.__mro__ if klass.__module__.startswith("torch.nn.")
                   and klass is not torch.nn.Module)
    return frozenset({"forward"}) | _names_read_by_code_of(layers)


@functools.lru_cache(maxsize=4096)  # (bounded: a class made per copy, as torch.fx's, is not kept for good)
def _names_read_by_code_of(classes: tuple[type, ...]) -> frozenset[str]:
    """The names read by the ``forward`` of ``classes`` and the methods it reaches (:func:`_methods_reached`)."""
    return frozenset().union(*(_names_read(inspect.unwrap(method).__code__) for method in _methods_reached(classes)))


def attributes_of(model: torch.nn.Module) -> dict[str, Any]:
    """The modules' own attributes of ``model``, and the globals their code reads, by path, now (see
    :func:`attributes_set_by`)."""
    return {where: table.get(key) for table, key, where in _watched_slots([model])}


@contextlib.contextmanager
def attributes_set_by(model: torch.nn.Module) -> Iterator[set[str]]:
    """A set that holds, once the block ends, the attributes of ``model`` (by path) set to another value or
    changed in place within it: around the model's own calls (or a copy's: the paths are the same), what its
    forward sets itself.

    >>> class Counts(torch.nn.Module):
    ...     def forward(self, x):
    ...         self.calls += 1
    ...         self.seen.append(x.shape)
    ...         return x
    >>> model = Counts()
    >>> model.calls, model.shape, model.seen = 0, (2, 8), []
    >>> with attributes_set_by(model) as found:
    ...     _ = model(torch.ones(1))
    ...     model.shape = (2, 8)  # set again, equal: no change
    >>> sorted(found)
    ['calls', 'seen']
    """
    before, found = attributes_of(model), set()
    kept = {path: snapshot(value) for path, value in before.items() if _changes_in_place(value)}
    yield found
    after = attributes_of(model)
    found |= _set_again([p for p in after if p in before], [after[p] for p in after if p in before],
                        [before[p] for p in after if p in before])
    found |= {path for path, was in kept.items() if path in after and not unchanged([was], [after[path]])}


def _set_again(paths: Sequence[str], now: Sequence[Any], before: Sequence[Any]) -> set[str]:
    """The ``paths`` whose value ``now`` is another than ``before``'s: another object, unless an equal plain one."""
    return {path for path, value, was in zip(paths, now, before) if value is not was and not _equal_plain(value, was)}


def _watched_slots(models: Sequence[torch.nn.Module], settings: bool = True) -> list[tuple[dict, str, str]]:
    """What a watch looks at besides the tensors and hooks: the modules' own attributes
    (:func:`_attribute_slots`, PyTorch's layers' settings unless ``settings`` is false) and the globals their code
    reads (:func:`_global_slots`)."""
    return _attribute_slots(models, settings) + _global_slots(models)


def _global_slots(models: Sequence[torch.nn.Module]) -> list[tuple[dict, str, str]]:
    """The module-level globals holding data or a function (not a module or class) that the models' own code
    reads, as (the globals' dict, the name, ``global NAME (its module)``), a function by identity (one replaced, a
    patched attention function say, is a change): read by the ``forward`` of every class of the
    models' modules, by the methods it names (and theirs), and by the plain functions those read and the ones these
    read, two calls down (not in PyTorch's own code). A captured program
    holds what it read as it was (``SCALE = 1.0`` in the model's file, set to 2.0 later; torch.compile guards on
    the globals it reads the same way). A module read there (``settings.SCALE``, ``settings.shifted(x)``,
    where ``import settings`` is at the top of the file) is followed as well, unless it is PyTorch's, NumPy's or the
    standard library's. Not followed: methods of other objects, and a module reached through an object's
    attribute. A global that code sets is its own, and not watched; one that code not followed sets is seen as a
    change, unless the model's own call set it or it changed across two builds in a row
    (:meth:`WeightWatch.ignore`).

    >>> GAIN = 2.0
    >>> class Scaled(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * GAIN
    >>> [(name, where) for _, name, where in _global_slots([Scaled()])]
    [('GAIN', 'global GAIN (opsched.runtime.guards)')]
    """
    slots: dict[tuple[int, str], tuple[dict, str, str]] = {}
    own: set[tuple[int, str]] = set()  # set by some class's code: the forward's own, whichever class reads them
    for kind in dict.fromkeys(type(module) for model in models for module in model.modules()):
        if _foreign(kind.__module__):
            continue
        read, written = _class_globals(kind)
        own |= written
        for table, name in read:
            slots.setdefault((id(table), name), (table, name, f"global {name} ({table.get('__name__', '?')})"))
    return [slot for key, slot in slots.items() if key not in own]


@functools.lru_cache(maxsize=4096)  # (bounded: a class made per copy, as torch.fx's, is not kept for good)
def _class_globals(kind: type) -> tuple[tuple[tuple[dict, str], ...], frozenset[tuple[int, str]]]:
    """The (globals' dict, name) of the data globals that class ``kind``'s ``forward`` reads (each of its classes'
    own), with the methods of the classes whose names it reads (``self.helper(x)``), and theirs (see
    :func:`_global_slots`); and the (id of the dict, name) of those the code sets. Computed once a class: the
    code does not change, the values are read from the dict."""
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    written: set[tuple[int, str]] = set()
    seen: set[int] = set()
    for method in _methods_reached([klass for klass in kind.__mro__ if not _foreign(klass.__module__)]):
        _read_globals(method, found, written, seen, depth=3)
    return tuple(found.values()), frozenset(written)


def _methods_reached(classes: Sequence[type]) -> Iterator[types.FunctionType]:
    """The ``forward`` of each of ``classes`` (each class's own, for ``super().forward()`` and overridden helpers),
    the methods of theirs whose names it reads (``self.helper(x)``, a property), and theirs: each function once, as
    a decorator wraps it (:func:`inspect.unwrap` gives its own)."""
    names, methods = ["forward"], set()
    while names:
        name = names.pop()
        for klass in classes:
            member = vars(klass).get(name)
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            member = getattr(member, "fget", member)  # property
            if not isinstance(member, types.FunctionType) or member in methods:
                continue
            methods.add(member)
            yield member
            names.extend(_names_read(inspect.unwrap(member).__code__))


def _names_read(code: types.CodeType) -> set[str]:
    """The names ``code`` reads (globals and attributes), its nested code's included."""
    return {name for inner in _nested(code) for name in inner.co_names}


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code nested in it (functions, lambdas and comprehensions it defines)."""
    codes = [code]
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        yield code


# instructions that leave the value read before them where it was (a module whose attribute is read next)
_PASSING = frozenset({"EXTENDED_ARG", "NOP", "CACHE", "COPY", "PRECALL"})


def _read_globals(function: types.FunctionType, found: dict, written: set, seen: set[int], depth: int) -> None:
    """Add to ``found`` the data globals ``function`` reads (its nested code included; the function a decorator
    wraps, ``functools.wraps`` style, rather than the wrapper), and the data attributes it reads of the modules it
    reads (``settings.SCALE``, where ``settings`` is a module of the user's or a library's, not PyTorch's,
    NumPy's or the standard library's), following the plain functions it reads (``helpers.scale``) ``depth``
    calls deep (the method's, two below it); and to ``written`` those the code sets (``global n; n += 1``,
    ``settings.n += 1``): the forward's own."""
    function = inspect.unwrap(function)
    if id(function.__code__) in seen or _foreign(function.__module__):
        return
    seen.add(id(function.__code__))
    globals_ = function.__globals__
    for code in _nested(function.__code__):
        module = None  # the globals of the module the instruction before read, whose attribute this may read
        modules_read: list[dict] = []
        stored = set()  # attribute names this code sets (on a module read here, at least)
        for instruction in dis.get_instructions(code):
            name, op = instruction.argval, instruction.opname
            if op in _PASSING:
                continue
            if op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                written.add((id(globals_), name))
            elif op in ("STORE_ATTR", "DELETE_ATTR"):
                stored.add(name)
            if op == "LOAD_GLOBAL":
                table = globals_
            elif op in ("LOAD_ATTR", "LOAD_METHOD") and module is not None:
                table = module
            else:
                module = None
                continue
            module = None
            if name not in table:
                continue
            value = table[name]
            if isinstance(value, types.ModuleType):
                if not _foreign(value.__name__):
                    module = vars(value)
                    modules_read.append(module)
            elif isinstance(value, type):
                continue
            else:  # data, or a function: replaced (a patched attention function), the code reads the new one
                if isinstance(value, types.FunctionType) and depth > 1:
                    _read_globals(value, found, written, seen, depth - 1)
                if _data(value) or callable(value):
                    found.setdefault((id(table), name), (table, name))
        written.update((id(table), name) for table in modules_read for name in stored)


def _foreign(module_name: str | None) -> bool:
    """Whether code or data of the module named ``module_name`` is PyTorch's, NumPy's or Python's own (the
    standard library's), whose state a model's forward does not keep: not followed."""
    package = (module_name or "builtins").partition(".")[0]
    return package in ("torch", "numpy", "builtins") or package in sys.stdlib_module_names


def _data(value: Any) -> bool:
    """Whether ``value`` is data a forward may read and a user may change: not a module, class, function or
    method, nor an object of PyTorch's or the standard library's (a logger, a lock)."""
    if isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                          functools.partial, torch.nn.Module)):
        return False
    return _plain(value) or isinstance(value, (list, tuple, dict, set, frozenset, torch.Tensor)) or _is_array(value) \
        or _plain_object(value)


def _changes_in_place(value: Any) -> bool:
    """Whether ``value`` can change without being set again: a list, dict or set, a tuple holding one, a tensor, a
    NumPy array, or a plain object (:func:`_plain_object`)."""
    if isinstance(value, tuple):
        return any(map(_changes_in_place, value))
    return isinstance(value, (list, dict, set, torch.Tensor)) or _is_array(value) or _plain_object(value)


def _plain_object(value: Any) -> bool:
    """An object that holds its fields in ``__dict__`` or in ``__slots__`` (a configuration, such as Hugging Face's
    ``config``, a dataclass with slots, ``argparse.Namespace``), of the user's or a library's class, neither a
    module nor a tensor nor PyTorch's or the standard library's (a logger, a lock), but its two namespaces and
    ``functools.partial`` (whose keywords a user may change in place)."""
    kind = type(value)
    if kind in _STANDARD_OBJECTS:
        return True
    return ((hasattr(value, "__dict__") or bool(_slot_names(kind)))
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType))
            and not _foreign(kind.__module__))


_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
_STANDARD_OBJECTS = (*_NAMESPACES, functools.partial)  # the standard library's objects watched as plain ones


@functools.lru_cache(maxsize=1024)
def _slot_names(kind: type) -> tuple[str, ...]:
    """The names of ``kind``'s ``__slots__``, its classes' own included (a dataclass with ``slots=True``)."""
    names = []
    for klass in kind.__mro__:
        slots = vars(klass).get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(name for name in dict.fromkeys(names) if name not in ("__dict__", "__weakref__"))


def _fields(value: Any) -> dict:
    """A plain object's fields (:func:`_plain_object`): its ``__dict__``, its slots, and a partial's function,
    arguments and keywords."""
    if type(value) is functools.partial:
        return {"func": value.func, "args": value.args, "keywords": value.keywords}
    fields = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for name in _slot_names(type(value)):
        if hasattr(value, name):
            fields[name] = getattr(value, name)
    return fields


# how much of a value a snapshot copies: past this, objects are compared by identity only
_SNAPSHOT_DEPTH, _SNAPSHOT_SIZE = 6, 2_000


def snapshot(value: Any) -> Any:
    """A copy of ``value`` that :func:`unchanged` compares with it later, to see whether it changed in place:
    lists, tuples, dicts and sets copied (their elements too), a plain object (:func:`_plain_object`) as its
    fields, a tensor as its identity, version counter and storage, a NumPy array as its identity, shape, dtype and
    bytes, numbers and strings as they are, anything else by identity; their subclasses (an ``OrderedDict``, a
    named tuple, a dict with fields) by their type, items and fields. Past 6 levels, or a container or array whose
    elements would take the copy past 2,000, by identity (so that each call compares little). Numbers compare by ``==``: one set to an equal number of another type
    (1 where 1.0 was) is not seen.

    >>> table = [1.0, {"scale": 2}]
    >>> kept = snapshot(table)
    >>> unchanged([kept], [table])
    True
    >>> table[1]["scale"] = 3
    >>> unchanged([kept], [table])
    False
    """
    budget = [_SNAPSHOT_SIZE]
    return _copy(value, _SNAPSHOT_DEPTH, budget)


def _copy(value: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return _TensorAt(value)
    if _is_array(value):
        if value.size > budget[0] or value.dtype.hasobject:  # (objects in it: by identity)
            return _Same(value)
        budget[0] -= value.size
        return _ArrayAt(value)
    if depth == 0 or (isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > budget[0]):
        return _Same(value)
    if kind is list:
        budget[0] -= len(value)
        return [_copy(v, depth - 1, budget) for v in value]
    if kind is tuple:
        budget[0] -= len(value)
        return tuple(_copy(v, depth - 1, budget) for v in value)
    if kind is dict:
        budget[0] -= len(value)
        return {k: _copy(v, depth - 1, budget) for k, v in value.items()}
    if kind in (set, frozenset):
        budget[0] -= len(value)
        return kind(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):  # a subclass: its type, items and fields
        items = _copy(dict(value) if isinstance(value, dict) else
                      (set(value) if isinstance(value, (set, frozenset)) else list(value)), depth, budget)
        fields = _copy(vars(value), depth - 1, budget) if hasattr(value, "__dict__") else None
        return _Items(value, items, fields)
    if _plain_object(value):
        return _Fields(value, _copy(_fields(value), depth - 1, budget))
    return _Same(value)


def unchanged(snapshots: Sequence[Any], values: Sequence[Any]) -> bool:
    """Whether each of ``values`` is as its :func:`snapshot` was taken. The snapshot is on the left of each
    comparison, so that its own elements compare first (by identity where they must); a comparison that cannot
    answer (an array set where a number was) is a change."""
    try:
        return all(map(operator.eq, snapshots, values))
    except Exception:  # noqa: BLE001 - any comparison that fails: another value than the one taken
        return False


_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size})


class _Same:
    """A snapshot's element compared by identity (a module, an array, a function)."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return other is self.value


class _TensorAt(_Same):
    """A tensor as a snapshot holds it: the same tensor, not written in place (its version counter) nor given
    other storage since."""

    __slots__ = ("storage", "version")

    def __init__(self, value: torch.Tensor):
        super().__init__(value)
        self.version = value._version if _has_version(value) else None
        self.storage = _storage(value)

    def __eq__(self, other: object) -> bool:
        return other is self.value and (self.version is None or other._version == self.version) \
            and _storage(other) == self.storage


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data is, or None for a tensor without storage (a sparse one)."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


class _ArrayAt(_Same):
    """A NumPy array as a snapshot holds it: the same array, with the same shape, dtype and bytes (a copy of them,
    compared on each call: arrays of up to 2,000 elements are snapshot so)."""

    __slots__ = ("data", "kind", "shape")

    def __init__(self, value: Any):
        super().__init__(value)
        self.shape, self.kind, self.data = value.shape, value.dtype, value.tobytes()

    def __eq__(self, other: object) -> bool:
        return other is self.value and other.shape == self.shape and other.dtype == self.kind \
            and other.tobytes() == self.data


def _is_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy array, of a subclass too (a memory map); without importing NumPy where nothing
    did."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


class _Fields(_Same):
    """A plain object as a snapshot holds it: the same object, with fields equal to ``fields`` (a snapshot)."""

    __slots__ = ("fields",)

    def __init__(self, value: Any, fields: dict):
        super().__init__(value)
        self.fields = fields

    def __eq__(self, other: object) -> bool:
        return other is self.value and self.fields == _fields(other)


class _Items(_Same):
    """A subclass of list, tuple, dict or set as a snapshot holds it: a value of the same type, with equal items
    and fields (snapshots), whether or not the same object (torch.export gives a module's containers back as
    copies)."""

    __slots__ = ("fields", "items")

    def __init__(self, value: Any, items: Any, fields: dict | None):
        super().__init__(value)
        self.items, self.fields = items, fields

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self.value):
            return False
        items = self.items
        now = dict(other) if isinstance(items, dict) else (set(other) if isinstance(items, set) else list(other))
        return items == now and (self.fields is None or self.fields == vars(other))


def differs_where(was: Any, value: Any, path: str) -> str:
    """Where ``value`` (at ``path``) first differs from its :func:`snapshot` ``was``, in words.

    >>> table = {"scales": [1.0, 2.0]}
    >>> kept = snapshot(table)
    >>> table["scales"][1] = 3.0
    >>> differs_where(kept, table, "head.table")
    "head.table['scales'][1] changed in place (now 3.0, was 2.0)"
    """
    while True:
        if isinstance(was, _Fields) and was.value is value and type(was.fields) is dict:
            was, value, attribute = was.fields, _fields(value), True
        else:
            attribute = False
        inner = _first_difference(was, value)
        if inner is None:
            shown_was = was.value if isinstance(was, _Same) else was
            if isinstance(was, (_TensorAt, _ArrayAt)) and was.value is value:
                return f"{path} changed in place (written)"
            return f"{path} changed in place (now {_short(value)}, was {_short(shown_was)})"
        key, was, value = inner
        path = f"{path}.{key}" if attribute else f"{path}[{key!r}]"


def _first_difference(was: Any, value: Any) -> tuple[Any, Any, Any] | None:
    """The first (key, its snapshot, its value) where container ``value`` differs from ``was``, or None where
    they are not containers of one kind and length (the difference is the value itself)."""
    if isinstance(was, list) and type(value) is list and len(was) == len(value) or \
            isinstance(was, tuple) and isinstance(value, tuple) and len(was) == len(value):
        pairs = enumerate(zip(was, value))
    elif isinstance(was, dict) and isinstance(value, dict) and was.keys() == value.keys():
        pairs = ((key, (was[key], value[key])) for key in was)
    else:
        return None
    for key, (a, b) in pairs:
        if not unchanged([a], [b]):
            return key, a, b
    return None


def _short(value: Any) -> str:
    """``value`` in a few words: its repr, cut to 60 characters."""
    try:
        text = " ".join(repr(value).split())  # (a configuration's repr spans lines)
    except Exception:  # noqa: BLE001 - a repr that fails says nothing useful
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


# the hooks a module's __call__ runs around its forward in inference (a captured program holds those there were)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _global_hooks() -> list[dict]:
    from torch.nn.modules import module

    return [table for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
            if isinstance(table := getattr(module, name, None), dict)]


def _equal_plain(value: Any, was: Any) -> bool:
    """Whether ``value`` is ``was`` set again: of one type, and both plain (:func:`_plain`) and equal, or a list,
    dict, tuple or set equal to it element by element (as :func:`snapshot` compares them: torch.export gives a
    module's list attributes back as copies)."""
    if type(value) is not type(was):
        return False
    if _plain(value) and _plain(was):
        return value == was
    return type(value) in (list, dict, tuple, set, frozenset) and unchanged([snapshot(was)], [value])


def _plain(value: Any) -> bool:
    """A value compared by equality rather than identity: None, a number, a string, a dtype, or a tuple of such."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


_VERSION = operator.attrgetter("_version")
_IGNORING = threading.Lock()  # one ignore() at a time: the builder's thread and a caller's may both leave some out
_TRAINING = operator.attrgetter("training")


# The optimizer steps of the process, each with the ids of the tensors it may have written (the last 64): the
# fused optimizers (Adam(fused=True), ...) write without moving the tensors' version counters.
_STEPS_TAKEN = [0]
_STEPPED: collections.deque = collections.deque(maxlen=64)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS_TAKEN[0] += 1
    _STEPPED.append((_STEPS_TAKEN[0], frozenset(id(p) for group in optimizer.param_groups for p in group["params"])))


register_optimizer_step_post_hook(_optimizer_stepped)


class Guard:
    """A plan's guard: the call ``signature`` it was made for and the ``weights`` (a :class:`WeightWatch`, or
    None where no model is known) it was built from."""

    def __init__(self, signature: tuple, weights: WeightWatch | None = None):
        self.signature, self.weights = signature, weights

    @classmethod
    def of(cls, inputs: tuple, model: torch.nn.Module | None = None) -> Guard:
        """The guard of a plan made now for a call with positional arguments ``inputs``, from ``model``'s
        weights."""
        # (not the modules' attributes: the model's own calls, which verify the plan, may set some)
        return cls(call_signature(inputs),
                   WeightWatch(model, attributes=False) if isinstance(model, torch.nn.Module) else None)

    def check(self, inputs: tuple) -> list[Any]:
        """The flat inputs of a call with positional arguments ``inputs``; raises
        :class:`~opsched.errors.SignatureMismatch` or :class:`~opsched.errors.StaleWeights` unless the plan
        serves it."""
        flat, signature = flat_signature(inputs)
        if signature != self.signature:
            raise SignatureMismatch(f"{difference(signature, self.signature)}; compile a plan for this call, or "
                                    "use the module opsched.optimize returns, which makes one")
        changed = self.weights.changed() if self.weights is not None else None
        if changed:
            raise StaleWeights(f"{changed} since this plan was built: compile it again, or use the module "
                               "opsched.optimize returns, which follows the weights")
        return flat


def cloned(value: Any) -> Any:
    """A copy of an input to build a plan with later (the caller may overwrite its own), with the same
    strides where the tensor's layout can be copied (an expanded tensor's cannot: it is kept as it is)."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    return copy if copy.stride() == value.stride() else value.detach()


def copied(inputs: tuple) -> tuple:
    """A copy of a call's positional arguments (each tensor as :func:`cloned` copies it), nested as they are."""
    return tuple(pytree.tree_map(cloned, list(inputs)))


def inputs_record(inputs: tuple) -> tuple[list[dict[str, Any]], str]:
    """The inputs of a call (its positional arguments) as a plan file records them: each tensor's shape,
    strides, dtype and device, each other value as it is (JSON) or its repr; and how they nest (torch's pytree
    spec, as ``treespec_dumps`` writes it)."""
    flat, structure = pytree.tree_flatten(inputs)
    record = []
    for t in flat:
        if isinstance(t, torch.Tensor):
            record.append({"shape": list(t.shape), "stride": list(t.stride()), "dtype": _dtype_name(t.dtype),
                           "device": str(t.device)})
        else:
            record.append({"value": t if isinstance(t, (int, float, bool, str, type(None))) else repr(t)})
    return record, pytree.treespec_dumps(structure)


def example_inputs(record: Sequence[Any], structure: str | None = None, seed: int = 0) -> tuple:
    """The positional arguments of a call as :func:`inputs_record` recorded it: random normal floats, zeros for
    integers and booleans, nested as ``structure`` says (a flat tuple without it). Raises TypeError or
    ValueError for a record that describes no call."""
    generator = torch.Generator().manual_seed(seed)
    flat = []
    for entry in record:
        if not isinstance(entry, dict):
            raise TypeError(f"an input must be described by an object, got {entry!r}")
        if "value" in entry:
            flat.append(entry["value"])
            continue
        dtype = getattr(torch, str(entry.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"unknown dtype {entry.get('dtype')!r}")
        shape, stride = entry.get("shape"), entry.get("stride")
        if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
                and all(isinstance(n, int) and n >= 0 for n in shape + stride)):
            raise ValueError(f"bad shape {shape!r} or strides {stride!r}")
        t = torch.empty_strided(shape, stride, dtype=dtype)
        if dtype.is_floating_point or dtype.is_complex:
            values = torch.randn(shape, generator=generator).to(dtype)
        else:
            values = torch.zeros(shape, dtype=dtype)
        flat.append(t.copy_(values).to(entry.get("device", "cpu")))
    return pytree.tree_unflatten(flat, pytree.treespec_loads(structure)) if structure else tuple(flat)
