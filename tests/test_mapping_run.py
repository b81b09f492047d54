"""A mapped plan on real devices runs for real: two CPU devices of one thread each, as worker threads of
the CPU backend, verified against eager PyTorch."""


import pytest
import torch
from torch import nn

from opsched.graph.capture import capture
from opsched.mapping.execute import check_runnable
from opsched.mapping.plan import to_schedule
from opsched.mapping.platform import load_platform
from opsched.mapping.problem import build_problem
from opsched.mapping.solve import solve
from opsched.runtime.module import OptimizedModule


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, k, padding=k // 2), nn.ReLU()) for k in (1, 3, 5))
        self.head = nn.Conv2d(24, 4, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.head(torch.cat([b(x) for b in self.branches], 1))


def _mapped(model, inputs, method):
    from opsched.runtime.profile import measured_cost

    graph = capture(model, inputs)

    def measure(device, threads):
        cost = measured_cost(graph, inputs, cores=threads, repeats=3)
        return [cost.latency[threads][u] for u in range(len(graph))]

    problem = build_problem(graph, load_platform("cpu2"), measure=measure)
    solved = solve(problem, method, time_limit=2)
    plan = to_schedule(problem, solved.mapping, solved.timeline, method, solved.lower_bound, solved.optimal, {})
    return graph, plan


@pytest.mark.parametrize("method", ["heft", "milp"])
def test_mapped_branchy_cnn_runs_on_two_cpu_devices_and_verifies(method):
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(1, 3, 16, 16)
    graph, plan = _mapped(model, (x,), method)
    assert [d.threads for d in plan.devices.devices] == [1, 1]
    devices = check_runnable(plan)
    assert sum(devices.values()) == len(graph)
    module = OptimizedModule(graph, plan, cores=2)
    with torch.inference_mode():
        assert torch.allclose(module(x), model(x), atol=1e-5)


def test_mapped_googlenet_runs_on_two_cpu_devices_and_verifies():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
    x = torch.randn(1, 3, 64, 64)
    graph, plan = _mapped(model, (x,), "heft")
    devices = check_runnable(plan)
    assert min(devices.values()) > 0  # both devices used
    module = OptimizedModule(graph, plan, cores=2)
    with torch.inference_mode():
        assert torch.allclose(module(x), model(x), atol=1e-4)


def test_map_on_real_devices_verifies_times_and_chooses_like_optimize(capsys, tmp_path):
    import json

    from opsched.cli import main

    plan = tmp_path / "mapped.json"
    assert main(["map", "squeezenet", "--image-size", "32", "--platform", "cpu2", "--method", "greedy",
                 "--time-limit", "1", "--repeats", "3", "--out", str(plan), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["unit"] == "ms" and not result["simulated"]
    assert sum(result["devices"].values()) == len(result["placements"])
    assert result["lower_bound"] <= result["predicted"]
    # through the one runner: the mapping, each kind of device alone and eager, verified and timed interleaved
    assert {"greedy", "cpu0 alone", "eager"} <= set(result["measured_ms"])
    assert result["chosen"] == result["tie"][0] and min(result["measured_ms"], key=result["measured_ms"].get) in \
        result["tie"]
    assert result["max_error"] <= 1e-3
    # the units' costs as they run beside the other device, and a value crossing devices a thread's wake-up
    beside = result["co_running"]  # empty when the mapping keeps to one device
    assert set(beside) <= {"cpu0", "cpu1"} and all(1.0 <= f < 3.0 for f in beside.values())
    assert 0.0 < result["handoff_ms"] < 1.0
    written = json.loads(plan.read_text())
    assert written["options"]["chosen"]["name"] == result["chosen"] and "devices" in written
    assert written["method"] == result["plan_method"]


def test_map_on_simulated_devices_says_so_and_times_nothing(capsys):
    import json

    from opsched.cli import main

    assert main(["map", "squeezenet", "--image-size", "32", "--platform", "diviml", "--method", "heft",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["simulated"] and "measured_ms" not in result and "chosen" not in result


def test_map_then_run_through_the_cli_verifies_on_real_devices_and_refuses_simulated_ones(capsys, tmp_path):
    import json

    from opsched.cli import main

    plan = tmp_path / "mapped.json"
    assert main(["map", "squeezenet", "--image-size", "32", "--platform", "cpu2", "--method", "heft",
                 "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", "squeezenet", "--image-size", "32", "--plan", str(plan), "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == "local" and sum(result["devices"].values()) == len(json.loads(plan.read_text())["ops"])
    assert result["max_abs_error"] <= 1e-3
    simulated = tmp_path / "simulated.json"
    assert main(["map", "squeezenet", "--image-size", "32", "--platform", "diviml", "--method", "heft",
                 "--out", str(simulated)]) == 0
    capsys.readouterr()
    assert main(["run", "squeezenet", "--image-size", "32", "--plan", str(simulated)]) == 2
    err = capsys.readouterr().err
    assert "simulated" in err and len(err.strip().splitlines()) == 1


def test_co_running_costs_apply_to_cpu_devices_beside_each_other_and_not_to_one_alone():
    from opsched.graph.ir import Graph, Node
    from opsched.mapping.plan import Mapping
    from opsched.mapping.platform import platform_from_dict
    from opsched.mapping.problem import build_problem
    from opsched.mapping.replay import replay

    g = Graph([Node("a", latency=2.0), Node("b", args=("a",), latency=3.0), Node("c", args=("a",), latency=3.0)])
    platform = platform_from_dict({"devices": [{"name": "x", "kind": "cpu"}, {"name": "y", "kind": "cpu"}],
                                   "links": {"default": {"bandwidth": "inf", "latency": 0.5}}})
    problem = build_problem(g, platform, device_latencies={n.name: {"x": n.latency, "y": n.latency} for n in g.nodes})
    problem.co_running, problem.handoff = {0: 1.25, 1: 1.5}, 0.1
    assert problem.comm(0, 1, 0, 1) == pytest.approx(0.6) and problem.comm(0, 1, 0, 0) == 0.0
    spread = Mapping.from_devices(3, [0, 0, 1], [0, 1, 2], 2)
    assert replay(problem, spread).makespan == pytest.approx(2 + 0.6 + 3)  # what the search compares
    assert replay(problem.beside(), spread).makespan == pytest.approx(1.25 * 2 + 0.6 + 1.5 * 3)
    assert replay(problem, Mapping.from_devices(3, [0, 0, 0], [0, 1, 2], 2)).makespan == pytest.approx(8.0)
    part = problem.sub([0, 2])
    assert (part.co_running, part.handoff) == ({0: 1.25, 1: 1.5}, 0.1)


def test_measuring_co_running_keeps_the_callers_thread_count():
    # read after the other devices had set theirs, the caller's count came back as 1: map then timed eager there
    from opsched.graph.capture import capture
    from opsched.runtime.corun import co_running_factors

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)).eval()
    x = torch.randn(4, 32)  # two units
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        factors = co_running_factors(capture(model, (x,)), (x,), [([0], 1), ([1], 1)], repeats=2)
        assert len(factors) == 2 and min(factors) >= 1.0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
