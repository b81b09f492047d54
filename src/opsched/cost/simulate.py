"""The simulated GPU cost model (``--cost sim:NAME``): an analytical model of a unit's kernels on a device
from the catalogue (``devices.py``), so that the GPU story can be studied on a machine without a GPU.
Every figure it gives is *simulated*, and is labelled so wherever it is shown.

A unit becomes the kernels a cuDNN-style engine launches for it: one kernel per leading light operator (a
weighted sum of inputs is a few element-wise kernels), then its heavy operator with the trailing light ones
fused in (batch norm folded, activation in the epilogue); a separable convolution is a depthwise and a
pointwise kernel; an element-wise unit is one kernel per operator. Each kernel:

- runs as thread blocks: a convolution or matmul is an implicit GEMM cut into ``TILE`` x ``TILE`` output
  tiles (split along K when the tiles alone cannot fill the device); the other kernels have one block per
  ``ELEMENTS_PER_BLOCK`` outputs. The device runs ``sms * blocks_per_sm`` blocks at once; blocks run in
  waves, and the last wave may be partly empty (wave quantisation), so a small kernel leaves most SMs idle;
- takes ``max(compute, memory)``: FLOPs at the device's peak times the kernel's efficiency times the filled
  fraction of the waves, bytes at the device's bandwidth, which a kernel occupying few SMs cannot saturate;
- is preceded by the launch gap ``launch_us`` during which its stream does nothing.

A concurrent stage runs its groups as streams; kernels on different streams share the SMs and bandwidth as a
fluid: while the running kernels together ask for more than the whole device (SM shares or bandwidth shares
summing past 1), each progresses proportionally slower. Joining k streams costs ``sync_us * (k - 1)``. A merged
stage is one convolution with the stacked output channels and the largest kernel.

A stream schedule (LIOS, Nimble) runs through the same model, each unit waiting (``sync_us``) for its
inputs made on other streams.

Example: two independent small convolutions run side by side in about the time of one.

>>> from opsched.graph.ir import Graph, Node, indices
>>> conv = dict(kind="conv", args=("x",), shape=(1, 64, 17, 17), dtype="float32", flops=2 * 289 * 64 * 576,
...             bytes_read=4 * (288 * 17 * 17 + 64 * 576), bytes_written=4 * 64 * 289, param_bytes=4 * 64 * 576,
...             attrs={"op": "conv2d", "kernel": (3, 3), "stride": (1, 1), "padding": (1, 1), "groups": 1,
...                    "in_channels": 64, "out_channels": 64, "post": ("relu",)})
>>> g = Graph([Node("a", **conv), Node("b", **conv)], inputs=["x"])
>>> sim = SimulatedGPU(g, "v100")
>>> one, both = sim.op_latency(0), sim.stage_latency([[0], [1]])
>>> one < both < 1.5 * one
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opsched.cost.devices import DEVICES, SIMULATED_PREFIX, Device
from opsched.errors import OpschedError
from opsched.graph.ir import Graph, Node, indices

TILE = 64                 # output tile of one GEMM thread block (rows and columns)
SPLIT_K_CHUNK = 256       # a split-K slice covers at least this much of the reduction
ELEMENTS_PER_BLOCK = 1024  # outputs per block of an element-wise, pooling or depthwise kernel
GEMM_EFFICIENCY = 0.40    # fraction of peak a full-wave implicit-GEMM convolution reaches
DEPTHWISE_EFFICIENCY = 0.06  # depthwise convolution: grouped direct loops, little data reuse
DIRECT_EFFICIENCY = 0.06  # pooling, element-wise, concatenation
MEMORY_EFFICIENCY = 0.75  # fraction of the datasheet bandwidth a streaming kernel reaches
BANDWIDTH_SM_FRACTION = 0.35  # a kernel on this fraction of the SMs (or more) can saturate the bandwidth

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Kernel:
    """One kernel as the simulator sees it: how long it runs alone (us, launch gap excluded), and what
    share of the SMs and of the bandwidth it holds while it runs."""

    seconds_us: float
    sm_share: float
    bandwidth_share: float


def device_named(name: str) -> Device:
    """The catalogue entry for ``name`` (``v100``, or ``sim:v100``)."""
    key = name.removeprefix(SIMULATED_PREFIX).lower()
    if key not in DEVICES:
        raise OpschedError(f"unknown simulated device {name!r}; choose from "
                           f"{', '.join('sim:' + d for d in DEVICES)}")
    return DEVICES[key]


class SimulatedGPU:
    """Simulated latencies in milliseconds on the catalogue device ``device``."""

    sync_overhead: float
    capacity = 0.0  # the device's parallelism is in the stage model, not a unit count

    def __init__(self, graph: Graph, device: str | Device):
        self.device = device if isinstance(device, Device) else device_named(device)
        self.name = f"sim:{self.device.name}"
        self.graph = graph
        self.sync_overhead = self.device.sync_us / 1000.0
        self.kernels = [unit_kernels(n, self.device) for n in graph.nodes]
        self.latencies = [self._run([k]) for k in self.kernels]
        self.regions: dict[tuple[int, ...], float] = {}  # stays empty: see region_latencies

    def op_latency(self, unit: int) -> float:
        return self.latencies[unit]

    def stage_latency(self, groups: Sequence[Sequence[int]]) -> float:
        if len(groups) == 1:
            return sum(self.latencies[u] for u in groups[0])
        streams = [[k for u in g for k in self.kernels[u]] for g in groups]
        return self._run(streams) + self.sync_overhead * (len(groups) - 1)

    def stage_threads(self, groups: Sequence[Sequence[int]]) -> None:
        return None

    def merge_latency(self, units: Sequence[int]) -> float | None:
        return self._run([merged_kernels([self.graph.nodes[u] for u in units], self.device)])

    def region_latencies(self, regions: Sequence[Sequence[int]]) -> None:
        return None  # nothing here is compiled, so no region fuses anything

    def stream_latency(self, makespan: float, streams: Sequence[Sequence[int]]) -> float:
        # Run the streams through the device model: a unit waits (device side, sync_us) for its inputs
        # made on other streams, and kernels of all streams share the SMs and the bandwidth.
        stream_of = {u: k for k, units in enumerate(streams) for u in units}
        kernels: list[list[Kernel]] = []
        last: dict[int, tuple[int, int]] = {}  # unit -> (stream, position of its last kernel)
        waits: list[dict[int, list[tuple[int, int]]]] = []
        for k, units in enumerate(streams):
            row: list[Kernel] = []
            gates: dict[int, list[tuple[int, int]]] = {}
            for u in units:
                deps = [v for v in indices(self.graph.preds[u]) if stream_of[v] != k]
                if deps:
                    gates[len(row)] = deps  # resolved to positions below, once every stream is laid out
                row.extend(self.kernels[u])
                last[u] = (k, len(row) - 1)
            kernels.append(row)
            waits.append(gates)
        resolved = [{p: [last[v] for v in deps] for p, deps in gates.items()} for gates in waits]
        return simulate_streams(kernels, self.device.launch_us, resolved, self.device.sync_us) / 1000.0

    def _run(self, streams: list[list[Kernel]]) -> float:
        return simulate_streams(streams, self.device.launch_us) / 1000.0

    def describe(self) -> dict:
        return {"name": self.name, "simulated": True, "unit": "ms", "device": self.device.describe()}


def simulate_streams(streams: Sequence[Sequence[Kernel]], launch_us: float,
                     waits: Sequence[dict[int, list[tuple[int, int]]]] | None = None, wait_us: float = 0.0) -> float:
    """Microseconds until every stream has run its kernels in order. Kernels of different streams share
    the device as a fluid (see the module docstring); launches are issued by one host thread, so the
    launch gaps of different streams follow one another (first come, first served) instead of overlapping.
    ``waits[i][p]`` lists kernels (stream, position) that must finish before kernel ``p`` of stream ``i``
    runs; the host thread spends a further ``wait_us`` issuing the event wait (and the producer's record)
    before that launch, time in which it launches nothing else: with many small kernels on many streams,
    synchronisation, not the device, sets the pace (LIOS measured SqueezeNet slower on 8 streams than on one).

    >>> k = Kernel(10.0, sm_share=0.5, bandwidth_share=0.1)
    >>> simulate_streams([[k]], 0.0), simulate_streams([[k], [k]], 0.0), simulate_streams([[k], [k], [k]], 0.0)
    (10.0, 10.0, 15.0)
    >>> simulate_streams([[k], [k]], 5.0)
    20.0
    >>> simulate_streams([[k], [k]], 0.0, waits=[{}, {0: [(0, 0)]}], wait_us=2.0)
    22.0
    >>> simulate_streams([[k, k], [k]], 1.0, waits=[{}, {0: [(0, 0)]}], wait_us=2.0)  # the host issues the wait
    25.0
    """
    n = len(streams)
    waits = waits or [{} for _ in streams]
    position = [0] * n
    finished = [0] * n                       # kernels done per stream (they finish in order)
    work = [s[0].seconds_us if s else 0.0 for s in streams]  # alone-time left of each stream's current kernel
    blocked: set[int] = set()                # streams waiting for kernels of other streams
    launching: list[int] = []                # streams waiting for the host to launch, in arrival order
    synced: set[int] = set()                 # streams whose next launch follows an event wait
    running: list[int] = []
    clock = 0.0

    def arrive(i: int) -> None:
        if waits[i].get(position[i]):
            blocked.add(i)
        else:
            launching.append(i)

    for i in range(n):
        if streams[i]:
            arrive(i)
    launch_left = None  # host time left for the launch at the head of the queue
    while launching or running or blocked:
        for i in sorted(blocked):
            if all(finished[j] > p for j, p in waits[i][position[i]]):
                blocked.discard(i)
                synced.add(i)
                launching.append(i)
        if not (launching or running):
            raise ValueError("the streams wait on each other: the order deadlocks")
        if launching and launch_left is None:
            launch_left = launch_us + (wait_us if launching[0] in synced else 0.0)
        sm = sum(streams[i][position[i]].sm_share for i in running)
        bandwidth = sum(streams[i][position[i]].bandwidth_share for i in running)
        rate = 1.0 / max(1.0, sm, bandwidth)
        candidates = [work[i] / rate for i in running]
        if launching:
            candidates.append(launch_left)
        step = min(candidates)
        clock += step
        if launching:
            launch_left -= step
        for i in running:
            work[i] -= step * rate
        done = [i for i in running if work[i] <= 1e-9]
        running = [i for i in running if work[i] > 1e-9]
        if launching and launch_left <= 1e-9:
            started = launching.pop(0)
            synced.discard(started)
            running.append(started)
            launch_left = None
        for i in done:
            position[i] += 1
            finished[i] += 1
            if position[i] < len(streams[i]):
                work[i] = streams[i][position[i]].seconds_us
                arrive(i)
    return clock


def unit_kernels(node: Node, device: Device) -> list[Kernel]:
    """The kernels a unit launches (see the module docstring)."""
    size = _DTYPE_BYTES.get(node.dtype or "float32", 4)
    peak = _peak(node, device)
    out = math.prod(node.shape) if node.shape else max(1, node.bytes_written // size)
    activation_in = max(0, node.bytes_read - node.param_bytes)
    a = node.attrs
    kernels = []
    kernels.extend(_elementwise(len(a.get("pre", ())), activation_in, size, peak, device))
    if node.kind == "sepconv" and "kernel" in a:
        # depthwise into its own channels at the output's spatial size, then a pointwise GEMM
        spatial = max(1, out // node.shape[1])
        depthwise_out = spatial * a["out_channels"]
        kernels.append(_kernel(2.0 * depthwise_out * math.prod(a["kernel"]), activation_in + depthwise_out * size,
                               depthwise_out, peak, DEPTHWISE_EFFICIENCY, device))
        kernels.append(_gemm(spatial, node.shape[1], a["out_channels"],
                             depthwise_out * size + node.bytes_written + node.param_bytes, peak, device))
    elif node.kind == "conv" and "kernel" in a and a.get("groups", 1) == 1:
        rows = max(1, a.get("out_elements", out) // a["out_channels"])
        kernels.append(_gemm(rows, a["out_channels"], a["in_channels"] * math.prod(a["kernel"]),
                             activation_in + node.bytes_written + node.param_bytes, peak, device))
    elif node.kind == "linear" and node.shape:
        columns = node.shape[-1]
        rows = out // columns
        depth = max(1, round(node.flops / (2 * rows * columns)))
        kernels.append(_gemm(rows, columns, depth, node.bytes_read + node.bytes_written, peak, device))
    elif node.kind == "elementwise":
        kernels.extend(_elementwise(len(node.ops), node.bytes_read + node.bytes_written, size, peak, device))
    else:
        # grouped convolution, pooling, concatenation: a direct pass over the data
        kernels.append(_kernel(node.flops, node.bytes_read + node.bytes_written, out, peak, DIRECT_EFFICIENCY,
                               device))
    return kernels


def merged_kernels(nodes: Sequence[Node], device: Device) -> list[Kernel]:
    """The kernels of convolutions merged into one (IOS operator merge): the shared leading operators
    once, then one GEMM with the stacked output channels and the largest kernel."""
    first = nodes[0]
    size = _DTYPE_BYTES.get(first.dtype or "float32", 4)
    peak = _peak(first, device)
    activation_in = max(0, first.bytes_read - first.param_bytes)
    window = max(math.prod(n.attrs["kernel"]) for n in nodes)
    channels = sum(n.attrs["out_channels"] for n in nodes)
    rows = max(1, first.attrs.get("out_elements", math.prod(first.shape)) // first.attrs["out_channels"])
    written = sum(n.bytes_written for n in nodes)
    params = channels * first.attrs["in_channels"] * window * size
    kernels = _elementwise(len(first.attrs.get("pre", ())), activation_in, size, peak, device)
    kernels.append(_gemm(rows, channels, first.attrs["in_channels"] * window, activation_in + written + params,
                         peak, device))
    return kernels


def _elementwise(count: int, nbytes: int, size: int, peak: float, device: Device) -> list[Kernel]:
    """``count`` element-wise passes over ``nbytes`` of activations, one kernel each."""
    return [_kernel(0.0, 2 * nbytes, nbytes // size, peak, DIRECT_EFFICIENCY, device)] * count


def _peak(node: Node, device: Device) -> float:
    """Peak FLOP/s for the unit's dtype."""
    return 1e12 * (device.fp16_tflops if node.dtype in ("float16", "bfloat16") else device.fp32_tflops)


def _gemm(rows: int, columns: int, depth: int, nbytes: float, peak: float, device: Device) -> Kernel:
    """An implicit GEMM (rows x depth) @ (depth x columns) in TILE x TILE output tiles, split along depth
    when the tiles alone leave SMs idle."""
    tiles = math.ceil(rows / TILE) * math.ceil(columns / TILE)
    slots = device.sms * device.blocks_per_sm
    splits = max(1, min(slots // tiles, math.ceil(depth / SPLIT_K_CHUNK)))
    return _kernel(2.0 * rows * columns * depth, nbytes, tiles * splits * ELEMENTS_PER_BLOCK, peak, GEMM_EFFICIENCY,
                   device)


def _kernel(flops: float, nbytes: float, outputs: int, peak: float, efficiency: float, device: Device) -> Kernel:
    """A kernel of ``ceil(outputs / ELEMENTS_PER_BLOCK)`` blocks run in waves over the device."""
    blocks = max(1, math.ceil(outputs / ELEMENTS_PER_BLOCK))
    slots = device.sms * device.blocks_per_sm
    waves = math.ceil(blocks / slots)
    filled = blocks / (waves * slots)
    occupied = min(blocks, slots) / slots
    compute = flops / (peak * device.efficiency * efficiency * filled)
    bandwidth = 1e9 * device.memory_gbs * MEMORY_EFFICIENCY * min(1.0, occupied / BANDWIDTH_SM_FRACTION)
    memory = nbytes / bandwidth
    seconds = max(compute, memory, 1e-7)
    return Kernel(seconds * 1e6, sm_share=occupied, bandwidth_share=min(1.0, nbytes / seconds / (
        1e9 * device.memory_gbs * MEMORY_EFFICIENCY)))
