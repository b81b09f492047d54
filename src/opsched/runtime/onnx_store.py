"""ONNX exports kept on disk between runs, found again by what was exported.

Each optimize with ONNX Runtime kernels exports every unit, every block and the whole graph, and every region of
every plan, once per process: 170 exports of Inception V3, 2.2 s of a 25 s optimize whose every measurement was
already cached. An export is a pure function of what it is given, so it is kept in ``onnx/`` beside the latency
cache (:func:`opsched.cost.cache.cache_dir`), one file per export, named by :func:`export_key`: a hash of the
graph's code and modules (their own settings included, and nested graphs' code), every tensor it holds (by
content, hashed on every export: other weights are another export, so a model after ``load_state_dict`` or a write
through ``.data`` is exported anew), the shapes, dtypes and strides of the arguments, the export's options,
opsched's source and PyTorch's version. A module that holds what the hash cannot see (a tensor off the CPU, a
quantized one, a call of a Python function of the user's, whose globals and closures it cannot follow) is not
kept.

A stored export is still checked before it is used: the caller runs it once on the example arguments and
compares the outputs with the module's own (:meth:`opsched.runtime.kernels.OnnxRuntimeOperator`), exporting
again where they differ. The folder is kept under ``STORE_BYTES``, the least recently used files removed
first; a folder that cannot be written only means exporting every time.

>>> import tempfile, torch
>>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 3))
>>> store = OnnxStore(tempfile.mkdtemp())
>>> key = export_key(gm, (torch.zeros(1, 2),), {})
>>> store.get(key) is None
True
>>> store.put(key, b"exported")
>>> store.get(key), key == export_key(gm, (torch.ones(1, 2),), {})  # another value of the same shape
(b'exported', True)
>>> torch.nn.init.zeros_(gm.weight) is not None and key == export_key(gm, (torch.zeros(1, 2),), {})
False
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

STORE_BYTES = 2 * 1024 ** 3  # what the folder may hold; beyond it the least recently used exports go
_EVICT_EVERY = 256 * 1024 ** 2  # bytes written by this process between two checks of the folder's size



class _Unseen(Exception):
    """The module holds something whose content the key cannot include."""


def export_key(module: torch.nn.Module, args: Sequence[Any], options: dict[str, Any]) -> str | None:
    """The name under which the export of ``module`` on ``args`` with ``options`` is stored (see the module
    docstring); None where it cannot be named so (a module that is not an FX graph, one that calls a Python
    function of the user's, whose globals and closures a hash cannot follow, a tensor the hash cannot read)."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    digest = hashlib.sha256()

    def add(*parts: Any) -> None:
        digest.update(repr(parts).encode())

    # opsched's own source (the export's options, the graph passes before it) and PyTorch's version
    add("torch", torch.__version__, _opsched_source(), sorted((k, repr(v)) for k, v in options.items()))
    add(str(module))  # the module tree with each module's settings, and the graph's code
    try:
        for name, sub in module.named_modules():
            if isinstance(sub, torch.fx.GraphModule):  # a nested graph prints as its class name alone
                add(name, sub.code, [_function_key(node.target) for node in sub.graph.nodes
                                     if node.op == "call_function"])
            for attribute, value in sorted(vars(sub).items()):
                if isinstance(value, torch.Tensor):  # constants the graph holds as plain attributes
                    add(name, attribute, _tensor_key(value))
                elif isinstance(value, (bool, int, float, str, type(None))) or (
                        isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value)):
                    add(name, attribute, value)  # settings a module's repr may not print (a flag, a scale)
            for attribute, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
                add(name, attribute, _tensor_key(tensor))
        for value in torch.utils._pytree.tree_leaves(list(args)):
            add((list(value.shape), str(value.dtype), list(value.stride()), str(value.device))
                if isinstance(value, torch.Tensor) else repr(value))
    except _Unseen:
        return None
    return digest.hexdigest()


