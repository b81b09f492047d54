"""The Ray engine (``opsched run --engine ray``): GoogLeNet mapped onto two 1-thread CPU devices on two nodes
runs as two Ray actors, verified against eager; a Ray that is not installed, an address that does not answer,
a plan naming a node the cluster lacks and an actor killed mid-run each fail in one line, without hanging.
One local Ray serves the tests that run in this process."""

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import local_ray
from support import ray_trials

from opsched.cli import main

MODEL = "torchvision:googlenet"
SIZE = "64"
PLATFORM = {"devices": [{"name": "cpu0", "kind": "cpu", "node": "n0", "threads": 1},
                        {"name": "cpu1", "kind": "cpu", "node": "n1", "threads": 1}],
            "links": {"default": {"bandwidth": "inf", "latency": 0}}}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """GoogLeNet (random weights, 64x64) mapped by HEFT onto cpu0 on node n0 and cpu1 on node n1."""
    pytest.importorskip("torchvision")
    where = tmp_path_factory.mktemp("ray")
    (where / "platform.json").write_text(json.dumps(PLATFORM))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPSCHED_CACHE_DIR", str(where / "cache"))  # never the user's cache
        assert main(["map", MODEL, "--image-size", SIZE, "--platform", str(where / "platform.json"),
                     "--method", "heft", "--out", str(where / "plan.json")]) == 0
    return where / "plan.json"


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray declaring nodes n0 and n1, connected in this process for the module's tests."""
    with local_ray(["n0", "n1"], cpus=8) as where:
        yield where


@pytest.fixture(scope="module")
def googlenet(plan_file):
    """The model, its input, its captured graph and the mapped plan, as opsched run loads them."""
    import argparse

    from opsched import schedule
    from opsched.commands.common import load_and_capture

    args = argparse.Namespace(batch=None, input_shape=None, image_size=int(SIZE))
    loaded, graph, _, _ = load_and_capture(args, MODEL, "cpu")
    return loaded.model, loaded.inputs[0], graph, schedule.load(plan_file, graph)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _opsched(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opsched", *argv], check=False, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module", params=[True, False], ids=["compiled-graph", "remote-calls"])
def on_ray(request, ray_session, googlenet):
    """The plan on two actors, its calls made as a Compiled Graph or as remote calls; the tests below use it in
    turn, the last one killing an actor."""
    from opsched.runtime.ray import RayModule

    _, _, graph, plan = googlenet
    with RayModule(graph, plan, compiled=request.param, run_seconds=20) as module:
        yield module


def test_googlenet_on_two_ray_actors_equals_eager(on_ray, googlenet, request):
    model, x, _, _ = googlenet
    assert on_ray.compiled is (request.node.callspec.id == "compiled-graph")
    assert [(d.name, d.node) for d in on_ray.devices] == [("cpu0", "n0"), ("cpu1", "n1")]
    with torch.inference_mode():
        want = model(x)
        for _ in range(2):  # the second call reuses the actors' state and the graph's channels
            assert torch.allclose(on_ray(x), want, atol=1e-4)


def test_a_gpt_decode_step_mapped_onto_two_ray_nodes_equals_eager(ray_session, tmp_path):
    """The small decoder of issue 12 (its attention and MLP slices are branches) on two actors on two nodes."""
    import argparse

    from opsched import schedule
    from opsched.commands.common import load_and_capture
    from opsched.runtime.ray import RayModule

    (tmp_path / "platform.json").write_text(json.dumps(PLATFORM))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPSCHED_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["map", "gpt-small-decode", "--platform", str(tmp_path / "platform.json"), "--method", "heft",
                     "--out", str(tmp_path / "plan.json")]) == 0
    loaded, graph, _, _ = load_and_capture(argparse.Namespace(batch=None, input_shape=None, image_size=None),
                                           "gpt-small-decode", "cpu")
    plan = schedule.load(tmp_path / "plan.json", graph)
    with RayModule(graph, plan, run_seconds=20) as module, torch.inference_mode():
        assert len(module.devices) == 2
        assert torch.allclose(module(*loaded.inputs), loaded.model(*loaded.inputs), atol=1e-4)


