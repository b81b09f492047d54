"""A mapping problem: a graph, a platform, and what each unit costs on each device.

``times[u][d][k - 1]`` is unit ``u`` on device ``d`` processing ``k`` of the batch's ``pieces`` pieces at
once (``inf`` where the device does not accept that batch). For the latency objective there is one piece
(the whole batch); for throughput the batch of B inputs is cut into 4 pieces of B/4, so a device may run a
unit for B/4, B/2, 3B/4 or B inputs (DiviML). A value crossing devices costs the link's latency plus its
bytes (for the pieces moved) over the bandwidth.

>>> from opsched.graph.ir import Graph, Node
>>> from opsched.mapping.platform import platform_from_dict
>>> g = Graph([Node("a", latency=2.0), Node("b", args=("a",), latency=3.0)])
>>> p = platform_from_dict({"devices": [{"name": "x"}, {"name": "y", "scale": 2}],
...                         "links": {"default": {"bandwidth": 1, "latency": 0}}})
>>> prob = build_problem(g, p, edge_bytes={(0, 1): 5.0})
>>> prob.time(1, 1), prob.comm(0, 1, 0, 1), prob.comm(0, 1, 1, 1)
(6.0, 5.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from opsched.cost.devices import CPUS, is_simulated
from opsched.graph.ir import Graph
from opsched.mapping import MappingError
from opsched.mapping.platform import Device, Platform, figures_simulated

OBJECTIVES = ("latency", "throughput")
THROUGHPUT_PIECES = 4


@dataclass
class Problem:
    graph: Graph
    platform: Platform
    times: list[list[list[float]]]
    edge_bytes: dict[tuple[int, int], float]
    activation_bytes: list[float]
    weight_bytes: list[float]
    objective: str = "latency"
    batch: int = 1
    pieces: int = 1
    time_unit: str = ""
    simulated: bool = True  # the figures' label: see opsched.mapping.platform.figures_simulated
    notes: list[str] = field(default_factory=list)
    # Milliseconds a value crossing between two CPU devices costs beyond its link: the local engine runs the
    # devices as threads of one process, and the device waiting for the value has its thread woken (measured
    # with the units; 0 where nothing runs, and for other devices).
    handoff: float = 0.0
    # By device index, how much slower its units run beside the other CPU devices' than alone (measured for a
    # mapping; a device not named: 1): see :mod:`opsched.runtime.corun` and :meth:`beside`. ``times`` are the units
    # alone.
    co_running: Mapping[int, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.graph)

    @property
    def devices(self) -> int:
        return len(self.platform)

    def time(self, u: int, d: int, k: int | None = None) -> float:
        """Unit ``u`` on device ``d`` for ``k`` pieces (default: all of them)."""
        return self.times[u][d][(k or self.pieces) - 1]

    def comm(self, a: int, b: int, da: int, db: int, k: int | None = None) -> float:
        """Moving ``a``'s output read by ``b`` (``k`` pieces of it) from device ``da`` to ``db``."""
        if da == db:
            return 0.0
        moved = self.platform.transfer_time(da, db, self.edge_bytes.get((a, b), 0.0) * (k or self.pieces) / self.pieces)
        if self.handoff and self.platform.devices[da].kind == "cpu" == self.platform.devices[db].kind:
            moved += self.handoff
        return moved

    def memory(self, u: int, k: int | None = None) -> float:
        """Bytes unit ``u`` holds on a device running ``k`` pieces of it: weights, inputs and output."""
        return self.weight_bytes[u] + self.activation_bytes[u] * (k or self.pieces) / self.pieces

    def fastest(self, u: int) -> int:
        """The device running ``u`` (the whole batch) fastest; ties to the lowest index."""
        return min(range(self.devices), key=lambda d: (self.time(u, d), d))

    def speed_classes(self) -> list[list[int]]:
        """The devices grouped by their costs: two devices are in one class when every unit costs the same on
        both (GPT-3's cluster: its twelve A100s, its twelve T4s)."""
        classes: dict[tuple, list[int]] = {}
        for d in range(self.devices):
            classes.setdefault(tuple(tuple(self.times[u][d]) for u in range(self.n)), []).append(d)
        return list(classes.values())

    def objective_value(self, makespan: float) -> float:
        """What the objective reports for a makespan: the latency, or inputs per time unit."""
        if self.objective == "throughput":
            return self.batch / makespan if makespan > 0 else math.inf
        return makespan

    def beside(self) -> Problem:
        """The problem with the CPU devices' units at their cost beside each other: what a mapping keeping
        several of them busy costs (a device alone costs ``times``)."""
        if not self.co_running:
            return self
        times = [[[t * self.co_running.get(d, 1.0) for t in row] for d, row in enumerate(per_device)]
                 for per_device in self.times]
        return replace(self, times=times)

    def sub(self, units: Sequence[int]) -> Problem:
        """The problem restricted to ``units`` (edges to units outside are dropped), renumbered in order."""
        keep = sorted(units)
        position = {u: i for i, u in enumerate(keep)}
        nodes = [replace(self.graph.nodes[u], args=tuple(a for a in self.graph.nodes[u].args
                                                         if self.graph.index.get(a) in position))
                 for u in keep]
        graph = Graph(nodes, name=f"{self.graph.name}/sub")
        # Graph keeps the given order when it is topological, so index i of ``graph`` is ``keep[i]``.
        return Problem(graph, self.platform, [self.times[u] for u in keep],
                       {(position[a], position[b]): v for (a, b), v in self.edge_bytes.items()
                        if a in position and b in position},
                       [self.activation_bytes[u] for u in keep], [self.weight_bytes[u] for u in keep],
                       self.objective, self.batch, self.pieces, self.time_unit, self.simulated, handoff=self.handoff,
                       co_running=self.co_running)


