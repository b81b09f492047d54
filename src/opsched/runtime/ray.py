"""The Ray engine (``opsched run --engine ray``): a mapped plan's devices as Ray actors.

A mapped plan (``opsched map``) is a stream-form Schedule whose stream d is device d. This engine creates one
Ray actor per device that has units, pinned to the device's node through a custom resource the node declares,
``opsched_node:<node>`` (each actor takes :data:`NODE_SHARE` of it, and its device's ``threads`` CPUs). An actor
holds the units of its device, made callable by the local engine's operator
(:func:`opsched.runtime.kernels.unit_operator` over the Run steps of the plan's
:class:`~opsched.runtime.program.StreamProgram`), and runs them in the plan's order with
``torch.set_num_threads(threads)``.

A device's units are cut into *segments*: a segment starts at a unit that reads a value not yet on the device
(from another device, or a graph input) and ends at a unit whose value another device or the caller reads. A
segment is one remote call: it receives the values it imports and returns the ones it exports; values read
only on its device stay inside the actor. Two ways to make the calls:

- a Ray Compiled Graph (``ray.dag``), the default where the installed Ray can compile it: the calls are bound
  once into a graph whose values pass through channels between the actors; an inference is one ``execute``;
- one remote call per segment and inference, submitted in an order that respects the data, each import passed
  as the ObjectRef of the call that exports it, so that Ray starts a segment once its imports are in the
  object store, and runs an actor's segments in the order they were submitted.

On the 2-core machine this was written on, the compiled graph took a third of the remote calls' time per value
crossing devices and less than half per inference (docs/ray.md, measured). Tensors cross as NumPy arrays, which
Ray moves as raw buffers where it would pickle a tensor.

A run that fails is one :class:`DeviceFailed` naming the device: an actor that died, a unit that raised, or a
device that did not finish within ``run_seconds``; the module is then closed. Nothing here is imported by
``import opsched``: Ray is imported when it is used, and a missing Ray is one line telling the user to install
the ``[ray]`` extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch
import torch.utils._pytree as pytree

from opsched.errors import OpschedError
from opsched.runtime.kernels import unit_operator
from opsched.runtime.program import Run, compile_program, store_outputs
from opsched.schedule import PlanDevice

NODE_RESOURCE = "opsched_node:"
NODE_SHARE = 0.01       # of a node's resource per actor: a node declaring 1 hosts up to 100 devices
CONNECT_SECONDS = 5.0   # for the address's port to answer
PROBE_SECONDS = 15.0    # for a Ray driver to connect there and list the cluster's resources
START_SECONDS = 120.0   # for every actor to be placed and to load its units
RUN_SECONDS = 60.0      # for one inference
PING_SECONDS = 2.0      # for an actor to say how it is, after a failure


class RayUnavailable(OpschedError):
    """Ray is not installed."""


class ClusterError(OpschedError):
    """No usable Ray: the address does not answer, a local Ray cannot start, or the cluster lacks a node of
    the plan."""


class DeviceFailed(RuntimeError):
    """A run on Ray failed; ``device`` names the device whose actor died, raised or did not finish (None when
    Ray failed otherwise)."""

    def __init__(self, device: str | None, what: str):
        super().__init__(f"device {device!r} {what}" if device else f"the run on Ray failed: {what}")
        self.device = device


class UnitError(RuntimeError):
    """Raised inside an actor, in one picklable line: a unit raised, or a value the call needed was never made
    because an earlier call of the same inference failed."""


def import_ray(local: bool = False) -> Any:
    """The ``ray`` module, or :class:`RayUnavailable` in one line. ``local``: Ray is about to be started on this
    machine for one run."""
    if local and "ray" not in sys.modules:
        # Unless told when it is imported that it runs on one machine, Ray advertises this machine's network
        # address and its servers listen on every interface; a Ray started for one run stays on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run sends no usage report
    # A failed run is reported once, by DeviceFailed: without this, every call downstream of the failure is
    # logged again when its reference is dropped.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--engine ray needs Ray, which is not installed: pip install 'opsched[ray]'") from None
    return ray


# -- the cluster --

@contextlib.contextmanager
def ray_cluster(nodes: Sequence[str], cpus: int, address: str | None = None) -> Iterator[str]:
    """Ray for one run, yielding what it is: the cluster this process is already connected to (left as it
    is; ``address``, if given, must be its own), the cluster at ``address`` (disconnected after), or a Ray
    started here for the run, on loopback, declaring ``opsched_node:<node>`` for each of ``nodes`` and ``cpus``
    CPUs (shut down after, even on error). A cluster that lacks one of ``nodes`` is refused in one line
    (:class:`ClusterError`), before any actor is made."""
    ray = import_ray(local=address is None)
    if ray.is_initialized():
        connected = ray.get_runtime_context().gcs_address
        if address is not None and address not in (connected, "auto"):
            raise ClusterError(f"this process is connected to the Ray cluster at {connected}, not {address}")
        where = f"the Ray cluster at {connected}, which this process was connected to"
        check_nodes(ray.cluster_resources(), nodes, where)
        yield where
        return
    # CRITICAL: the engine reports a failure itself, in one line; Ray would log it again from its threads
    quiet = {"logging_level": logging.CRITICAL, "log_to_driver": False}
    if address is not None:
        where = f"the Ray cluster at {address}"
        check_nodes(probe(address), nodes, where)
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # noqa: BLE001 - connecting fails in many ways; one line for the user
            raise ClusterError(f"cannot connect to {where}: {_first_line(e)}") from None
    else:
        where = "a local Ray started for the run"
        # Ray's memory monitor kills workers when the machine, not Ray, runs short of memory: in a Ray that
        # holds only this run's actors, it would end the run for what other programs use.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    try:
        if address is None:
            with _ctrl_c_held():
                try:
                    # "local": a new Ray even when this machine runs a cluster (ray start), whose nodes are the user's
                    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                             resources={NODE_RESOURCE + n: 1.0 for n in dict.fromkeys(nodes)}, **quiet)
                except Exception as e:  # noqa: BLE001 - Ray fails to start in many ways; one line for the user
                    raise ClusterError(f"could not start a local Ray: {_first_line(e)}") from None
        yield where
    except BaseException as error:
        # The frames it came through hold Ray's objects: a channel read that Ctrl-C interrupted holds a buffer of
        # Ray's shared memory, whose release, once Ray was down, crashed the process (SIGSEGV, as the run ended).
        chained: BaseException | None = error
        while chained is not None:
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__context__
        raise
    finally:
        with _ctrl_c_held():
            ray.shutdown()  # also the processes of a start that failed


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C while Ray starts or shuts down, and raise it once that is over: Ray interrupted halfway leaves
    processes behind. Its start, say, has not yet recorded the processes it started, so that shutting it down
    cannot end them: the raylet's agents outlived an interrupted ``opsched run`` by a minute (measured). Signal
    handlers belong to the main thread: elsewhere, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            raise KeyboardInterrupt


_PROBE = """
import json, logging, sys
try:
    import ray
    ray.init(address=sys.argv[1], logging_level=logging.CRITICAL, log_to_driver=False)
    print(json.dumps({"resources": ray.cluster_resources()}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {str(e).strip()}"}))
"""


def probe(address: str, seconds: float = PROBE_SECONDS) -> dict[str, float]:
    """The resources of the Ray cluster at ``address``, asked by a child process once its port answers:
    ``ray.init`` retries an address that does not answer for minutes, printing from its C++ core on stderr,
    and a child process can be given a deadline and its output kept."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if colon and port.isdigit():  # HOST:PORT (``auto`` is found by Ray itself, and said by the probe)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as e:
            raise ClusterError(f"cannot reach a Ray cluster at {address}: {e.strerror or e}") from None
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address], check=False, capture_output=True,
                              text=True, timeout=seconds, env=env)
    except subprocess.TimeoutExpired as e:
        said = _last_ray_log(e.stderr.decode(errors="replace") if e.stderr else "")
        raise ClusterError(f"no Ray cluster answered at {address} within {seconds:g} s"
                           + (f" (Ray: {said})" if said else "")) from None
    lines = done.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {
        "error": _first_line(done.stderr) if done.stderr.strip() else "the probe printed nothing"}
    if "error" in answer:
        raise ClusterError(f"cannot connect to a Ray cluster at {address}: {_first_line(answer['error'])}")
    return answer["resources"]


