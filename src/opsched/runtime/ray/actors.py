"""The Ray engine's actors and module: values crossing devices as NumPy arrays, units shipped to the actors, one
actor per device running its lowered steps (or one running every device of a node with the local engine), and
:class:`RayModule`, the plan as a module."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import torch
import torch.utils._pytree as pytree

from opsched.errors import OpschedError
from opsched.runtime.cpu import CPUExecutor
from opsched.runtime.kernels import ChosenKernels, plan_kernels
from opsched.runtime.lowered import Call, LoweredProgram, UnitFailed, lower
from opsched.runtime.packed import eager_layout, eager_strides, packs_graph
from opsched.runtime.program import compile_program
from opsched.runtime.ray.cluster import (
    NODE_RESOURCE,
    NODE_SHARE,
    PING_SECONDS,
    RUN_SECONDS,
    START_SECONDS,
    ClusterError,
    DeviceFailed,
    UnitError,
    check_nodes,
    first_line,
    import_ray,
)
from opsched.runtime.ray.segments import Segment, cut_segments
from opsched.schedule import PlanDevice

NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                          torch.int8, torch.uint8, torch.bool})


def to_wire(value: Any) -> Any:
    """Tensors as NumPy arrays where NumPy has the dtype: Ray stores and reads those without pickling."""
    return pytree.tree_map(lambda x: x.detach().numpy()
                           if isinstance(x, torch.Tensor) and x.dtype in NUMPY_DTYPES else x, value)


def from_wire(value: Any, copy: bool = False) -> Any:
    """Arrays back as tensors: sharing Ray's read-only memory (units never write into their inputs), or
    copied (``copy``) for the caller, who may keep them after Ray reuses that memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return pytree.tree_map(lambda x: torch.from_numpy(x.copy() if copy else x)
                               if isinstance(x, np.ndarray) else x, value)


class UnitTracer(torch.fx.Tracer):
    """Rebuilds a unit's FX graph from its code when an actor unpickles it (torch.fx re-traces a pickled
    GraphModule), keeping each opsched function the code calls a call, as in the unit, instead of tracing
    into it: max pooling by strided slices, say, has Python control flow on shapes, which tracing fails on."""

    def __init__(self):
        modules = [m for name, m in list(sys.modules.items()) if name.startswith("opsched.") and m is not None]
        super().__init__(autowrap_modules=(math, *modules))


class _Shipped:
    """A unit's GraphModule, pickled to be unpickled with :class:`UnitTracer`; the unit itself is unchanged."""

    def __init__(self, module: torch.fx.GraphModule):
        self.module = module

    def __reduce__(self):
        rebuild, (body, import_block) = self.module.__reduce__()
        return rebuild, ({**body, "_tracer_cls": UnitTracer}, import_block)


class ShippedUnits:
    """A run step's units as the lowered step's callable on its way to an actor: pickled, its units' GraphModules
    travel as :class:`_Shipped`; in the actor, :meth:`load` makes their callable on the ``kernel`` the plan
    chose for them (:class:`~opsched.runtime.kernels.ChosenKernels`), which a call then runs."""

    def __init__(self, nodes: Sequence[Any], threads: int, kernel: str):
        self.nodes = tuple(dataclasses.replace(n, run=_Shipped(n.run)) if isinstance(n.run, torch.fx.GraphModule)
                           else n for n in nodes)
        self.threads = threads
        self.kernel = kernel
        self.fn: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "threads": self.threads, "kernel": self.kernel, "fn": None}

    def load(self) -> None:
        if self.fn is None:
            self.fn = ChosenKernels({n.name: self.kernel for n in self.nodes})(list(self.nodes), self.threads)

    def __call__(self, *args: Any) -> Any:
        self.load()
        return self.fn(*args)


