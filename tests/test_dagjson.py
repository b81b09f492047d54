import json
import subprocess
import sys

import pytest

from opsched.errors import DagJsonError
from opsched.graph import dagjson
from opsched.models.synthetic import random_layered_dag

GOOD = {"nodes": [{"name": "a", "latency": 1}, {"name": "b", "latency": 2.5, "kind": "conv", "flops": 10},
                  {"name": "c", "latency": 0}], "edges": [["a", "b"], ["a", "c"]]}


def test_reads_nodes_edges_and_optional_fields():
    g = dagjson.loads(json.dumps(GOOD))
    assert [n.name for n in g.nodes] == ["a", "b", "c"]
    assert g.nodes[1].kind == "conv" and g.nodes[1].flops == 10 and g.nodes[1].latency == 2.5
    assert g.nodes[2].args == ("a",)


def test_round_trip(tmp_path):
    g = random_layered_dag(20, 5, 0.4, seed=3)
    path = tmp_path / "g.json"
    dagjson.write(g, path)
    back = dagjson.read(path)
    assert [(n.name, n.args, n.latency) for n in back.nodes] == [(n.name, n.args, n.latency) for n in g.nodes]
    assert back.fingerprint == dagjson.read(path).fingerprint


BAD = [
    ('{"nodes": [{"name": "a", "latency": 1}', r"malformed JSON at line 1, column \d+"),
    ('{"nodes": [\n  {"name": "a" "latency": 1}]}', r"malformed JSON at line 2, column 16: Expecting .,. delimiter"),
    ('[1, 2]', r'expected an object with a "nodes" list'),
    ('{"nodes": [], "edges": []}', r"the graph has no nodes"),
    ('{"nodes": [{"name": "a", "latency": 1}, {"name": "a", "latency": 2}]}', r"duplicate node name 'a'"),
    ('{"nodes": [{"name": "a"}]}', r"node 'a': missing latency"),
    ('{"nodes": [{"name": "a", "latency": -1}]}', r"node 'a': latency must not be negative"),
    ('{"nodes": [{"name": "a", "latency": "fast"}]}', r"node 'a': latency must be a finite number"),
    ('{"nodes": [{"name": "a", "latency": true}]}', r"latency must be a finite number"),
    ('{"nodes": [{"latency": 1}]}', r"node 0: missing or empty name"),
    ('{"nodes": [{"name": "a", "latency": 1, "flops": -3}]}', r"flops must not be negative"),
    ('{"nodes": [{"name": "a", "latency": 1}], "edges": [["a", "ghost"]]}', r"unknown node 'ghost'"),
    ('{"nodes": [{"name": "a", "latency": 1}], "edges": [["a"]]}', r"edge 0 must be a pair"),
    (('{"nodes": [{"name": "a", "latency": 1}, {"name": "b", "latency": 1}, {"name": "c", "latency": 1}],'
      ' "edges": [["a", "b"], ["b", "c"], ["c", "b"]]}'), r"cycle: (b -> c -> b|c -> b -> c)"),
    ('{"nodes": [{"name": "a", "latency": 1}], "edges": [["a", "a"]]}', r"cycle: a -> a"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_input_raises_one_clear_error(text, message):
    with pytest.raises(DagJsonError, match=message) as info:
        dagjson.loads(text, source="g.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("g.json: ")


@pytest.mark.parametrize("text,message", BAD[:1] + BAD[4:5] + BAD[10:11] + BAD[12:13])
def test_cli_reports_bad_dag_json_in_one_line_with_status_2(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "opsched", "graph", str(path)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opsched: error: ") and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DagJsonError, match="cannot read"):
        dagjson.read(tmp_path / "none.json")


def test_writing_needs_latencies():
    from opsched.graph.ir import Graph, Node

    g = Graph([Node("a")])
    with pytest.raises(DagJsonError, match="no latency"):
        dagjson.dumps(g)
    assert json.loads(dagjson.dumps(g, {"a": 2.0}))["nodes"] == [{"name": "a", "latency": 2.0}]
