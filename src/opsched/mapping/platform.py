"""Platforms: devices, their kinds, memory, threads and batch sizes, and the links between them.

PLATFORM.json::

    {"devices": [{"name": "gpu0", "kind": "sim:a100", "node": "n0", "memory": 40e9, "threads": 1}, ...],
     "links": {"default": {"bandwidth": 2.5e7, "latency": 0.01}, "gpu0-cpu": {...}}}

``kind`` is ``cpu``, ``cuda:N`` (real devices) or ``sim:NAME`` (a simulated GPU of ``opsched.cost.devices``, or
``sim:xeon``, a host CPU of that catalogue). Optional per device: ``memory`` (bytes; default unlimited),
``threads`` (intra-op threads of a CPU device; default 1), ``batch_sizes`` (the batch pieces it accepts; default
any), ``scale`` (its simulated kernels cost the kind's times this), ``op_overhead`` (ms a simulated device adds,
unscaled, per operator of a model's unit: what a framework running the graph operator by operator pays, as in
DiviML's measurements; default 0; DAG JSON latencies are taken as given). A device may have no ``kind`` when the
DAG JSON gives every unit's latency on it. A transfer takes ``latency + bytes / bandwidth`` on the link between two devices: the link named
``"a-b"`` (either order), else ``"intra-node"`` for two devices on one node or ``"inter-node"`` for two on
different nodes, else ``"default"``; two devices with none of these are not connected, which is an error.
Times are in the graph's unit (ms for models), so bandwidth is bytes per that unit.

Symmetry: devices on one node with the same kind, memory, threads, batch sizes, scale, operator overhead and links
to every other device are interchangeable in any mapping, and so are whole nodes whose devices are so position by
position
(:meth:`Platform.symmetry`); the MILP uses that to break symmetry (DiviML Section VI).

>>> p = platform_from_dict({"devices": [{"name": "a"}, {"name": "b"}], "links": {"default": {"bandwidth": 1,
...                         "latency": 0}}})
>>> p.names, p.transfer_time(0, 1, 18.0), p.transfer_time(1, 1, 18.0)
(['a', 'b'], 18.0, 0.0)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.cost.devices import is_simulated, kind_problem
from opsched.jsonfile import read_json
from opsched.mapping import MappingError

# PCIe 4.0 x16: 32 GB/s a direction on paper, about 25 GB/s reached by copies; a copy costs about 10 us to
# issue and complete. In bytes per millisecond and milliseconds, the unit of models' costs.
PCIE4_X16 = {"bandwidth": 25e9 / 1e3, "latency": 0.01}

# 100 Gb/s InfiniBand (EDR) between nodes: 12.5 GB/s on paper, about 11 GB/s reached, and about 5 us a message
# plus the copies through host memory on either side (GPUDirect RDMA aside): about 20 us.
INFINIBAND_100G = {"bandwidth": 11e9 / 1e3, "latency": 0.02}

BUILTIN: dict[str, dict[str, Any]] = {
    "diviml": {
        "description": "DiviML's server node: a Xeon CPU, a T4 and an A100 on PCIe 4.0 x16, costed operator by "
                       "operator as the paper measured, fitted to its Table II (simulated)",
        # op_overhead and the Xeon's speed: benchmarks/fit_diviml.py solves them from Table II's four ratios
        "devices": [
            {"name": "cpu", "kind": "sim:xeon", "node": "n0", "memory": 64e9, "op_overhead": 0.1697},
            {"name": "t4", "kind": "sim:t4", "node": "n0", "memory": 16e9, "op_overhead": 0.02005},
            {"name": "a100", "kind": "sim:a100", "node": "n0", "memory": 40e9, "op_overhead": 0.01845},
        ],
        "links": {"default": PCIE4_X16},
    },
    "gpt3-cluster": {
        "description": "six identical nodes, each two A100s and two T4s on PCIe 4.0 x16, joined by 100 Gb/s "
                       "InfiniBand (simulated; the shape of DiviML's GPT-3 case study)",
        "devices": [{"name": f"n{n}.{kind}_{k}", "kind": f"sim:{kind}", "node": f"n{n}", "memory": memory}
                    for n in range(6) for kind, memory in (("a100", 40e9), ("t4", 16e9)) for k in range(2)],
        "links": {"intra-node": PCIE4_X16, "inter-node": INFINIBAND_100G},
    },
    "cpu2": {
        "description": "this machine's cores as two CPU devices of one thread each (measured)",
        "devices": [{"name": "cpu0", "kind": "cpu", "threads": 1}, {"name": "cpu1", "kind": "cpu", "threads": 1}],
        "links": {"default": {"bandwidth": math.inf, "latency": 0.0}},
    },
}


@dataclass(frozen=True)
class Device:
    name: str
    kind: str | None = None
    node: str = "n0"
    memory: float = math.inf
    threads: int = 1
    batch_sizes: tuple[int, ...] | None = None
    scale: float = 1.0
    op_overhead: float = 0.0

    @property
    def simulated(self) -> bool:
        return self.kind is None or is_simulated(self.kind)

    def accepts(self, batch: int) -> bool:
        return self.batch_sizes is None or batch in self.batch_sizes

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "node": self.node, "threads": self.threads}
        if self.kind is not None:
            doc["kind"] = self.kind
        if math.isfinite(self.memory):
            doc["memory"] = self.memory
        if self.batch_sizes is not None:
            doc["batch_sizes"] = list(self.batch_sizes)
        if self.scale != 1.0:
            doc["scale"] = self.scale
        if self.op_overhead:
            doc["op_overhead"] = self.op_overhead
        return doc


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float

    def time(self, nbytes: float) -> float:
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


@dataclass
class Platform:
    name: str
    devices: list[Device]
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def __len__(self) -> int:
        return len(self.devices)

    def index(self, name: str) -> int:
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        raise MappingError(f"platform {self.name} has no device {name!r}; it has {', '.join(self.names)}")

    def transfer_time(self, a: int, b: int, nbytes: float) -> float:
        """Time to move ``nbytes`` from device ``a`` to device ``b`` (0 on one device)."""
        return 0.0 if a == b else self.links[(min(a, b), max(a, b))].time(nbytes)

    def identical(self, a: int, b: int, alike: Callable[[int, int], bool] | None = None) -> bool:
        """Devices on one node with the same kind, memory, threads, batch sizes, scale and links to every
        other device, and costs ``alike`` (a DAG JSON file may give devices of one kind different latencies):
        swapping them changes no mapping's times, so they are interchangeable."""
        x, y = self.devices[a], self.devices[b]
        if a == b or x.node != y.node or _signature(x) != _signature(y) or (alike and not alike(a, b)):
            return False
        return all(self.links[_pair(a, c)] == self.links[_pair(b, c)] for c in range(len(self)) if c not in (a, b))

    def symmetry(self, fixed: Sequence[int] = (), alike: Callable[[int, int], bool] | None = None) -> Symmetry:
        """The interchangeable devices and nodes, leaving out the devices in ``fixed`` (those holding units
        pinned there, which a permutation would move) and the nodes that hold them; ``alike(a, b)``: whether
        devices a and b cost every unit the same (default: devices of one kind do).

        >>> p = load_platform("gpt3-cluster")
        >>> s = p.symmetry()
        >>> len(s.device_orbits), [len(o) for o in s.node_orbits], s.factor
        (12, [6], 2949120)
        """
        fixed_set = set(fixed)
        devices: list[list[int]] = []
        for a in range(len(self)):
            if a in fixed_set or any(a in orbit for orbit in devices):
                continue
            orbit = [a] + [b for b in range(a + 1, len(self)) if b not in fixed_set and self.identical(a, b, alike)]
            if len(orbit) > 1:
                devices.append(orbit)
        nodes: dict[str, list[int]] = {}
        for d, device in enumerate(self.devices):
            nodes.setdefault(device.node, []).append(d)
        free = [members for members in nodes.values() if not fixed_set & set(members)]
        node_orbits: list[list[list[int]]] = []
        for members in free:
            for orbit in node_orbits:
                if self._nodes_interchangeable(orbit[0], members, alike):
                    orbit.append(members)
                    break
            else:
                node_orbits.append([members])
        return Symmetry(devices, [orbit for orbit in node_orbits if len(orbit) > 1])

    def _nodes_interchangeable(self, first: list[int], second: list[int],
                               alike: Callable[[int, int], bool] | None) -> bool:
        """Two nodes whose devices match position by position, with the same links inside each node and
        one link to every device outside both: swapping them (device r of one for device r of the other)
        changes no mapping's times."""
        if len(first) != len(second) or any(_signature(self.devices[a]) != _signature(self.devices[b]) or
                                            (alike and not alike(a, b)) for a, b in zip(first, second, strict=True)):
            return False
        for r, (a, b) in enumerate(zip(first, second, strict=True)):
            for s in range(r + 1, len(first)):
                if self.links[_pair(a, first[s])] != self.links[_pair(b, second[s])]:
                    return False
            outside = [c for c in range(len(self)) if c not in first and c not in second]
            if any(self.links[_pair(a, c)] != self.links[_pair(b, c)] for c in outside):
                return False
            if any(self.links[_pair(a, c)] != self.links[_pair(b, d)] for c, d in zip(second, first, strict=True)):
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "devices": [d.to_dict() for d in self.devices],
                "links": {f"{self.devices[a].name}-{self.devices[b].name}":
                          {"bandwidth": _finite(link.bandwidth), "latency": link.latency}
                          for (a, b), link in self.links.items()}}