class DeviceWorker:
    """One device of the plan, as a Ray actor. ``steps``: its lowered run steps (:class:`Call`, their callables
    :class:`ShippedUnits`, loaded when the actor starts); ``segments``: (steps, imports, exports, exports no later
    step reads). The values of one inference live in ``values``; the device's first segment starts a new
    inference."""

    def __init__(self, name: str, threads: int, steps: Sequence[Call], segments: Sequence[tuple]):
        self.name = name
        self.threads = threads
        torch.set_num_threads(threads)
        for step in steps:
            step.fn.load()
        self.steps = list(steps)
        self.segments = list(segments)
        self.values: dict[int, Any] = {}
        self.running: str | None = None   # the unit running now, read by status() from another thread
        self.failure: str | None = None   # the inference's first unit failure

    def status(self) -> tuple[int, tuple[str, str] | None, tuple[str, str] | None]:
        """(process id, (device, the unit running), (device, the first unit failure of the current inference))."""
        running, failure = self.running, self.failure
        return os.getpid(), running and (self.name, running), failure and (self.name, failure)

    def run(self, position: int, *imported: Any) -> Any:
        steps, imports, exports, drop = self.segments[position]
        if position == 0:
            self.values, self.failure = {}, None
        values = self.values
        values.update(zip(imports, from_wire(imported[:len(imports)])))  # later arguments only order the calls
        if torch.get_num_threads() != self.threads:  # a compiled graph calls from a thread of its own
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            for i in steps:
                step = self.steps[i]
                if any(slot not in values for slot in step.reads):
                    raise UnitError(f"unit {step.name!r} skipped: an earlier call of this inference failed")
                self.running = step.name
                try:
                    result = step.fn(*[values[slot] for slot in step.reads])
                except Exception as e:  # noqa: BLE001 - reported to the driver in one picklable line
                    self.failure = _unit_failure(step.name, e)
                    raise UnitError(self.failure) from None
                finally:
                    self.running = None
                step.store(values, result)
                for slot in step.release:
                    del values[slot]
        out = tuple(to_wire(values[slot]) for slot in exports)
        for slot in drop:
            del values[slot]
        return out[0] if len(out) == 1 else (out or None)


class NodeWorker:
    """Every device of the plan, all on one node, as one Ray actor: the plan's lowered program (its callables
    :class:`ShippedUnits`, loaded when the actor starts) run by the local engine's CPU executor, each device a
    stream on a thread of the actor with its own ``threads``, its values passed in memory. An inference is one
    call: the inputs in, the ``returned`` slots' values out. ``devices`` names each stream's device."""

    def __init__(self, devices: Sequence[str], lowered: LoweredProgram, returned: Sequence[int]):
        for k in range(len(lowered.streams)):
            for step in lowered.calls(k):
                step.fn.load()
        self.device_of = {step.name: devices[k] for k in range(len(lowered.streams)) for step in lowered.calls(k)}
        self.executor = CPUExecutor(lowered)
        self.outputs = lowered.outputs
        self.returned = tuple(returned)
        self.failure: tuple[str, str] | None = None  # (device, what) of the last inference's unit failure

    def status(self) -> tuple[int, None, tuple[str, str] | None]:
        """As :meth:`DeviceWorker.status`; which unit runs is not followed here."""
        return os.getpid(), None, self.failure

    def run(self, position: int, *inputs: Any) -> Any:
        """An inference (``position`` is always 0: the node's one segment, called as a device's are)."""
        self.failure = None
        try:
            outputs = self.executor(*from_wire(list(inputs)))
        except UnitFailed as e:
            self.failure = (self.device_of[e.unit], _unit_failure(e.unit, e.__cause__ or e))
            raise UnitError(self.failure[1]) from None
        values = dict(zip(self.outputs, outputs))
        out = tuple(to_wire(values[slot]) for slot in self.returned)
        return out[0] if len(out) == 1 else (out or None)


