import json

import pytest

from opsched.cost.table import TableCost
from opsched.graph.ir import Graph, Node
from opsched.models.synthetic import random_layered_dag
from opsched.schedule import Schedule, ScheduleError, Stage, from_stages, load, validate
from opsched.schedulers import make_schedule
from opsched.schedulers.ios import ios


@pytest.mark.parametrize("method", ["ios", "lios", "greedy", "nimble"])
def test_json_round_trip(tmp_path, method):
    g = random_layered_dag(20, 5, 0.3, seed=1)
    s = make_schedule(method, g, TableCost(g))
    path = tmp_path / "plan.json"
    s.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "opsched.schedule/1" and doc["graph"]["fingerprint"] == g.fingerprint
    back = load(path, g)
    assert back.to_dict() == s.to_dict()
    assert back.form == ("staged" if method in ("ios", "greedy") else "stream")


def test_plan_for_another_graph_is_refused(tmp_path):
    g = random_layered_dag(10, 4, 0.3, seed=1)
    other = random_layered_dag(10, 4, 0.3, seed=2)
    path = tmp_path / "plan.json"
    make_schedule("ios", g, TableCost(g)).save(path)
    with pytest.raises(ScheduleError, match="made for another graph"):
        load(path, other)


@pytest.mark.parametrize("text,message", [
    ("{", "malformed JSON at line 1"),
    ('{"format": "x"}', "not an opsched schedule"),
    ('{"format": "opsched.schedule/1", "method": "ios"}', "malformed schedule"),
])
def test_malformed_files(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=message):
        load(path)


def small():
    return Graph([Node("a", latency=1.0), Node("b", args=("a",), latency=2.0), Node("c", args=("a",), latency=3.0),
                  Node("d", args=("b", "c"), latency=1.0)])


@pytest.mark.parametrize("stages,message", [
    ([("concurrent", [[0]]), ("concurrent", [[1], [2]])], "leaves out 1 unit"),
    ([("concurrent", [[0]]), ("concurrent", [[1], [2]]), ("concurrent", [[3], [1]])], "more than once"),
    ([("concurrent", [[0], [1]]), ("concurrent", [[2]]), ("concurrent", [[3]])], "at the same time"),
    ([("concurrent", [[1, 0]]), ("concurrent", [[2]]), ("concurrent", [[3]])], "before its input"),
    ([("concurrent", [[0]]), ("concurrent", [[3]]), ("concurrent", [[1], [2]])], "later stage"),
])
def test_validation_catches_broken_staged_schedules(stages, message):
    g = small()
    cost = TableCost(g)
    schedule = Schedule("x", g.name, g.fingerprint, [], 0.0)  # stages as given, with a valid timeline
    groups = [(strategy, [[g.nodes[u].name for u in grp] for grp in groups]) for strategy, groups in stages]
    schedule.stages = [Stage(st, grps) for st, grps in groups]
    good = from_stages(g, cost, "x", [("concurrent", [[0]]), ("concurrent", [[1], [2]]), ("concurrent", [[3]])])
    schedule.ops = good.ops
    with pytest.raises(ScheduleError, match=message):
        validate(schedule, g)  # the timeline is valid: only the stages are broken


def test_validation_catches_timelines_that_break_dependencies():
    g = small()
    s = make_schedule("lios", g, TableCost(g), streams=2)
    validate(s, g)
    s.ops[3].start = 0.0  # d before b and c finish
    with pytest.raises(ScheduleError, match="starts before its input"):
        validate(s, g)


class MergeCost(TableCost):
    """Merged units cost the longest of them plus a little: merging always pays."""

    def merge_latency(self, units):
        return max(self.latencies[u] for u in units) + 0.1


def conv(name, k, latency):
    attrs = {"kernel": (k, k), "stride": (1, 1), "padding": (k // 2, k // 2), "dilation": (1, 1), "groups": 1}
    return Node(name, kind="conv", args=("x",), dtype="float32", attrs=attrs, latency=latency)


def test_ios_chooses_merge_where_the_cost_model_says_it_pays():
    g = Graph([conv("a", 1, 2.0), conv("b", 3, 3.0), conv("c", 5, 4.0),
               Node("cat", kind="cat", args=("a", "b", "c"), latency=1.0)], inputs=["x"])
    cost = MergeCost(g, capacity=1)  # concurrent stages get no speedup: merging wins
    s = ios(g, cost, max_group_size=0, max_groups=0)
    validate(s, g)
    assert [st.strategy for st in s.stages] == ["merge", "concurrent"]
    assert s.predicted_latency == pytest.approx(4.1 + 1.0)
    parallel = ios(g, cost, merge=False)
    assert all(st.strategy == "concurrent" for st in parallel.stages) and parallel.predicted_latency == 10.0
    merge_only = ios(g, cost, concurrent=False)
    assert merge_only.predicted_latency == pytest.approx(5.1)
    bad = from_stages(g, cost, "x", [("merge", [[0], [1]]), ("concurrent", [[2]]), ("concurrent", [[3]])])
    validate(bad, g)
    g2 = Graph([conv("a", 1, 2.0), conv("b", 2, 3.0), Node("cat", kind="cat", args=("a", "b"), latency=1.0)],
               inputs=["x"])
    with pytest.raises(ScheduleError, match="cannot be merged"):
        validate(from_stages(g2, MergeCost(g2), "x", [("merge", [[0], [1]]), ("concurrent", [[2]])]), g2)