def figures_simulated(devices: Iterable[Any], given_latencies: bool) -> bool:
    """Whether a mapping's figures are simulated rather than predicted from costs measured here: the one rule
    behind every label of a mapping (``opsched map``'s text and its JSON ``simulated``, the plan's ``cost`` and
    ``device``, what ``opsched show``, its trace and the mapping's Gantt chart say).

    ``devices``: the platform's (:class:`Device`) or a plan's (:class:`~opsched.schedule.PlanDevice`), each
    simulated when its kind is ``sim:NAME`` or it has none (a DAG JSON file's device, which only its latencies
    cost). The search weighs every device's costs against the others', and a figure with one simulated cost in
    it is no measurement: so one simulated device makes every figure simulated, even beside real devices whose
    units were measured, and even when the mapping leaves it idle.

    ``given_latencies``: the costs are a DAG JSON graph's own latencies, not a model's. Nothing here measured
    them: the figures replay numbers the file gives, so they are simulated whatever the devices' kinds (a
    ``cpu`` device included). Figures are measured only when every unit's cost was measured on this machine's
    real devices (``cpu``, ``cuda:N``).

    >>> p = platform_from_dict({"devices": [{"name": "c", "kind": "cpu"}, {"name": "g", "kind": "sim:a100"}],
    ...                         "links": {"default": {"bandwidth": 1}}})
    >>> real = p.devices[:1]
    >>> figures_simulated(p.devices, False), figures_simulated(real, False), figures_simulated(real, True)
    (True, False, True)
    """
    return given_latencies or any(device.simulated for device in devices)