def _last_ray_log(stderr: str) -> str:
    """The message of the last line Ray's C++ core logged (``[time W pid tid] file.cc:line: message``), which
    says why it keeps retrying: an authentication token missing, say."""
    lines = [line for line in stderr.splitlines() if line.startswith("[")]
    return lines[-1].split("] ", 1)[-1].split(": ", 1)[-1].strip() if lines else ""


def check_nodes(resources: dict[str, float], nodes: Sequence[str], where: str) -> None:
    """Refuse a cluster none of whose Ray nodes declares ``opsched_node:<node>`` for one of ``nodes``."""
    missing = [n for n in dict.fromkeys(nodes) if resources.get(NODE_RESOURCE + n, 0.0) < NODE_SHARE]
    if missing:
        declare = ", ".join(f'"{NODE_RESOURCE}{n}": 1' for n in missing)
        raise ClusterError(f"{where} has no Ray node for the plan's node(s) {', '.join(missing)}: start one "
                           f"for each with ray start --resources='{{{declare}}}'")


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- segments --

@dataclass(frozen=True)
class Segment:
    """A run of one device's steps made by one remote call: ``steps`` index the device's Run steps,
    ``position`` orders the device's segments; ``imports`` are the slots it receives (in argument order),
    ``exports`` the slots it returns."""

    device: int
    position: int
    steps: tuple[int, ...]
    imports: tuple[int, ...]
    exports: tuple[int, ...]


