"""How a run step's units execute (``--kernels``): an *operator* maps the units of a run step and the
intra-op threads it gets to a callable.

- ``eager``: the unit's own FX graph, ATen operator by operator (on the CPU, convolutions with their weights
  reordered for oneDNN once: :func:`cpu_unit_operator`); a merge stage runs the merged convolution.
- ``inductor``: the same graph compiled by TorchInductor into C++/OpenMP kernels. The FX graph is handed to
  ``compile_fx`` directly instead of going through ``torch.compile``: dynamo would see every unit as the
  same ``GraphModule.forward`` code object and, after 8 recompiles, silently run the rest eagerly.
  Weights are frozen into the compiled code (``freezing``), which folds batch norms into convolutions.
  Inductor bakes the OpenMP thread count into its kernels when it compiles them, so a unit is compiled
  for the threads of the step that runs it (one compilation per unit and thread count, memoised);
  inductor's on-disk cache makes a second process's compilations quick.
- ``onnxruntime``: the same graph exported to ONNX and run by an ONNX Runtime session of its own, with the
  step's intra-op threads (sequential execution, every graph optimisation, worker threads that do not spin:
  spinning ones hold the cores the concurrent units need). Values cross as NumPy arrays that share the
  tensors' memory. Max poolings run as ONNX's MaxPool again (capture made them strided slices, which are
  faster in PyTorch but separate passes in ONNX Runtime). A unit the exporter cannot take runs eagerly, and is
  named in ``eager_units``. With
  compiled regions, a region is one session, so ONNX Runtime fuses across the units inside it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from opsched.errors import OpschedError
from opsched.graph.ir import Node
from opsched.graph.maxpool import max_pools_by_kernel
from opsched.runtime.merge import merged_operator
from opsched.runtime.packed import packed_unit, packs

Operator = Callable[[Sequence[Node], int], Callable[..., Any]]

KERNELS = ("eager", "inductor", "onnxruntime")


def unit_operator(nodes: Sequence[Node], threads: int = 1) -> Callable[..., Any]:
    """Eager: the unit's own operator, or the merged convolution of a merge stage. A unit's GraphModule is
    called through its ``forward``: ``nn.Module.__call__`` adds hook handling that units never use, a few
    microseconds on every unit of every call. On the CPU, :func:`cpu_unit_operator` runs them instead."""
    if len(nodes) > 1:
        return merged_operator(nodes)
    run = nodes[0].run
    return run.forward if isinstance(run, torch.fx.GraphModule) else run


def cpu_unit_operator(nodes: Sequence[Node], threads: int = 1) -> Callable[..., Any]:
    """Eager on the CPU: :func:`unit_operator`, a unit's convolutions with their weights reordered for oneDNN
    once (:mod:`opsched.runtime.packed`). The CPU executors run eager units through it."""
    if len(nodes) == 1 and packs(nodes[0].run):
        return packed_unit(nodes[0].run)
    return unit_operator(nodes, threads)


@contextlib.contextmanager
def without_cuda_home_warning() -> Iterator[None]:
    """Inductor's first C++ compilation imports ``torch.utils.cpp_extension``, which, on a machine with a CUDA
    toolkit but no CUDA device, logs "No CUDA runtime is found, using CUDA_HOME='...'" onto stderr in the
    middle of a run. That says nothing about the CPU kernels being compiled: while in the block the logger
    drops that one record, and says everything else."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addFilter(_not_the_cuda_home_warning)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_cuda_home_warning)


def _not_the_cuda_home_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No CUDA runtime is found")


