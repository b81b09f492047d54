"""Platforms: devices, their kinds, memory, threads and batch sizes, and the links between them.

PLATFORM.json::

    {"devices": [{"name": "gpu0", "kind": "sim:a100", "node": "n0", "memory": 40e9, "threads": 1}, ...],
     "links": {"default": {"bandwidth": 2.5e7, "latency": 0.01}, "gpu0-cpu": {...}}}

``kind`` is ``cpu``, ``cuda:N`` (real devices) or ``sim:NAME`` (a simulated GPU of ``opsched.cost.devices``, or
``sim:xeon``, see :data:`DERIVED`). Optional per device: ``memory`` (bytes; default unlimited), ``threads`` (intra-op
threads of a CPU device; default 1), ``batch_sizes`` (the batch pieces it accepts; default any), ``scale`` (its
simulated cost is the kind's times this). A device may have no ``kind`` when the DAG JSON gives every unit's
latency on it. A transfer takes ``latency + bytes / bandwidth`` on the link between two devices: the link named
``"a-b"`` (either order), else ``"default"``; two devices with neither are not connected, which is an error.
Times are in the graph's unit (ms for models), so bandwidth is bytes per that unit.

>>> p = platform_from_dict({"devices": [{"name": "a"}, {"name": "b"}], "links": {"default": {"bandwidth": 1,
...                         "latency": 0}}})
>>> p.names, p.transfer_time(0, 1, 18.0), p.transfer_time(1, 1, 18.0)
(['a', 'b'], 18.0, 0.0)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.jsonfile import read_json
from opsched.mapping import MappingError

# Simulated devices that are not GPUs of the catalogue: (catalogue GPU, factor on its simulated cost).
# The Xeon (Skylake, 2.0 GHz) of DiviML's platform runs RandWire 7.10x slower than the A100 (the paper's
# Table II: 183.39 ms against 25.84 ms), so its cost is the simulated A100's times 7.10.
DERIVED = {"xeon": ("a100", 7.10)}

# PCIe 4.0 x16: 32 GB/s a direction on paper, about 25 GB/s reached by copies; a copy costs about 10 us to
# issue and complete. In bytes per millisecond and milliseconds, the unit of models' costs.
PCIE4_X16 = {"bandwidth": 25e9 / 1e3, "latency": 0.01}

BUILTIN: dict[str, dict[str, Any]] = {
    "diviml": {
        "description": "DiviML's server node: a Xeon CPU, a T4 and an A100 on PCIe 4.0 x16 (simulated)",
        "devices": [
            {"name": "cpu", "kind": "sim:xeon", "node": "n0", "memory": 64e9},
            {"name": "t4", "kind": "sim:t4", "node": "n0", "memory": 16e9},
            {"name": "a100", "kind": "sim:a100", "node": "n0", "memory": 40e9},
        ],
        "links": {"default": PCIE4_X16},
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

    @property
    def simulated(self) -> bool:
        return self.kind is None or self.kind.startswith("sim:")

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

    def identical(self, a: int, b: int) -> bool:
        """Devices on one node with the same kind (and so the same costs), interchangeable in any mapping."""
        x, y = self.devices[a], self.devices[b]
        return (x.node, x.kind, x.memory, x.threads, x.batch_sizes, x.scale) == (
            y.node, y.kind, y.memory, y.threads, y.batch_sizes, y.scale)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "devices": [d.to_dict() for d in self.devices],
                "links": {f"{self.devices[a].name}-{self.devices[b].name}":
                          {"bandwidth": _finite(link.bandwidth), "latency": link.latency}
                          for (a, b), link in self.links.items()}}


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def load_platform(spec: str) -> Platform:
    """A built-in platform by name (``diviml``, ``cpu2``) or a PLATFORM.json file."""
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
        raise MappingError(f'{where}: "links" must be an object of links by name ("default" or "a-b")')
    default = None
    links: dict[tuple[int, int], Link] = {}
    for key, value in links_doc.items():
        link = _link(value, f"{where}: link {key!r}")
        if key == "default":
            default = link
            continue
        pair = _link_ends(key, names)
        if pair is None:
            raise MappingError(f"{where}: link {key!r} does not name two devices of the platform as \"a-b\" "
                               f"(devices: {', '.join(names)})")
        links[pair] = link
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            if (a, b) not in links:
                if default is None:
                    raise MappingError(f"{where}: the platform is disconnected: no link between {names[a]!r} and "
                                       f"{names[b]!r} (add \"{names[a]}-{names[b]}\" or a \"default\" link)")
                links[(a, b)] = default
    return Platform(name=str(doc.get("name", name)), devices=devices, links=links, source=doc)


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
        check_kind(kind, at)
    memory = _positive(item.get("memory", math.inf), at, "memory")
    threads = item.get("threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise MappingError(f"{at}: threads must be a positive integer, got {json.dumps(threads)}")
    sizes = item.get("batch_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise MappingError(f"{at}: batch_sizes must be a list of positive integers")
        sizes = tuple(sorted(set(sizes)))
    scale = _positive(item.get("scale", 1.0), at, "scale")
    return Device(name=name, kind=kind, node=str(item.get("node", "n0")), memory=memory, threads=threads,
                  batch_sizes=sizes, scale=scale)


def check_kind(kind: Any, where: str) -> None:
    """Raise unless ``kind`` is ``cpu``, ``cuda:N`` or a known ``sim:NAME``."""
    from opsched.cost.devices import DEVICES

    if not isinstance(kind, str):
        raise MappingError(f"{where}: kind must be a string")
    if kind == "cpu" or (kind.startswith("cuda:") and kind[5:].isdigit()):
        return
    if kind.startswith("sim:") and (kind[4:] in DEVICES or kind[4:] in DERIVED):
        return
    known = ["cpu", "cuda:N"] + [f"sim:{d}" for d in [*DEVICES, *DERIVED]]
    raise MappingError(f"{where}: unknown device kind {kind!r}; choose from {', '.join(known)}")


def _positive(value: Any, where: str, key: str) -> float:
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise MappingError(f"{where}: {key} must be a positive number, got {json.dumps(value)}")
    return float(value)


def _link(value: Any, where: str) -> Link:
    if not isinstance(value, dict) or "bandwidth" not in value:
        raise MappingError(f"{where}: expected {{\"bandwidth\": bytes per time unit, \"latency\": t}}")
    bandwidth = _positive(value["bandwidth"], where, "bandwidth")
    latency = value.get("latency", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise MappingError(f"{where}: latency must be a number >= 0, got {json.dumps(latency)}")
    return Link(bandwidth, float(latency))