@dataclass(frozen=True)
class Symmetry:
    """``device_orbits``: groups of interchangeable devices on one node; ``node_orbits``: groups of
    interchangeable nodes, each node its devices in platform order (position r of one node corresponds to
    position r of the others). ``factor``: how many equivalent mappings each one kept stands for at most,
    the size of the permutation group (DiviML's 4^6 6! for six nodes of two pairs of devices)."""

    device_orbits: list[list[int]]
    node_orbits: list[list[list[int]]]

    @property
    def factor(self) -> int:
        return math.prod(math.factorial(len(o)) for o in self.device_orbits + self.node_orbits)


def _signature(d: Device) -> tuple:
    return (d.kind, d.memory, d.threads, d.batch_sizes, d.scale, d.op_overhead)


def _pair(a: int, b: int) -> tuple[int, int]:
    return (min(a, b), max(a, b))


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def load_platform(spec: str) -> Platform:
    """A built-in platform by name (``diviml``, ``gpt3-cluster``, ``cpu2``) or a PLATFORM.json file."""
    if spec in BUILTIN:
        return platform_from_dict(BUILTIN[spec], spec)
    if not spec.endswith(".json"):
        raise MappingError(f"unknown platform {spec!r}: give a built-in ({', '.join(BUILTIN)}) or a PLATFORM.json file")
    doc = read_json(spec, MappingError)
    return platform_from_dict(doc, Path(spec).stem, source=spec)