def cut_segments(program: Any, per_unit: bool = False) -> list[Segment]:
    """Each stream's Run steps cut into segments (one per step with ``per_unit``, which the benchmark
    compares), in an order in which every import is exported by an earlier segment (graph inputs come from
    the caller)."""
    graph = program.graph
    inputs = len(graph.inputs)
    runs = [[s for s in steps if isinstance(s, Run)] for steps in program.streams]
    producer = {inputs + u: k for k, steps in enumerate(runs) for s in steps for u in s.units}
    readers: dict[int, set[int]] = {}  # slot -> streams that read it
    for k, steps in enumerate(runs):
        for s in steps:
            for a in graph.nodes[s.units[0]].args:
                readers.setdefault(program.slot(a), set()).add(k)
    returned = set(program.outputs)
    segments: list[Segment] = []
    for k, steps in enumerate(runs):
        mine: list[Segment] = []
        received: set[int] = set()
        current: list[int] = []
        imports: list[int] = []
        for i, s in enumerate(steps):
            arriving = [slot for slot in dict.fromkeys(program.slot(a) for a in graph.nodes[s.units[0]].args)
                        if producer.get(slot) != k and slot not in received]
            if arriving and current:
                mine.append(Segment(k, len(mine), tuple(current), tuple(imports), ()))
                current, imports = [], []
            current.append(i)
            imports.extend(arriving)
            received.update(arriving)
            exports = [slot for slot in (inputs + u for u in s.units)
                       if slot in returned or readers.get(slot, set()) - {k}]
            if exports or per_unit or i == len(steps) - 1:
                mine.append(Segment(k, len(mine), tuple(current), tuple(imports), tuple(exports)))
                current, imports = [], []
        segments += mine
    return _submission_order(segments)


