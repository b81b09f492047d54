"""Labels that cannot lie: a mapping's figures are simulated as soon as one device, or one cost, is; the
command's text, its JSON, the plan it writes and ``opsched show`` all say so (issue 39)."""

import json

import pytest

from opsched.cli import main
from opsched.graph.ir import Graph, Node
from opsched.mapping.plan import to_schedule
from opsched.mapping.platform import platform_from_dict
from opsched.mapping.problem import build_problem
from opsched.mapping.solve import solve
from opsched.schedule import from_dict

MODEL = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 3, padding=1)
        self.right = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.left(x) + self.right(x)


def model():
    return Branchy().eval(), (torch.randn(1, 3, 16, 16),)
'''

LINK = {"default": {"bandwidth": 25e6, "latency": 0.01}}


def _platform(*kinds: str | None) -> dict:
    return {"devices": [{"name": f"d{k}", **({"kind": kind} if kind else {})} for k, kind in enumerate(kinds)],
            "links": LINK}


def _plan(problem):
    solved = solve(problem, "heft")
    return to_schedule(problem, solved.mapping, solved.timeline, "heft", solved.lower_bound, solved.optimal, {})


@pytest.mark.parametrize(("kinds", "given", "simulated"), [
    (("cpu", "sim:xeon"), False, True),  # one simulated device beside a measured one
    (("sim:xeon", "sim:a100"), False, True),
    (("cpu", "cpu"), False, False),  # every cost measured here
    (("cpu", "cpu"), True, True),  # a DAG JSON file's latencies on real devices: given, not measured
    ((None, None), True, True),
])
def test_one_rule_labels_the_problem_and_the_plan_alike(kinds, given, simulated):
    graph = Graph([Node("a", latency=2.0 if given else None), Node("b", args=("a",), latency=3.0 if given else None)])
    platform = platform_from_dict(_platform(*kinds))
    problem = build_problem(graph, platform, measure=None if given else lambda device, threads: [1.0, 2.0])
    plan = _plan(problem)
    assert problem.simulated is simulated and plan.simulated is simulated
    assert plan.cost.startswith("sim:") is simulated and plan.device.startswith("sim:") is simulated


def test_mixed_real_and_simulated_platform_is_simulated_in_text_json_plan_and_show(tmp_path, capsys):
    (tmp_path / "branchy.py").write_text(MODEL)
    model = f"{tmp_path / 'branchy.py'}:model"
    platform = tmp_path / "mixed.json"
    platform.write_text(json.dumps({"name": "mixed", **_platform("cpu", "sim:a100")}))
    plan = tmp_path / "plan.json"
    command = ["map", model, "--platform", str(platform), "--method", "greedy"]

    assert main([*command, "--out", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "(SIMULATED)" in out.splitlines()[0] and "measured costs" not in out
    assert main([*command, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated"] is True

    written = json.loads(plan.read_text())
    assert written["cost"] == "sim:mixed" and written["device"] == "sim:platform:mixed"
    assert from_dict(written).simulated
    assert main(["show", str(plan)]) == 0
    assert "SIMULATED on mixed" in capsys.readouterr().out
    assert main(["show", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated"] is True

    # a plan whose cost was edited to "measured" still maps onto a simulated device, and is shown as such
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**written, "cost": "measured", "device": "platform:mixed"}))
    assert main(["show", str(edited), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["simulated"] is True and "SIMULATED on mixed" in shown["timeline"]