def test_an_actor_killed_mid_run_fails_the_run_in_one_line_naming_the_device(on_ray, googlenet):
    import ray

    from opsched.runtime.ray import DeviceFailed

    x = googlenet[1]
    victim = on_ray.actors[[d.name for d in on_ray.devices].index("cpu1")]
    killer = threading.Timer(0.005, ray.kill, [victim])
    started = time.perf_counter()
    killer.start()
    with pytest.raises(DeviceFailed) as failed:
        for _ in range(1000):  # some call is under way when the kill lands
            on_ray(x)
    killer.join()
    assert failed.value.device == "cpu1" and "died" in _one_line(str(failed.value))
    assert time.perf_counter() - started < 20
    with pytest.raises(DeviceFailed, match="cpu1"):  # the module is closed, not left half working
        on_ray(x)


def test_a_plan_naming_a_node_the_cluster_lacks_is_refused_in_one_line(ray_session, plan_file, tmp_path, capsys):
    doc = json.loads(plan_file.read_text())
    doc["devices"]["platform"]["devices"][1]["node"] = "n2"
    elsewhere = tmp_path / "n2.json"
    elsewhere.write_text(json.dumps(doc))
    started = time.perf_counter()
    assert main(["run", MODEL, "--image-size", SIZE, "--plan", str(elsewhere), "--engine", "ray"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "n2" in line and "opsched_node:n2" in line and "n0" not in line
    assert time.perf_counter() - started < 10  # refused before the model is loaded


def test_the_cli_starts_a_local_ray_for_the_run_verifies_and_reports_the_engine(plan_file):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'opsched[ray]')")
    done = _opsched("run", MODEL, "--image-size", SIZE, "--plan", str(plan_file), "--engine", "ray",
                    "--repeats", "2", "--json", timeout=240)
    if done.returncode and "could not start a local Ray" in done.stderr:
        pytest.skip(f"a local Ray cannot start here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["engine"] == "ray" and result["max_abs_error"] <= 1e-3
    assert set(result["measured_ms"]) == {"heft", "eager"}
    assert min(result["devices"].values()) > 0  # both devices run units
    assert result["ray"]["cluster"] == "a local Ray started for the run"
    assert result["ray"]["actors"] == {"cpu0": "n0", "cpu1": "n1"} and result["ray"]["actor_per"] == "device"


def test_an_address_that_does_not_answer_fails_at_once_in_one_line(plan_file):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'opsched[ray]')")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _opsched("run", MODEL, "--image-size", SIZE, "--plan", str(plan_file), "--address", f"127.0.0.1:{port}",
                    timeout=60)
    assert done.returncode == 2
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}" in _one_line(done.stderr)


def test_without_ray_the_engine_says_how_to_install_it(plan_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when it is not installed
    assert main(["run", MODEL, "--image-size", SIZE, "--plan", str(plan_file), "--engine", "ray"]) == 2
    assert "pip install 'opsched[ray]'" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flags, says", [(["--engine", "local", "--address", "127.0.0.1:6379"], "--engine ray"),
                                         (["--engine", "ray", "--trace", "t.json"], "--trace")])
def test_flags_the_ray_engine_cannot_take_are_refused_in_one_line(plan_file, capsys, flags, says):
    assert main(["run", MODEL, "--image-size", SIZE, "--plan", str(plan_file), *flags]) == 2
    assert says in _one_line(capsys.readouterr().err)


def test_engine_ray_runs_only_mapped_plans(plan_file, tmp_path, capsys):
    doc = json.loads(plan_file.read_text())
    del doc["devices"]  # the same streams, as a plain stream schedule
    plain = tmp_path / "streams.json"
    plain.write_text(json.dumps(doc))
    assert main(["run", MODEL, "--image-size", SIZE, "--plan", str(plain), "--engine", "ray"]) == 2
    assert "mapped plan" in _one_line(capsys.readouterr().err)