def platform_from_dict(doc: Any, name: str = "platform", source: str | None = None) -> Platform:
    """Validate a platform's JSON form; every problem is one line naming the place."""
    where = source or name
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list) or not doc["devices"]:
        raise MappingError(f'{where}: expected an object with a non-empty "devices" list')
    devices = [_device(item, k, where) for k, item in enumerate(doc["devices"])]
    names = [d.name for d in devices]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise MappingError(f"{where}: duplicate device name {dup!r}")
    links_doc = doc.get("links", {})
    if not isinstance(links_doc, dict):
        raise MappingError(f'{where}: "links" must be an object of links by name ("default", "intra-node", '
                           '"inter-node" or "a-b")')
    defaults: dict[str, Link] = {}
    links: dict[tuple[int, int], Link] = {}
    for key, value in links_doc.items():
        link = _link(value, f"{where}: link {key!r}")
        if key in LINK_CLASSES:
            defaults[key] = link
            continue
        pair = _link_ends(key, names)
        if pair is None:
            raise MappingError(f"{where}: link {key!r} does not name two devices of the platform as \"a-b\" "
                               f"(devices: {', '.join(names)})")
        links[pair] = link
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            if (a, b) not in links:
                within = "intra-node" if devices[a].node == devices[b].node else "inter-node"
                link = defaults.get(within, defaults.get("default"))
                if link is None:
                    raise MappingError(f"{where}: the platform is disconnected: no link between {names[a]!r} and "
                                       f"{names[b]!r} (add \"{names[a]}-{names[b]}\", \"{within}\" or a "
                                       "\"default\" link)")
                links[(a, b)] = link
    return Platform(name=str(doc.get("name", name)), devices=devices, links=links, source=doc)


# Links that apply to every pair of devices without a link of its own: on one node, across nodes, any.
LINK_CLASSES = ("intra-node", "inter-node", "default")


def _link_ends(key: str, names: list[str]) -> tuple[int, int] | None:
    for i, a in enumerate(names):
        if key.startswith(a + "-") and key[len(a) + 1:] in names:
            j = names.index(key[len(a) + 1:])
            if i != j:
                return (min(i, j), max(i, j))
    return None


def _device(item: Any, k: int, where: str) -> Device:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise MappingError(f"{where}: device {k} needs a name")
    name = item["name"]
    at = f"{where}: device {name!r}"
    kind = item.get("kind")
    if kind is not None:
        why = kind_problem(kind)
        if why:
            raise MappingError(f"{at}: {why}")
    memory = _positive(item.get("memory", math.inf), at, "memory")
    threads = item.get("threads", 1)
    cores = os.cpu_count() or 1
    # a CPU device's costs are measured here, at its thread count: PyTorch's thread pool starts them all (a
    # million aborted the process)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1 or (kind == "cpu" and threads > cores):
        raise MappingError(f"{at}: threads must be a positive integer, for a cpu device at most this machine's "
                           f"{cores} cores, got {json.dumps(threads)}")
    sizes = item.get("batch_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise MappingError(f"{at}: batch_sizes must be a list of positive integers")
        sizes = tuple(sorted(set(sizes)))
    scale = _float(item.get("scale", 1.0))
    if scale is None or not 0 < scale < math.inf:
        raise MappingError(f"{at}: scale must be a finite positive number, got {json.dumps(item['scale'])}")
    overhead = _float(item.get("op_overhead", 0.0))
    if overhead is None or not 0 <= overhead < math.inf:
        raise MappingError(f"{at}: op_overhead must be a finite number of ms, 0 or more, got "
                           f"{json.dumps(item['op_overhead'])}")
    if overhead and not is_simulated(kind):
        raise MappingError(f"{at}: op_overhead applies to simulated devices (sim:NAME); a real device's measured "
                           "costs already include what it pays per operator")
    return Device(name=name, kind=kind, node=str(item.get("node", "n0")), memory=memory, threads=threads,
                  batch_sizes=sizes, scale=scale, op_overhead=overhead)


def _float(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number a float holds (an integer too large for one is None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _positive(value: Any, where: str, key: str) -> float:
    if value == "inf":
        return math.inf
    number = _float(value)
    if number is None or not number > 0:
        raise MappingError(f"{where}: {key} must be a positive number, got {json.dumps(value)}")
    return number


def _link(value: Any, where: str) -> Link:
    if not isinstance(value, dict) or "bandwidth" not in value:
        raise MappingError(f"{where}: expected {{\"bandwidth\": bytes per time unit, \"latency\": t}}")
    bandwidth = _positive(value["bandwidth"], where, "bandwidth")
    latency = _float(value.get("latency", 0.0))
    if latency is None or not 0 <= latency < math.inf:
        raise MappingError(f"{where}: latency must be a finite number >= 0, got {json.dumps(value['latency'])}")
    return Link(bandwidth, latency)
