"""DAG JSON: research graphs and graphs from other frameworks, as units with latencies.

    {"nodes": [{"name": "v1", "latency": 3.0}, ...], "edges": [["v1", "v2"], ...]}

Optional per node: "kind", "flops", "bytes". Latencies may be in any one unit; schedules use the same.
Every problem is reported as a :class:`~opsched.errors.DagJsonError` with one line that says what and where.

>>> g = loads('{"nodes": [{"name": "a", "latency": 1}, {"name": "b", "latency": 2}], "edges": [["a", "b"]]}')
>>> [(n.name, n.args, n.latency) for n in g.nodes]
[('a', (), 1.0), ('b', ('a',), 2.0)]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import networkx as nx

from opsched.errors import DagJsonError
from opsched.graph.ir import Graph, Node
from opsched.jsonfile import parse_json, read_text


def read(path: str | Path) -> Graph:
    """Read and validate a DAG JSON file."""
    path = Path(path)
    return loads(read_text(path, DagJsonError), source=str(path), name=path.stem)


def loads(text: str, source: str = "<string>", name: str = "dag") -> Graph:
    """Parse and validate DAG JSON text."""
    doc = parse_json(text, source, DagJsonError)
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise DagJsonError(f'{source}: expected an object with a "nodes" list and an "edges" list')
    if not doc["nodes"]:
        raise DagJsonError(f"{source}: the graph has no nodes")
    edges = doc.get("edges", [])
    if not isinstance(edges, list):
        raise DagJsonError(f'{source}: "edges" must be a list of [from, to] pairs')
    nodes: dict[str, dict[str, Any]] = {}
    for k, item in enumerate(doc["nodes"]):
        where = f"{source}: node {k}"
        if not isinstance(item, dict):
            raise DagJsonError(f"{where}: expected an object with a name and a latency")
        nm = item.get("name")
        if not isinstance(nm, str) or not nm:
            raise DagJsonError(f"{where}: missing or empty name")
        where = f"{source}: node {nm!r}"
        if nm in nodes:
            raise DagJsonError(f"{source}: duplicate node name {nm!r}")
        if "latency" not in item:
            raise DagJsonError(f"{where}: missing latency")
        latency = _number(item["latency"], where, "latency")
        for key in ("flops", "bytes"):
            if key in item:
                _number(item[key], where, key)
        if "kind" in item and not isinstance(item["kind"], str):
            raise DagJsonError(f"{where}: kind must be a string")
        nodes[nm] = {**item, "latency": latency}
    args: dict[str, list[str]] = {nm: [] for nm in nodes}
    for k, edge in enumerate(edges):
        if (not isinstance(edge, list) or len(edge) != 2 or not all(isinstance(e, str) for e in edge)):
            raise DagJsonError(f"{source}: edge {k} must be a pair of node names, got {json.dumps(edge)}")
        for end in edge:
            if end not in nodes:
                raise DagJsonError(f"{source}: edge {k} {json.dumps(edge)} names unknown node {end!r}")
        if edge[0] not in args[edge[1]]:
            args[edge[1]].append(edge[0])
    g = nx.DiGraph((e[0], e[1]) for e in edges)
    try:
        cycle = [u for u, _ in nx.find_cycle(g)]
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        raise DagJsonError(f"{source}: the graph has a cycle: {' -> '.join(cycle + cycle[:1])}")
    units = [Node(nm, kind=item.get("kind", "op"), args=tuple(args[nm]), latency=item["latency"],
                  flops=float(item.get("flops", 0.0)), bytes_read=int(item.get("bytes", 0)))
             for nm, item in nodes.items()]
    return Graph(units, name=name)


def _number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DagJsonError(f"{where}: {key} must be a finite number, got {json.dumps(value)}")
    if value < 0:
        raise DagJsonError(f"{where}: {key} must not be negative, got {value}")
    return float(value)


def dumps(graph: Graph, latencies: Mapping[str, float] | None = None) -> str:
    """DAG JSON for ``graph``; latencies from ``latencies`` where given, else from the units."""
    out_nodes = []
    for node in graph.nodes:
        latency = latencies[node.name] if latencies and node.name in latencies else node.latency
        if latency is None:
            raise DagJsonError(f"unit {node.name!r} has no latency to write")
        item: dict[str, Any] = {"name": node.name, "latency": latency}
        if node.kind != "op":
            item["kind"] = node.kind
        if node.flops:
            item["flops"] = node.flops
        if node.bytes_read or node.bytes_written:
            item["bytes"] = node.bytes_read + node.bytes_written
        out_nodes.append(item)
    edges = [[graph.nodes[a].name, graph.nodes[b].name] for a, b in graph.edges]
    return json.dumps({"nodes": out_nodes, "edges": edges}, indent=1)


def write(graph: Graph, path: str | Path, latencies: Mapping[str, float] | None = None) -> None:
    Path(path).write_text(dumps(graph, latencies) + "\n")