def test_segments_are_cut_from_the_lowered_program():
    # needs no Ray: a device's run steps cut where a value arrives from another device and where one leaves
    from opsched.cost.table import TableCost
    from opsched.graph.ir import Graph, Node
    from opsched.runtime.lowered import lower
    from opsched.runtime.program import compile_program
    from opsched.runtime.ray import Segment, cut_segments
    from opsched.schedule import from_streams

    g = Graph([Node("a", args=("x",), latency=1.0), Node("b", args=("x",), latency=1.0),
               Node("c", args=("a", "b"), latency=1.0)], inputs=["x"])
    program = compile_program(from_streams(g, TableCost(g), "t", [[0, 2], [1]]), g)
    segments = cut_segments(lower(program, lambda nodes, threads: None))
    # slots: x 0, a 1, b 2, c 3; b crosses from device 1 to device 0, c returns to the caller
    assert segments == [Segment(0, 0, (0,), (0,), ()), Segment(1, 0, (0,), (0,), (2,)),
                        Segment(0, 1, (1,), (2,), (3,))]
    assert cut_segments(program) == segments  # the benchmark cuts the program itself


@pytest.fixture(scope="module")
def one_node_plan(plan_file, googlenet):
    """The GoogLeNet plan with both devices on node n0."""
    from opsched import schedule

    doc = json.loads(plan_file.read_text())
    doc["devices"]["platform"]["devices"][1]["node"] = "n0"
    path = plan_file.with_name("one-node.json")
    path.write_text(json.dumps(doc))
    return schedule.load(path, googlenet[2])


@pytest.mark.parametrize("compiled", [None, True], ids=["default", "compiled-graph"])
def test_a_plan_on_one_node_runs_as_one_actor_with_one_call_per_inference(ray_session, googlenet, one_node_plan,
                                                                          compiled):
    from opsched.runtime.ray import RayModule, Segment

    model, x, graph, _ = googlenet
    with RayModule(graph, one_node_plan, compiled=compiled, run_seconds=20) as module, torch.inference_mode():
        assert module.per_node and len(module.actors) == 1 and module.compiled is bool(compiled)
        assert module.segments == [Segment(0, 0, (), (0,), tuple(module._returned))]
        assert [(d.name, d.node) for d in module.devices] == [("cpu0", "n0"), ("cpu1", "n0")]
        want = model(x)
        for _ in range(2):
            assert torch.allclose(module(x), want, atol=1e-4)


def test_on_the_nodes_actor_a_failing_unit_names_its_device_and_a_killed_actor_its_node(ray_session, googlenet,
                                                                                        one_node_plan):
    import ray

    from opsched.runtime.ray import DeviceFailed, RayModule

    model, x, graph, _ = googlenet
    unit = next(op.name for op in one_node_plan.ops if op.stream == 1)
    result = ray_trials.ray_fault_trial(model, graph, (x,), one_node_plan, unit, compiled=False, on_call=2)
    assert result["device"] == "cpu1" and result["right_before"] == 1 and result["named"], result
    assert result["later_call"] == "DeviceFailed" and result["actors_left"] == 0 and result["new_module_right"], result
    with RayModule(graph, one_node_plan, run_seconds=20) as module:
        module(x)
        ray.kill(module.actors[0])
        with pytest.raises(DeviceFailed) as failed:
            module(x)
    assert _one_line(str(failed.value)) == ("the run on Ray failed: the actor of node 'n0' (devices cpu0, cpu1) "
                                            "died: its Ray actor was killed")


def test_one_actor_for_every_device_needs_them_on_one_node(ray_session, googlenet):
    from opsched.runtime.ray import ClusterError, RayModule

    _, _, graph, plan = googlenet
    with pytest.raises(ClusterError, match="all on one node .*n0, n1"):
        RayModule(graph, plan, actors="node")