class CompiledOperator:
    """Units compiled once per unit and thread count, memoised: ``example(name)`` gives a value each unit input
    can be compiled for; ``compile_seconds`` adds up the time spent compiling. Subclasses say how
    (``_compile``)."""

    def __init__(self, example: Callable[[str], Any]):
        self.example = example
        self.compiled: dict[tuple[tuple[Any, ...], int], Callable[..., Any]] = {}
        self.compile_seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        # by the units' own operators, not their names: a compiled region is named after its last unit
        key = (tuple(n.run for n in nodes), threads)
        with self._lock:
            if key not in self.compiled:
                self.compiled[key] = self._compile(nodes, threads)
        return self.compiled[key]

    def _compile(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        raise NotImplementedError


class InductorOperator(CompiledOperator):
    """Inductor-compiled units."""

    def _compile(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        base = nodes[0].run if len(nodes) == 1 else merged_operator(nodes)
        if isinstance(base, torch.fx.GraphModule):
            # compile_fx rewrites the graph it is given (its output becomes a tuple): hand it a copy that
            # shares the parameters, so that the unit's own graph, and later compilations, stay as they were.
            gm = torch.fx.GraphModule(base, copy.deepcopy(base.graph))
        else:
            gm = _trace(base, nodes, self.example)
        args = [self.example(a) for a in nodes[0].args]
        began = time.perf_counter()
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with inductor_config.patch(freezing=True), torch.no_grad(), without_cuda_home_warning():
                gm, args, nested = _flat(gm, args)
                compiled = compile_fx(gm, args)
        except Exception as e:  # noqa: BLE001 - inductor raises many kinds; one line for the user
            raise OpschedError(f"inductor could not compile unit {nodes[0].name!r}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        finally:
            torch.set_num_threads(saved)
        self.compile_seconds += time.perf_counter() - began
        return compiled if nested is None else nested(compiled)


class OnnxRuntimeOperator(CompiledOperator):
    """Units on ONNX Runtime sessions; ``eager_units`` names those ONNX could not take."""

    def __init__(self, example: Callable[[str], Any]):
        super().__init__(example)
        self.eager_units: list[str] = []

    def _compile(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        import torch.utils._pytree as pytree

        run = nodes[0].run if len(nodes) == 1 else merged_operator(nodes)
        # what runs where ONNX cannot: the unit as it is, so that values reach the sessions in eager's layout
        base = run.forward if isinstance(run, torch.fx.GraphModule) else run
        args = [self.example(a) for a in nodes[0].args]
        began = time.perf_counter()
        try:
            with torch.no_grad():
                _, out_spec = pytree.tree_flatten(base(*args))
                module = run if isinstance(run, torch.fx.GraphModule) else _trace(base, nodes, self.example)
                module = max_pools_by_kernel(module)  # ONNX Runtime's MaxPool beats the slices there
                # named by position among the arguments' tensors: the exporter drops those the unit does not
                # use (one of the list chunk made), and the names say which are left
                exported = onnx_bytes(module, args,
                                      input_names=[f"in{k}" for k in range(len(pytree.tree_leaves(args)))])
            session = onnx_session(exported, threads)
        except Exception:  # noqa: BLE001 - an op the exporter or ONNX Runtime lacks: this unit stays eager
            self.eager_units.append(nodes[0].name)
            return base
        finally:
            self.compile_seconds += time.perf_counter() - began
        # The exporter takes a list argument (what chunk or split made) as one input per tensor in it, in order;
        # fed the list itself, the session failed (ShuffleNet V2).
        if not all(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(args)):
            self.eager_units.append(nodes[0].name)
            return base
        names = [i.name for i in session.get_inputs()]
        used = [int(n[2:]) for n in names]
        run = session.run
        flat = any(not isinstance(a, torch.Tensor) for a in args)

        def call(*values: Any) -> Any:
            tensors = pytree.tree_leaves(values) if flat else values
            outputs = run(None, {n: tensors[k].detach().contiguous().numpy() for n, k in zip(names, used)})
            return pytree.tree_unflatten([torch.from_numpy(o) for o in outputs], out_spec)

        return call


def _flat(gm: torch.fx.GraphModule, args: list[Any]) -> tuple[torch.fx.GraphModule, list[Any], Any]:
    """A unit that reads or returns a list of tensors (what ``chunk`` makes: ShuffleNet V2), as inductor takes
    it: traced again as a function of the tensors alone returning a tuple of tensors; with, to call the
    compiled flat function as the unit, a wrapper of it (None where the unit was flat already)."""
    import torch.utils._pytree as pytree
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, in_spec = pytree.tree_flatten(args)
    out = gm(*args)
    if all(isinstance(a, torch.Tensor) for a in args) and (
            isinstance(out, torch.Tensor) or isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out)):
        return gm, args, None
    out_spec = pytree.tree_structure(out)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(pytree.tree_leaves(gm(*pytree.tree_unflatten(list(tensors), in_spec))))

    def nested(compiled: Callable[..., Any]) -> Callable[..., Any]:
        def call(*values: Any) -> Any:
            return pytree.tree_unflatten(list(compiled(*pytree.tree_leaves(values))), out_spec)
        return call

    return make_fx(flat)(*leaves), leaves, nested


def _trace(fn: Callable[..., Any], nodes: Sequence[Node], example: Callable[[str], Any]) -> torch.fx.GraphModule:
    """An FX graph of a callable (the merged convolution) for inductor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn)(*[example(a) for a in nodes[0].args])


def operator_for(kernels: str, example: Callable[[str], Any] | None) -> Operator:
    """The operator that ``--kernels`` names; ``example`` (values to compile for) is needed by inductor and
    ONNX Runtime."""
    if kernels == "eager":
        return unit_operator
    check_kernels(kernels)
    if kernels == "inductor":
        return InductorOperator(example)
    return OnnxRuntimeOperator(example)


def check_kernels(kernels: str) -> None:
    """Raise :class:`OpschedError` unless ``kernels`` names kernels this installation can run (a command
    checks before loading anything)."""
    if kernels not in KERNELS:
        raise OpschedError(f"unknown kernels {kernels!r}; choose from {', '.join(KERNELS)}")
    if kernels == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise OpschedError("--kernels onnxruntime needs ONNX Runtime: pip install 'opsched[onnx]'") from None


def onnx_session(exported: bytes, threads: int) -> Any:
    """An ONNX Runtime session of ``exported`` on the CPU, as every ONNX Runtime kernel and peer of opsched
    runs: every graph optimisation, sequential execution, ``threads`` intra-op threads that do not spin (ORT's
    threads spin while the session lives, holding the core the next configuration timed needs: measured here,
    eager GoogLeNet ran 2.2x slower after an ORT call)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return ort.InferenceSession(exported, options, providers=["CPUExecutionProvider"])


def onnx_bytes(module: Any, args: Sequence[Any], **options: Any) -> bytes:
    """``module`` called on ``args``, exported to ONNX by PyTorch's TorchScript exporter, quietly: its deprecation
    and tracer warnings, and the graph it logs when an export fails, are the exporter's notes to itself. That log
    went to standard output whatever its setting (PyTorch 2.14 tests the setting's function, not its value) and
    broke the JSON of ``opsched multi --json --kernels onnxruntime`` (a batched unit of MobileNetV3-small does not
    export); it is sent to standard error, which points at /dev/null meanwhile. Raises what the exporter raises."""
    buffer = io.BytesIO()
    torch._C._jit_set_onnx_log_output_stream("stderr")
    with warnings.catch_warnings(), _stderr_to_devnull():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(args), buffer, dynamo=False, **options)
    return buffer.getvalue()


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """File descriptor 2 on /dev/null: what C++ writes there is dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