def _submission_order(segments: list[Segment]) -> list[Segment]:
    """The segments in an order where each comes after the segments exporting its imports and after its
    device's earlier segments; ties go to the lower position on its device, so that devices advance together."""
    exporter = {slot: j for j, s in enumerate(segments) for slot in s.exports}
    index = {(s.device, s.position): j for j, s in enumerate(segments)}
    users: dict[int, list[int]] = {}
    waiting = []
    for j, s in enumerate(segments):
        deps = {exporter[slot] for slot in s.imports if slot in exporter}
        if s.position:
            deps.add(index[(s.device, s.position - 1)])
        for d in deps:
            users.setdefault(d, []).append(j)
        waiting.append(len(deps))
    ready = [(segments[j].position, j) for j, w in enumerate(waiting) if not w]
    heapq.heapify(ready)
    order = []
    while ready:
        _, j = heapq.heappop(ready)
        order.append(segments[j])
        for u in users.get(j, ()):
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (segments[u].position, u))
    if len(order) != len(segments):
        raise OpschedError("the mapped plan's device orders deadlock: a device waits for a unit placed after it")
    return order


# -- values crossing devices --

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


# -- units crossing to the actors --

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


def _shipped(node: Any) -> Any:
    return dataclasses.replace(node, run=_Shipped(node.run)) if isinstance(node.run, torch.fx.GraphModule) else node


# -- the actor --

class DeviceWorker:
    """One device of the plan, as a Ray actor. ``steps``: its Run steps as (nodes, slots read, slots written,
    slots released after); ``segments``: (steps, imports, exports, exports no later step reads). The values of
    one inference live in ``values``; the device's first segment starts a new inference."""

    def __init__(self, name: str, threads: int, steps: Sequence[tuple], segments: Sequence[tuple]):
        self.name = name
        self.threads = threads
        torch.set_num_threads(threads)
        self.steps = [(unit_operator(nodes, threads), reads, writes, release, "+".join(n.name for n in nodes))
                      for nodes, reads, writes, release in steps]
        self.segments = list(segments)
        self.values: dict[int, Any] = {}
        self.running: str | None = None   # the unit running now, read by status() from another thread
        self.failure: str | None = None   # the inference's first unit failure

    def status(self) -> tuple[int, str | None, str | None]:
        """(process id, the unit running, the first unit failure of the current inference)."""
        return os.getpid(), self.running, self.failure

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
                fn, reads, writes, release, name = self.steps[i]
                if any(slot not in values for slot in reads):
                    raise UnitError(f"unit {name!r} skipped: an earlier call of this inference failed")
                self.running = name
                try:
                    result = fn(*[values[slot] for slot in reads])
                except Exception as e:  # noqa: BLE001 - reported to the driver in one picklable line
                    self.failure = f"failed in unit {name!r}: {type(e).__name__}: {_first_line(e)}"
                    raise UnitError(self.failure) from None
                finally:
                    self.running = None
                store_outputs(values, writes, result)
                for slot in release:
                    del values[slot]
        out = tuple(to_wire(values[slot]) for slot in exports)
        for slot in drop:
            del values[slot]
        return out[0] if len(out) == 1 else (out or None)


# -- the module --