class RayModule:
    """A mapped plan run by Ray actors; called like the model (inputs and outputs structured as its). Needs a
    connected Ray (:func:`ray_cluster`) with every node of the plan.

    ``actors``: ``"device"``, an actor per device with units (:class:`DeviceWorker`), its units cut into
    segments, a call each; ``"node"``, one actor running every device of the plan's one node as the local engine
    runs them (:class:`NodeWorker`), an inference one call; default: ``"node"`` when the plan's devices are all
    on one node. ``compiled``: make the calls as one Ray Compiled Graph (True), as remote calls (False), or
    (None) the graph where the installed Ray can compile it, for actors per device, and remote calls for the
    node's actor. ``per_unit``: a call per unit instead of per segment (the
    benchmark compares; actors per device). ``close()`` (or leaving a ``with`` block) ends the actors, as does
    collecting an unclosed module.

    Calls from several threads run one at a time: a Compiled Graph's ``execute`` is not thread-safe (two at once
    aborted the process in Ray's C++ core), and each actor holds the values of one inference (two inferences of
    remote calls interleaved mixed them up: wrong outputs). An actor runs one call at a time anyway."""

    def __init__(self, graph: Any, schedule: Any, compiled: bool | None = None, per_unit: bool = False,
                 run_seconds: float = RUN_SECONDS, start_seconds: float = START_SECONDS, actors: str | None = None):
        ray = import_ray()
        if not ray.is_initialized():
            raise ClusterError("the Ray engine needs a connected Ray (see opsched.runtime.ray.ray_cluster)")
        self._ray = ray
        self._lock = threading.RLock()  # one inference at a time; re-entered by close() when a call fails
        self.graph = graph
        self.run_seconds = run_seconds
        every = schedule.devices.devices
        used = sorted({o.stream for o in schedule.ops})  # program stream k is the k-th device with units
        self.devices = [every[d] for d in used]
        nodes = list(dict.fromkeys(d.node for d in self.devices))
        if actors not in (None, "node", "device"):
            raise ValueError(f"actors is 'node' or 'device', not {actors!r}")
        self.per_node = (actors or ("node" if len(nodes) == 1 and not per_unit else "device")) == "node"
        if self.per_node and (len(nodes) > 1 or per_unit):
            raise ClusterError("one actor runs every device of a plan only when they are all on one node (this "
                               f"plan's are on {', '.join(nodes)}), a segment per call" if len(nodes) > 1 else
                               "one actor for the node makes one call per inference, not one per unit")
        check_nodes(ray.cluster_resources(), nodes, "the connected Ray cluster")
        kernels = shipped_kernels(graph, schedule)
        lowered = lower(compile_program(schedule, graph, max(d.threads for d in self.devices)),
                        lambda nodes, threads: ShippedUnits(nodes, threads, kernels.kernel_of(nodes)))
        self.relayout = eager_strides(graph) if kernels.packs else None
        self.inputs = lowered.inputs
        self.outputs = lowered.outputs
        # what the actors return: each output a unit makes, once (an output may be a graph input, or repeated)
        self._returned = list(dict.fromkeys(slot for slot in self.outputs if slot >= self.inputs))
        # the node's actor is one segment: every input in, the outputs out
        self.segments = [Segment(0, 0, (), tuple(range(self.inputs)), tuple(self._returned))] if self.per_node \
            else cut_segments(lowered, per_unit)
        # an input goes with the call that reads it (inline when small); one that several calls read is put in
        # the object store once: a put costs more than a call here (1.8 ms against 1 ms, measured)
        self._shared_inputs = [sum(i in s.imports for s in self.segments) > 1 for i in range(self.inputs)]
        self._failure: DeviceFailed | None = None
        self._graph: Any = None
        self.actors: list[Any] = []
        # each actor's devices, for what a failure says
        self._hosts: list[list[PlanDevice]] = [self.devices] if self.per_node else [[d] for d in self.devices]
        if self.per_node:
            self.actors.append(ray.remote(NodeWorker).options(
                num_cpus=sum(d.threads for d in self.devices), resources={NODE_RESOURCE + nodes[0]: NODE_SHARE},
                max_restarts=0, max_task_retries=0).remote([d.name for d in self.devices], lowered, self._returned))
        worker = ray.remote(DeviceWorker)
        for k, device in enumerate([] if self.per_node else self.devices):
            steps = lowered.calls(k)
            read_here = {slot for c in steps for slot in c.reads}
            mine = sorted((s for s in self.segments if s.device == k), key=lambda s: s.position)
            specs = [(s.steps, s.imports, s.exports, tuple(e for e in s.exports if e not in read_here)) for s in mine]
            self.actors.append(worker.options(
                num_cpus=device.threads, resources={NODE_RESOURCE + device.node: NODE_SHARE},
                max_restarts=0, max_task_retries=0).remote(device.name, device.threads, steps, specs))
        try:
            self._await_start(start_seconds)
            # The node's one call per inference gains little from a Compiled Graph, and its polling actor and driver
            # take cores from the node's streams: GoogLeNet 64 px on two 1-thread devices of one node ran 16.1 ms
            # compiled against 12.4-13.2 ms as remote calls (2 cores, measured; docs/ray.md).
            wanted = compiled if compiled is not None else not self.per_node
            self.compiled = self._compile() if wanted else False
            if compiled and not self.compiled:
                raise ClusterError("this Ray cannot compile the plan's calls into a Compiled Graph")
        except BaseException:
            self.close()
            raise

    def _await_start(self, seconds: float) -> None:
        ray = self._ray
        pending = {a.status.remote(): host for a, host in zip(self.actors, self._hosts)}
        ready, waiting = ray.wait(list(pending), num_returns=len(pending), timeout=seconds)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise _host_failed(pending[ref], f"could not start its Ray actor: {_actor_error(e)}") from None
        if waiting:
            late = pending[waiting[0]]
            node = late[0].node
            raise _host_failed(late, f"(node {node}) was not placed and started within {seconds:g} s: has a Ray "
                                     f"node declaring {NODE_RESOURCE}{node} {sum(d.threads for d in late)} "
                                     "CPU(s) free?")

    def _compile(self) -> bool:
        """Bind the segments' calls into a Compiled Graph; False when this Ray has none or cannot compile it."""
        try:
            from ray.dag import InputNode, MultiOutputNode
        except ImportError:
            return False
        with InputNode() as given:
            values = {i: given[i] for i in range(self.inputs)}
            previous: dict[int, tuple[Any, bool]] = {}  # device -> its last call's first output, and if it exports
            for s in self.segments:
                args = [values[slot] for slot in s.imports]
                if s.device in previous:
                    token, exported = previous[s.device]
                    # the graph wants every call downstream of the input and upstream of the output: a call
                    # importing nothing, or following one that exports nothing, is chained to its predecessor
                    if not s.imports or not exported:
                        args.append(token)
                method = self.actors[s.device].run
                if len(s.exports) > 1:
                    outs = method.options(num_returns=len(s.exports)).bind(s.position, *args)
                else:
                    outs = [method.bind(s.position, *args)]
                values.update(zip(s.exports, outs))
                previous[s.device] = (outs[0], bool(s.exports))
            dag = MultiOutputNode([values[slot] for slot in self._returned])
        try:
            self._graph = dag.experimental_compile()
        except Exception:  # noqa: BLE001 - an older Ray without a feature used here: remote calls instead
            return False
        return True

    def __call__(self, *inputs: Any) -> Any:
        flat = pytree.tree_leaves(inputs)
        if len(flat) != self.inputs:
            raise OpschedError(f"{self.graph.name} takes {self.inputs} input tensors, got {len(flat)}")
        with self._lock:
            if self._failure is not None:
                raise self._failure
            values = self._execute(flat) if self.compiled else self._submit(flat)
            # Copied out of Ray's memory here, where no closure holds them: ray_cluster frees what the frames of an
            # interrupt's traceback hold before Ray shuts down, but a closure (a comprehension's, in Python 3.11)
            # kept the arrays alive past it, and their release then crashed the process.
            returned = {slot: from_wire(value, copy=True) for slot, value in zip(self._returned, values)}
        outputs = [flat[slot] if slot < self.inputs else returned[slot] for slot in self.outputs]
        if self.relayout is not None:  # reordered convolutions leave values channels_last: outputs as eager's
            outputs = eager_layout(outputs, self.relayout)
        if self.graph.out_spec is not None:
            return pytree.tree_unflatten(outputs, self.graph.out_spec)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _execute(self, flat: Sequence[Any]) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(self._graph.execute(*[to_wire(x) for x in flat]), timeout=self.run_seconds)
        except ray.exceptions.RayError as e:
            raise self._fail(e) from None

    def _submit(self, flat: Sequence[Any]) -> list[Any]:
        ray = self._ray
        refs = {i: ray.put(to_wire(x)) if self._shared_inputs[i] else to_wire(x) for i, x in enumerate(flat)}
        calls = []
        for s in self.segments:
            method = self.actors[s.device].run
            if len(s.exports) > 1:
                outs = method.options(num_returns=len(s.exports)).remote(s.position, *[refs[i] for i in s.imports])
            else:
                outs = [method.remote(s.position, *[refs[i] for i in s.imports])]
            refs.update(zip(s.exports, outs))
            calls.append((outs[0], s.device))
        wanted = [refs[slot] for slot in self._returned]
        try:
            return ray.get(wanted, timeout=self.run_seconds)
        except ray.exceptions.RayError as e:
            # the first call not finished, in submission order, is one running or stuck
            done, _ = ray.wait([ref for ref, _ in calls], num_returns=len(calls), timeout=0)
            late = next((self._hosts[d] for ref, d in calls if ref not in done), None)
            raise self._fail(e, late) from None

    def _fail(self, error: Exception, late: Sequence[PlanDevice] | None = None) -> DeviceFailed:
        """The failure as one :class:`DeviceFailed` naming the device: one whose actor is gone, else one whose
        unit raised, else (a timeout) one still running (``late``: the devices of the first call not finished,
        when known); the module is closed, and later calls raise it too. An actor running every device of a
        node is named by its node and devices where no one device is to blame."""
        ray = self._ray
        pings = {a.status.remote(): host for a, host in zip(self.actors, self._hosts)}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_SECONDS)
        dead = failed = running = None
        for ref in answered:
            try:
                _, unit, failure = ray.get(ref)  # unit and failure: (device, what) or None
            except ray.exceptions.RayActorError as e:
                dead = dead or (pings[ref], f"died: {_actor_error(e)}")
                continue
            failed = failed or failure
            running = running or (unit and (unit[0], f"running unit {unit[1]!r}"))
        timed_out = isinstance(error, ray.exceptions.GetTimeoutError | ray.exceptions.RayChannelTimeoutError)
        within = f"did not finish within {self.run_seconds:g} s"
        if dead:
            self._failure = _host_failed(*dead)
        elif failed:
            self._failure = DeviceFailed(*failed)
        elif timed_out and running:
            self._failure = DeviceFailed(running[0], f"{within} ({running[1]})")
        elif timed_out and late:
            self._failure = _host_failed(late, within)
        else:
            self._failure = DeviceFailed(None, f"{type(error).__name__}: {first_line(error)}")
        self.close()
        return self._failure

    def close(self) -> None:
        """End the actors (and the compiled graph); a closed module cannot run again. A call in progress on
        another thread finishes first."""
        with self._lock:
            if self._graph is not None:
                if self._failure is not None:  # the actors go first, so that tearing down never waits for a stuck unit
                    for actor in self.actors:
                        self._ray.kill(actor)
                with contextlib.suppress(Exception):  # after a failure, what is left to tear down may fail too
                    self._graph.teardown()
                self._graph = None
            for actor in self.actors:
                self._ray.kill(actor)
            self.actors = []
            if self._failure is None:
                self._failure = DeviceFailed(None, "the module is closed")

    def __del__(self) -> None:
        # Collected unclosed: its Compiled Graph is not (Ray's monitor thread holds it until Ray shuts down), nor
        # the actors the graph holds, each polling on a core and holding its CPUs; ending them ends the graph too.
        ray = getattr(self, "_ray", None)
        if ray is not None and ray.is_initialized():
            for actor in getattr(self, "actors", ()):
                ray.kill(actor)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shipped_kernels(graph: Any, schedule: Any) -> ChosenKernels:
    """The kernels the plan runs its units on (:func:`~opsched.runtime.kernels.plan_kernels`), which actors run
    too; raises :class:`ClusterError` (one line) where they cannot: compiled kernels live in this process, and a
    unit rewritten for the reordered convolutions may need the example values capture recorded, which do not
    travel with a pickled unit."""
    compiled = sorted(({schedule.run.kernels} | set((schedule.unit_kernels or {}).values()))
                      - {"eager", "packed"})
    if compiled:
        raise ClusterError(f"the plan runs units on {compiled[0]} kernels, compiled in this process: the Ray engine "
                           "runs eager kernels only")
    kernels = plan_kernels(graph, schedule, shipped=True)
    if kernels.packs and not packs_graph(graph, examples=False):
        raise ClusterError("the plan runs reordered convolutions (packed kernels) in a graph that addresses memory "
                           "as captured, which units shipped to Ray actors cannot: run it on the local engine")
    return kernels


def _unit_failure(unit: str, error: BaseException) -> str:
    return f"failed in unit {unit!r}: {type(error).__name__}: {first_line(error)}"


def _host_failed(host: Sequence[PlanDevice], what: str) -> DeviceFailed:
    """What an actor hosting ``host`` did: said of its device, or of its node and devices when it runs several."""
    if len(host) == 1:
        return DeviceFailed(host[0].name, what)
    return DeviceFailed(None, f"the actor of node {host[0].node!r} (devices {', '.join(d.name for d in host)}) {what}")


def _actor_error(error: Exception) -> str:
    """Why an actor is gone, in one line: the error its creation raised, if that was it."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    raised = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    if "killed by `ray.kill`" in str(error):
        return "its Ray actor was killed"
    return raised[-1] if raised else (lines[0] if lines else type(error).__name__)
