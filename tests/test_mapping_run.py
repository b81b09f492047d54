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
    from opsched.cost.measure import MeasuredCost

    graph = capture(model, inputs)

    def measure(device, threads):
        cost = MeasuredCost(graph, inputs, cores=threads, repeats=3)
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
    assert result["chosen"] == min(result["measured_ms"], key=result["measured_ms"].get)
    assert result["max_abs_error"] <= 1e-3
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