class RayModule:
    """A mapped plan run by Ray actors, one per device with units; called like the model (inputs and outputs
    structured as its). Needs a connected Ray (:func:`ray_cluster`) with every node of the plan.

    ``compiled``: make the calls as one Ray Compiled Graph (True), as remote calls (False), or the graph when
    the installed Ray can compile it (None). ``per_unit``: a call per unit instead of per segment (the
    benchmark compares). ``close()`` (or leaving a ``with`` block) ends the actors, as does collecting an unclosed
    module.

    Calls from several threads run one at a time: a Compiled Graph's ``execute`` is not thread-safe (two at once
    aborted the process in Ray's C++ core), and each actor holds the values of one inference (two inferences of
    remote calls interleaved mixed them up: wrong outputs). An actor runs one call at a time anyway."""

    def __init__(self, graph: Any, schedule: Any, compiled: bool | None = None, per_unit: bool = False,
                 run_seconds: float = RUN_SECONDS, start_seconds: float = START_SECONDS):
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
        check_nodes(ray.cluster_resources(), [d.node for d in self.devices], "the connected Ray cluster")
        program = compile_program(schedule, graph, max(d.threads for d in self.devices))
        self.segments = cut_segments(program, per_unit)
        self.inputs = len(graph.inputs)
        self.outputs = program.outputs
        # what the actors return: each output a unit makes, once (an output may be a graph input, or repeated)
        self._returned = list(dict.fromkeys(slot for slot in self.outputs if slot >= self.inputs))
        # an input goes with the call that reads it (inline when small); one that several calls read is put in
        # the object store once: a put costs more than a call here (1.8 ms against 1 ms, measured)
        self._shared_inputs = [sum(i in s.imports for s in self.segments) > 1 for i in range(self.inputs)]
        self._failure: DeviceFailed | None = None
        self._graph: Any = None
        self.actors: list[Any] = []
        worker = ray.remote(DeviceWorker)
        for k, device in enumerate(self.devices):
            runs = [s for s in program.streams[k] if isinstance(s, Run)]
            steps = [([_shipped(graph.nodes[u]) for u in s.units],
                      tuple(program.slot(a) for a in graph.nodes[s.units[0]].args),
                      tuple(self.inputs + u for u in s.units), s.release) for s in runs]
            read_here = {slot for _, reads, _, _ in steps for slot in reads}
            mine = sorted((s for s in self.segments if s.device == k), key=lambda s: s.position)
            specs = [(s.steps, s.imports, s.exports, tuple(e for e in s.exports if e not in read_here)) for s in mine]
            self.actors.append(worker.options(
                num_cpus=device.threads, resources={NODE_RESOURCE + device.node: NODE_SHARE},
                max_restarts=0, max_task_retries=0).remote(device.name, device.threads, steps, specs))
        try:
            self._await_start(start_seconds)
            self.compiled = self._compile() if compiled is not False else False
            if compiled and not self.compiled:
                raise ClusterError("this Ray cannot compile the plan's calls into a Compiled Graph")
        except BaseException:
            self.close()
            raise

    def _await_start(self, seconds: float) -> None:
        ray = self._ray
        pending = {a.status.remote(): d for a, d in zip(self.actors, self.devices)}
        ready, waiting = ray.wait(list(pending), num_returns=len(pending), timeout=seconds)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise DeviceFailed(pending[ref].name, f"could not start its Ray actor: {_actor_error(e)}") from None
        if waiting:
            late = pending[waiting[0]]
            raise DeviceFailed(late.name, f"(node {late.node}) was not placed and started within {seconds:g} s: "
                                          f"has a Ray node declaring {NODE_RESOURCE}{late.node} {late.threads} "
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
            late = next((self.devices[d] for ref, d in calls if ref not in done), None)
            raise self._fail(e, late) from None

    def _fail(self, error: Exception, late: PlanDevice | None = None) -> DeviceFailed:
        """The failure as one :class:`DeviceFailed` naming the device: one whose actor is gone, else one whose
        unit raised, else (a timeout) one still running; the module is closed, and later calls raise it too."""
        ray = self._ray
        pings = {a.status.remote(): d for a, d in zip(self.actors, self.devices)}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_SECONDS)
        dead = failed = running = None  # each (device, what)
        for ref in answered:
            try:
                _, unit, failure = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead = dead or (pings[ref], f"died: {_actor_error(e)}")
                continue
            failed = failed or (failure and (pings[ref], failure))
            running = running or (unit and (pings[ref], f"running unit {unit!r}"))
        timed_out = isinstance(error, ray.exceptions.GetTimeoutError | ray.exceptions.RayChannelTimeoutError)
        if dead or failed:
            device, what = dead or failed
            self._failure = DeviceFailed(device.name, what)
        elif timed_out and (running or late):
            device, where = running or (late, None)
            self._failure = DeviceFailed(device.name, f"did not finish within {self.run_seconds:g} s"
                                         + (f" ({where})" if where else ""))
        else:
            self._failure = DeviceFailed(None, f"{type(error).__name__}: {_first_line(error)}")
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


def _actor_error(error: Exception) -> str:
    """Why an actor is gone, in one line: the error its creation raised, if that was it."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    raised = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    if "killed by `ray.kill`" in str(error):
        return "its Ray actor was killed"
    return raised[-1] if raised else (lines[0] if lines else type(error).__name__)