# where the functions a graph may call are defined so that their code is in the key: PyTorch's (its version is),
# opsched's (its source is), and Python's operators
_KNOWN_HOMES = ("torch", "opsched", "operator", "_operator", "math", "builtins")


def _function_key(target: Any) -> str:
    """A graph's function by name, where its code is covered by the key; else :class:`_Unseen`."""
    home = getattr(target, "__module__", None) or ""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)) or \
            home.split(".")[0] in _KNOWN_HOMES:
        return f"{home}.{getattr(target, '__qualname__', repr(target))}"
    raise _Unseen


@functools.cache
def _opsched_source() -> str:
    """A hash of opsched's Python source: an export stored by another version of opsched is not used."""
    import opsched

    digest = hashlib.sha256()
    root = Path(opsched.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's shape, dtype, strides and a hash of its content. Hashed every time, not remembered: a write
    through ``.data`` or a NumPy view leaves the version counter as it was (Inception V3's weights, hashed for
    its 167 exports, take a fraction of a second)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        raise _Unseen
    data = tensor.detach()
    try:
        flat = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a tensor subclass, or one numpy cannot hold
        raise _Unseen from None
    return list(data.shape), str(data.dtype), list(data.stride()), hashlib.sha256(memoryview(flat)).hexdigest()


class OnnxStore:
    """The folder of stored exports (default ``onnx/`` in the cache folder)."""

    def __init__(self, folder: str | Path | None = None, limit: int = STORE_BYTES):
        from opsched.cost.cache import cache_dir

        self.folder = Path(folder) if folder is not None else cache_dir() / "onnx"
        self.limit = limit
        self._unchecked: int | None = None  # bytes written since the folder's size was checked (None: not yet)

    def get(self, key: str | None) -> bytes | None:
        """The export stored under ``key``, marked as just used; None where there is none."""
        if key is None:
            return None
        path = self.folder / f"{key}.onnx"
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError:
            return None
        return data

    def put(self, key: str | None, data: bytes) -> None:
        """Store ``data`` under ``key`` (whole or not at all: written aside and renamed); then keep the folder
        under its limit. A folder that cannot be written is left as it is."""
        if key is None:
            return
        part = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".part", delete=False) as part:
                part.write(data)
            os.replace(part.name, self.folder / f"{key}.onnx")
        except OSError:
            if part is not None:
                with contextlib.suppress(OSError):
                    os.unlink(part.name)
            return
        if self._unchecked is None or self._unchecked + len(data) >= _EVICT_EVERY:  # the first write, then now and then
            self.evict()
            self._unchecked = 0
        else:
            self._unchecked += len(data)

    def evict(self, limit: int | None = None) -> int:
        """Remove the least recently used exports until the folder holds at most ``limit`` bytes (default the
        store's), and what a stopped writer left (a ``.part`` file an hour old); return how many exports were
        removed."""
        limit = self.limit if limit is None else limit
        files = []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return 0
        for entry in entries:
            with contextlib.suppress(OSError):  # removed meanwhile by another process
                stat = entry.stat()
                if entry.name.endswith(".onnx"):
                    files.append((stat.st_mtime, stat.st_size, entry.path))
                elif entry.name.endswith(".part") and stat.st_mtime < time.time() - 3600:
                    os.unlink(entry.path)
        files.sort()
        total, removed = sum(size for _, size, _ in files), 0
        for _, size, path in files:
            if total <= limit:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
            total -= size
        return removed

    def summary(self) -> dict[str, Any]:
        """How many exports the folder holds and their bytes."""
        try:
            sizes = [entry.stat().st_size for entry in os.scandir(self.folder) if entry.name.endswith(".onnx")]
        except OSError:
            sizes = []
        return {"path": str(self.folder), "exports": len(sizes), "bytes": sum(sizes)}

    def clear(self) -> int:
        """Remove every stored export; return how many there were."""
        return self.evict(limit=-1)