def build_problem(graph: Graph, platform: Platform, objective: str = "latency", batch: int = 1,
                  device_latencies: Mapping[str, Mapping[str, float]] | None = None,
                  edge_bytes: Mapping[tuple[int, int], float] | None = None,
                  measure: Callable[[Device, int], list[float]] | None = None) -> Problem:
    """The costs of ``graph`` on ``platform``.

    A unit's cost on a device comes from, in order: ``device_latencies[unit][device]`` (DAG JSON latency
    objects, for the whole batch); the unit's own ``latency`` (a plain DAG JSON latency) times the device's
    ``scale``; for a model, the device's kind: ``sim:NAME`` the simulated GPU or host CPU at each piece's batch
    (the graph's shapes, FLOPs and bytes rescaled from the captured batch) times ``scale``, plus the device's
    ``op_overhead`` for each of the unit's operators, ``cpu``/``cuda:N`` ``measure(device,
    threads)`` (the units measured at the captured batch). DAG JSON and measured costs of a piece are the
    batch's cost times the piece's share (nothing is known about smaller batches there).
    """
    if objective not in OBJECTIVES:
        raise MappingError(f"unknown objective {objective!r}; choose latency or throughput")
    pieces = THROUGHPUT_PIECES if objective == "throughput" and batch % THROUGHPUT_PIECES == 0 else 1
    notes = []
    if objective == "throughput" and pieces == 1:
        notes.append(f"batch {batch} is not a multiple of {THROUGHPUT_PIECES}: the batch is not split across devices")
    for unit, given in (device_latencies or {}).items():
        unknown = next((d for d in given if d not in platform.names), None)
        if unknown is not None:  # a misspelt device, whose latency would be ignored
            raise MappingError(f"unit {unit!r} gives a latency on device {unknown!r}, which platform "
                               f"{platform.name} does not have (it has {', '.join(platform.names)})")
    n = len(graph)
    from_model = any(node.latency is None and node.name not in (device_latencies or {}) for node in graph.nodes)
    times = [[[math.inf] * pieces for _ in platform.devices] for _ in range(n)]
    for d, device in enumerate(platform.devices):
        per_piece = _device_costs(graph, device, batch, pieces, device_latencies, from_model, measure)
        for u in range(n):
            for k in range(1, pieces + 1):
                if device.accepts(batch * k // pieces):
                    times[u][d][k - 1] = per_piece[k - 1][u]
    for u in range(n):
        if all(math.isinf(t) for row in times[u] for t in row):
            raise MappingError(f"unit {graph.nodes[u].name!r} cannot run on any device: no device accepts "
                               f"its batch pieces")
    if edge_bytes is None:
        edge_bytes = {(a, b): float(graph.nodes[a].bytes_written) for a, b in graph.edges}
    activation = [float(max(0, node.bytes_read - node.param_bytes) + node.bytes_written) for node in graph.nodes]
    weights = [float(node.param_bytes) for node in graph.nodes]
    problem = Problem(graph, platform, times, dict(edge_bytes), activation, weights, objective, batch, pieces,
                      "ms" if from_model else "", figures_simulated(platform.devices, not from_model), notes)
    check_memory(problem)
    return problem


def _device_costs(graph: Graph, device: Device, batch: int, pieces: int,
                  device_latencies: Mapping[str, Mapping[str, float]] | None, from_model: bool,
                  measure: Callable[[Device, int], list[float]] | None) -> list[list[float]]:
    """Per piece count k (1..pieces), each unit's cost on ``device``."""
    n = len(graph)
    if device_latencies is not None or not from_model:
        whole = []
        for node in graph.nodes:
            given = (device_latencies or {}).get(node.name)
            if given is not None:
                if device.name not in given:
                    raise MappingError(f"unit {node.name!r} has no latency on device {device.name!r} "
                                       f"(it gives {', '.join(given) or 'none'})")
                whole.append(float(given[device.name]))
            elif node.latency is not None:
                whole.append(node.latency * device.scale)
            else:
                raise MappingError(f"unit {node.name!r} has no cost on device {device.name!r}")
        return [[t * k / pieces for t in whole] for k in range(1, pieces + 1)]
    if device.kind is None:
        raise MappingError(f"device {device.name!r} has no kind, so a model's units have no cost on it "
                           "(give it kind cpu, cuda:N or sim:NAME)")
    if is_simulated(device.kind):
        from opsched.cost.simulate import SimulatedGPU

        name = device.kind[4:]
        # the framework's cost per operator (what running a graph operator by operator pays, DiviML Section V)
        # does not shrink with the batch piece
        overheads = [device.op_overhead * max(1, len(node.ops)) for node in graph.nodes]
        out = []
        for k in range(1, pieces + 1):
            scaled = rebatched(graph, k / pieces)
            if name in CPUS:
                kernels = [CPUS[name].latency(node.flops) for node in scaled.nodes]
            else:
                sim = SimulatedGPU(scaled, name)
                kernels = [sim.op_latency(u) for u in range(n)]
            out.append([t * device.scale + o for t, o in zip(kernels, overheads)])
        return out
    if measure is None:
        raise MappingError(f"device {device.name!r} ({device.kind}) is real: its costs are measured, which needs "
                           "a model (a DAG JSON file gives latencies instead)")
    whole = measure(device, device.threads)
    return [[t * k / pieces for t in whole] for k in range(1, pieces + 1)]


def rebatched(graph: Graph, factor: float) -> Graph:
    """``graph`` with every unit's activations (shape, FLOPs, bytes read and written, output elements)
    scaled by ``factor``, its weights unchanged: the units at another batch size, for the simulator."""
    if factor == 1.0:
        return graph
    nodes = []
    for node in graph.nodes:
        shape = node.shape
        if shape:
            shape = (max(1, round(shape[0] * factor)),) + tuple(shape[1:])
        attrs = dict(node.attrs)
        if "out_elements" in attrs:
            attrs["out_elements"] = max(1, round(attrs["out_elements"] * factor))
        activations = max(0, node.bytes_read - node.param_bytes)
        nodes.append(replace(node, shape=shape, flops=node.flops * factor, attrs=attrs,
                             bytes_read=node.param_bytes + round(activations * factor),
                             bytes_written=round(node.bytes_written * factor)))
    return Graph(nodes, inputs=graph.inputs, outputs=graph.outputs, name=graph.name)


def check_memory(problem: Problem) -> None:
    """Raise when the units cannot fit in the devices' memory even spread as thinly as possible."""
    devices = problem.platform.devices
    total = sum(d.memory for d in devices)
    need = sum(min(problem.memory(u, 1), problem.memory(u)) for u in range(problem.n))
    biggest = max(d.memory for d in devices)
    for u in range(problem.n):
        if problem.memory(u, 1) > biggest:
            raise MappingError(f"unit {problem.graph.nodes[u].name!r} needs {problem.memory(u, 1):.4g} bytes, more "
                               f"than any device's memory ({biggest:.4g}): nothing fits")
    if need > total:
        raise MappingError(f"the units need {need:.4g} bytes, more than the devices' memory together ({total:.4g})")

