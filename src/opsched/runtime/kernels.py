"""How a run step's units execute (``--kernels``): an *operator* maps the units of a run step and the
intra-op threads it gets to a callable.

Which kernel runs each unit is chosen once, by :func:`opsched.runtime.choice.choose_kernels`, recorded in the
plan, and run by :class:`ChosenKernels`, the one operator every job measures and executes with.

- ``eager``: the unit's own FX graph, ATen operator by operator (on the CPU, where the graph allows, its
  convolutions with their weights reordered for oneDNN once: the ``packed`` kernel,
  :mod:`opsched.runtime.packed`); a merge stage runs the merged convolution.
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
import hashlib
import io
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from opsched.compare import compare_outputs
from opsched.errors import OpschedError, first_line
from opsched.exiting import stop_point
from opsched.graph.ir import Node
from opsched.graph.maxpool import max_pools_by_kernel
from opsched.graph.onnxops import exportable_batch_norms
from opsched.quiet import this_thread_quiet
from opsched.runtime.choice import ASKED
from opsched.runtime.merge import merged_operator
from opsched.runtime.onnx_store import OnnxStore, export_key
from opsched.runtime.packed import packed_unit, packs

Operator = Callable[[Sequence[Node], int], Callable[..., Any]]
COMPILED = frozenset({"inductor", "onnxruntime"})  # the kernels compiled for example values



def unit_operator(nodes: Sequence[Node], threads: int = 1) -> Callable[..., Any]:
    """Eager: the unit's own operator, or the merged convolution of a merge stage. A unit's GraphModule is
    called through its ``forward``: ``nn.Module.__call__`` adds hook handling that units never use, a few
    microseconds on every unit of every call. The plain eager kernel, whatever the plan chose: jobs run
    :class:`ChosenKernels`."""
    if len(nodes) > 1:
        return merged_operator(nodes)
    run = nodes[0].run
    return run.forward if isinstance(run, torch.fx.GraphModule) else run


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
                stop_point()  # a background build asked to stop: not one more compilation
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
    """Units on ONNX Runtime sessions; ``eager_units`` names those ONNX could not take. Exports are kept between
    runs in :class:`~opsched.runtime.onnx_store.OnnxStore` unless ``keep_exports`` is false (``--no-cache``)."""

    def __init__(self, example: Callable[[str], Any], keep_exports: bool = True):
        super().__init__(example)
        self.store = OnnxStore() if keep_exports else None
        self.eager_units: list[str] = []
        self.eager_runs: set[tuple[Any, ...]] = set()  # the operators of the units and regions that stay eager
        self.why_eager: dict[str, str] = {}  # unit name: why ONNX Runtime could not take it (one line)
        # the compiled regions it could not take, in order: (the region's name, its last unit's, and why)
        self.region_failures: list[tuple[str, str]] = []
        # each unit's export, made once for every thread count its sessions are made for
        self._exported: dict[tuple[Any, ...], bytes] = {}

    def _compile(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        import torch.utils._pytree as pytree

        run = nodes[0].run if len(nodes) == 1 else merged_operator(nodes)
        # what runs where ONNX cannot: the unit as it is, so that values reach the sessions in eager's layout
        base = run.forward if isinstance(run, torch.fx.GraphModule) else run
        args = [self.example(a) for a in nodes[0].args]
        key = tuple(n.run for n in nodes)
        began = time.perf_counter()
        from_store = None  # the export's key where the store had it (checked before it is used)
        try:
            with torch.no_grad():
                want = base(*args)
                _, out_spec = pytree.tree_flatten(want)
                if key not in self._exported:
                    module = run if isinstance(run, torch.fx.GraphModule) else _trace(base, nodes, self.example)
                    module = max_pools_by_kernel(module)  # ONNX Runtime's MaxPool beats the slices there
                    module = exportable_batch_norms(module)  # the exporter lacks the inference norm
                    # named by position among the arguments' tensors: the exporter drops those the unit does not
                    # use (one of the list chunk made), and the names say which are left
                    options = {"input_names": [f"in{k}" for k in range(len(pytree.tree_leaves(args)))]}
                    from_store = export_key(module, args, options) if self.store else None
                    exported = self.store.get(from_store) if self.store else None
                    if exported is None:
                        exported = onnx_bytes(module, args, **options)
                        if self.store:
                            self.store.put(from_store, exported)
                        from_store = None
                else:
                    exported = self._exported[key]
            # The exporter takes a list argument (what chunk or split made) as one input per tensor in it, in
            # order; fed the list itself, the session failed (ShuffleNet V2).
            if not all(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(args)):
                return self._stays_eager(nodes, base, "it reads a list of tensors, which its session cannot be fed")
            call = self._call(exported, from_store, threads, args, want, out_spec)
            if call is None:
                # a stored export that does not answer as the unit (what the key could not see differs): anew
                exported = onnx_bytes(module, args, **options)
                self.store.put(from_store, exported)  # (only a stored export is rejected: there is a store)
                call = _session_call(onnx_session(exported, threads), args, out_spec)
            self._exported[key] = exported  # kept only once it ran: the other thread counts' sessions take it
        except Exception as e:  # noqa: BLE001 - an op the exporter or ONNX Runtime lacks: this unit stays eager
            return self._stays_eager(nodes, base, first_line(e))
        finally:
            self.compile_seconds += time.perf_counter() - began
        return call

    @staticmethod
    def _call(exported: bytes, from_store: str | None, threads: int, args: Sequence[Any], want: Any,
              out_spec: Any) -> Callable[..., Any] | None:
        """The unit's call on a session of ``exported``; where the export came from the store (``from_store``:
        its key), None unless it runs on ``args`` and answers ``want``."""
        if from_store is None:
            return _session_call(onnx_session(exported, threads), args, out_spec)
        try:
            call = _session_call(onnx_session(exported, threads), args, out_spec)
            return call if compare_outputs(call(*args), want).ok else None
        except Exception:  # noqa: BLE001 - a damaged file, or another unit's export: exported anew by the caller
            return None

    def _stays_eager(self, nodes: Sequence[Node], base: Callable[..., Any], why: str) -> Callable[..., Any]:
        self.eager_units.append(nodes[0].name)
        self.eager_runs.add(tuple(n.run for n in nodes))
        if nodes[0].kind == "region":  # named after its last unit, whose own failure this is not
            self.region_failures.append((nodes[0].name, why))
        else:
            self.why_eager.setdefault(nodes[0].name, why)
        return base


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


class ChosenKernels:
    """The operator of a plan whose units run on the kernels ``choice`` names (unit name to kernel, as
    :func:`opsched.runtime.choice.choose_kernels` makes it and the plan records it): what the cost model
    measures with and what every executor runs, so that the two cannot differ. A run step runs on its first
    unit's kernel (a merge stage's units share theirs; a compiled region is named after its last unit).
    ``example(name)`` gives values to compile for: needed where a kernel is compiled (inductor, ONNX Runtime).
    A unit ONNX Runtime cannot take runs eagerly, and ``choice`` says so from then on.

    >>> import torch
    >>> from opsched.graph.capture import capture
    >>> g = capture(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()), (torch.randn(1, 3, 8, 8),))
    >>> kernels = ChosenKernels({"0": "packed"})  # the unit is named after its module
    >>> type(kernels(g.nodes, 2)).__name__, kernels.packs
    ('PackedUnit', True)
    """

    def __init__(self, choice: Mapping[str, str], example: Callable[[str], Any] | None = None,
                 asked: str | None = None, keep_exports: bool = True):
        self.choice = dict(choice)
        self.example = example
        self._lock = threading.Lock()
        compiled = set(self.choice.values()) & COMPILED
        if compiled and example is None:
            raise OpschedError(f"{min(compiled)} kernels are compiled for example values, and none were given")
        self.inductor = InductorOperator(example) if "inductor" in compiled else None
        self.onnxruntime = OnnxRuntimeOperator(example, keep_exports) if "onnxruntime" in compiled else None
        self._onnx_units = _on_onnxruntime(self.choice)
        # the kernels asked for (--kernels): compiled ones where some unit was chosen to be compiled; ``auto``
        # where measurement chose unit by unit (compiled regions then hold units of one kernel: regions.py)
        self.asked = "auto" if asked == "auto" and compiled else min(compiled) if compiled else "eager"

    def chosen_as(self, choice: Mapping[str, str]) -> ChosenKernels:
        """The kernels ``choice`` names, chosen unit by unit (``asked`` is ``auto`` where some are compiled),
        run by these kernels' compilers: what was compiled for measuring each kernel is not compiled again."""
        other = copy.copy(self)
        other.choice, other._lock = dict(choice), threading.Lock()
        other._onnx_units = _on_onnxruntime(other.choice)
        other.asked = "auto" if set(other.choice.values()) & COMPILED else "eager"
        return other

    def every_unit_on(self, kernel: str) -> ChosenKernels:
        """Every unit of these kernels' choice on ``kernel``, compiled for the same example values (own compilers:
        nothing compiled for these kernels is shared)."""
        return ChosenKernels(dict.fromkeys(self.choice, kernel), self.example, asked="auto")

    def copies(self, of: Mapping[str, str]) -> ChosenKernels:
        """These kernels, also for the units that ``of`` names (a copy's name to the unit it copies): each copy
        runs on its unit's kernel, compiled by the same compilers."""
        other = copy.copy(self)
        other.choice = {**self.choice, **{name: self.choice[unit] for name, unit in of.items()}}
        return other

    def kernel_of(self, nodes: Sequence[Node]) -> str:
        """The kernel of a run step: its unit's (a merge stage's units share theirs). A compiled region (a node
        of kind ``region``, named after its last unit: :mod:`opsched.runtime.regions`) runs on the compiled
        kernels asked for, or, with eager kernels, packed where the plan packs."""
        if nodes[0].kind == "region":
            # chosen unit by unit, a region holds units of one kernel: its last unit's, whose name it has
            kernel = self.choice.get(nodes[0].name, "eager") if self.asked == "auto" else self.asked
            return kernel if kernel in COMPILED else "packed" if self.packs else "eager"
        kernel = self.choice.get(nodes[0].name)
        if kernel is None:
            raise OpschedError(f"unit {nodes[0].name!r} has no kernel chosen: the plan was made for another graph")
        return kernel

    def __call__(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        kernel = self.kernel_of(nodes)
        if kernel == "packed" and len(nodes) == 1 and packs(nodes[0].run):  # (a region may hold nothing to pack)
            return packed_unit(nodes[0].run)
        if kernel in ("eager", "packed"):  # a merge stage is layout-proof already (opsched.runtime.merge)
            return unit_operator(nodes, threads)
        if kernel == "inductor":
            return self.inductor(nodes, threads)
        fn = self.onnxruntime(nodes, threads)
        if len(nodes) == 1 and (nodes[0].run,) in self.onnxruntime.eager_runs:
            # ONNX could not take it: where values may be channels_last (units on reordered convolutions beside
            # it), it runs rewritten to read them, as the default kernels would run it
            fallback = "packed" if self.packs and packs(nodes[0].run) else "eager"
            if nodes[0].kind != "region":  # (a region says nothing of its units, which may run on ONNX Runtime)
                with self._lock:  # a unit ONNX cannot take runs so wherever it runs alone: so the table says
                    self.choice[nodes[0].name] = fallback
            return packed_unit(nodes[0].run) if fallback == "packed" else fn
        return fn

    @property
    def packs(self) -> bool:
        """Whether some unit runs packed: its values, and so the plan's outputs, may be ``channels_last``."""
        return "packed" in self.choice.values()

    @property
    def compile_seconds(self) -> float:
        return sum(op.compile_seconds for op in (self.inductor, self.onnxruntime) if op is not None)

    @property
    def eager_units(self) -> list[str]:
        """Units asked to run on ONNX Runtime that it could not take, which run eagerly (of these kernels' own
        choice: a copy made by :meth:`chosen_as` shares its compilers, not their failures on other units)."""
        if self.onnxruntime is None:
            return []
        return [name for name in self.onnxruntime.eager_units if name in self._onnx_units]

    @property
    def cache_column(self) -> str:
        """The kernels as the cost cache files their timings: what was asked, and for kernels chosen unit by
        unit the choice itself, since a unit's time depends on its neighbours' kernels (the layouts it reads)."""
        if self.asked != "auto":
            return self.asked
        digest = hashlib.sha256(json.dumps(sorted(self.choice.items())).encode()).hexdigest()[:16]
        return f"auto:{digest}"

    @property
    def key(self) -> tuple[Any, ...]:
        """What runs, for telling programs apart: the choice, and the compiled kernels' own objects."""
        return tuple(sorted(self.choice.items())), id(self.inductor), id(self.onnxruntime)


def _on_onnxruntime(choice: Mapping[str, str]) -> set[str]:
    """The units ``choice`` puts on ONNX Runtime (kept as chosen: a unit it could not take is chosen again)."""
    return {name for name, kernel in choice.items() if kernel == "onnxruntime"}


def plan_kernels(graph: Any, schedule: Any, device: str = "cpu", inputs: Sequence[Any] | None = None,
                 shipped: bool = False) -> ChosenKernels:
    """The kernels ``schedule`` runs ``graph``'s units on: those it recorded (``unit_kernels``, checked against
    the graph), or, for a plan that records none (written before plans recorded them, or made by hand), the
    choice of :func:`~opsched.runtime.choice.choose_kernels` for its ``--kernels`` and where it runs (a mapped
    plan: its platform's devices, as ``opsched map`` chose; ``shipped``: for units pickled to another process).
    Compiled kernels are compiled for the values the graph computes from ``inputs`` (its flat inputs), which
    they need."""
    from opsched.graph.interpret import all_values
    from opsched.runtime.choice import check_choice, choose_kernels, place_of

    where = place_of([d.kind for d in schedule.devices.devices]) if schedule.devices is not None else device
    if schedule.unit_kernels is not None:
        choice = check_choice(schedule.unit_kernels, graph, device=where)
    else:
        asked = schedule.run.kernels
        check_kernels(asked)
        choice = choose_kernels(graph, asked, where, shipped)
    compiled = set(choice.values()) - {"eager", "packed"}
    for kernel in compiled:
        check_kernels(kernel)
    example = all_values(graph, inputs).__getitem__ if compiled and inputs is not None else None
    return ChosenKernels(choice, example, asked=schedule.run.kernels)


def kernels_for(graph: Any, asked: str = "eager", device: str = "cpu",
                example: Callable[[str], Any] | None = None, keep_exports: bool = True) -> ChosenKernels:
    """:class:`ChosenKernels` of :func:`~opsched.runtime.choice.choose_kernels`'s choice for ``graph``
    (``keep_exports``: see :class:`OnnxRuntimeOperator`)."""
    from opsched.runtime.choice import choose_kernels

    check_kernels(asked)
    return ChosenKernels(choose_kernels(graph, asked, device), example, keep_exports=keep_exports)


def check_kernels(kernels: str) -> None:
    """Raise :class:`OpschedError` unless ``kernels`` names kernels this installation can run (a command
    checks before loading anything)."""
    if kernels not in ASKED:
        raise OpschedError(f"unknown kernels {kernels!r}; choose from {', '.join(ASKED)}")
    if kernels == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise OpschedError("--kernels onnxruntime needs ONNX Runtime: pip install 'opsched[onnx]'") from None


def _session_call(session: Any, args: Sequence[Any], out_spec: Any) -> Callable[..., Any]:
    """A unit's call on ``session``: fed the tensors of its arguments (as flat as the exporter took them, those it
    kept by their names ``in<position>``), answering in the unit's own structure (``out_spec``)."""
    import torch.utils._pytree as pytree

    names = [i.name for i in session.get_inputs()]
    used = [int(n[2:]) for n in names]
    run = session.run
    flat = any(not isinstance(a, torch.Tensor) for a in args)

    def call(*values: Any) -> Any:
        tensors = pytree.tree_leaves(values) if flat else values
        outputs = run(None, {n: tensors[k].detach().contiguous().numpy() for n, k in zip(names, used)})
        return pytree.tree_unflatten([torch.from_numpy(o) for o in outputs], out_spec)

    return call


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
    """``module`` called on ``args``, exported to ONNX by PyTorch's TorchScript exporter, quietly on this thread
    (:func:`opsched.quiet.this_thread_quiet`): its deprecation and tracer warnings, and the graph it prints when an
    export fails, are the exporter's notes to itself. That graph went to standard output whatever the log's
    setting and broke the JSON of ``opsched multi --json --kernels onnxruntime`` (a batched unit of
    MobileNetV3-small does not export). Raises what the exporter raises."""
    buffer = io.BytesIO()
    with this_thread_quiet():
        torch.onnx.export(module, tuple(args), buffer, dynamo=False, **options)
    return buffer.getvalue()
