"""DAG JSON for mapping: the project's DAG JSON (``opsched.graph.dagjson``) with two extensions.

- a node's ``"latency"`` may be an object ``{device: latency}``, its cost on each device of the platform;
- an edge may carry a third element, the bytes it moves: ``["v1", "v2", 18]``.

Optional per node: ``"bytes"``, the memory the unit holds on its device. Every problem is one line.

>>> g, lat, nbytes = loads('{"nodes": [{"name": "a", "latency": {"x": 1, "y": 2}}, {"name": "b", "latency": 3}],'
...                        ' "edges": [["a", "b", 18]]}')
>>> [n.name for n in g.nodes], lat, nbytes
(['a', 'b'], {'a': {'x': 1.0, 'y': 2.0}}, {(0, 1): 18.0})
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from opsched.errors import DagJsonError
from opsched.graph import dagjson
from opsched.graph.ir import Graph
from opsched.jsonfile import parse_json, read_text


def read(path: str | Path) -> tuple[Graph, dict[str, dict[str, float]], dict[tuple[int, int], float]]:
    path = Path(path)
    return loads(read_text(path, DagJsonError), source=str(path), name=path.stem)


def loads(text: str, source: str = "<string>", name: str = "dag"
          ) -> tuple[Graph, dict[str, dict[str, float]], dict[tuple[int, int], float]]:
    """The graph, the per-device latencies of the nodes that give them, and the bytes of the edges."""
    doc = parse_json(text, source, DagJsonError)
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise DagJsonError(f'{source}: expected an object with a "nodes" list and an "edges" list')
    per_device: dict[str, dict[str, float]] = {}
    plain = {**doc, "nodes": [], "edges": []}
    for k, item in enumerate(doc["nodes"]):
        if isinstance(item, dict) and isinstance(item.get("latency"), dict):
            where = f"{source}: node {item.get('name', k)!r}"
            if not item["latency"]:
                raise DagJsonError(f"{where}: latency object names no device")
            per_device[str(item.get("name"))] = {str(d): _number(v, where, f"latency on {d!r}")
                                                 for d, v in item["latency"].items()}
            item = {**item, "latency": 0.0}
        plain["nodes"].append(item)
    edge_bytes: dict[tuple[str, str], float] = {}
    edges = doc.get("edges", [])
    if not isinstance(edges, list):
        raise DagJsonError(f'{source}: "edges" must be a list of [from, to] or [from, to, bytes]')
    for k, edge in enumerate(edges):
        if isinstance(edge, list) and len(edge) == 3:
            edge_bytes[(str(edge[0]), str(edge[1]))] = _number(edge[2], f"{source}: edge {k}", "bytes")
            edge = edge[:2]
        plain["edges"].append(edge)
    graph = dagjson.loads(json.dumps(plain), source, name)
    for node in graph.nodes:
        if node.name in per_device:
            node.latency = None
    nbytes = {(graph.index[a], graph.index[b]): v for (a, b), v in edge_bytes.items()}
    for k, item in enumerate(doc["nodes"]):
        if isinstance(item, dict) and "bytes" in item:
            graph.nodes[graph.index[item["name"]]].param_bytes = int(item["bytes"])
    return graph, per_device, nbytes


def _number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DagJsonError(f"{where}: {key} must be a finite number >= 0, got {json.dumps(value)}")
    return float(value)
