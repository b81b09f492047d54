"""One typed plan: the ``devices`` and ``models`` sections, every plan written before them still read (and run),
and hand-edited sections refused in one line."""

import json
import shutil
from pathlib import Path

import pytest

from opsched import schedule as schedule_module
from opsched.cli import main
from opsched.schedule import ScheduleError

BEFORE = Path(__file__).parent / "data" / "plans_before_redesign"
KINDS = {"table_staged.json": "schedule", "table_streams.json": "schedule", "optimize_ios.json": "schedule",
         "map_dag_heft.json": "mapping", "map_dag_ea_split_throughput.json": "mapping",
         "map_diviml_throughput.json": "mapping", "map_cpu2_heft.json": "mapping",
         "multi_copies.json": "model batch"}


def test_every_kind_of_plan_written_before_the_sections_is_read_into_them():
    assert sorted(KINDS) == sorted(p.name for p in BEFORE.glob("*.json"))
    for name, kind in KINDS.items():
        old = json.loads((BEFORE / name).read_text())
        plan = schedule_module.load(BEFORE / name)
        assert plan.kind == kind, name
        # read back from what it writes now: the same plan, and nothing of the old dialects left in options
        again = schedule_module.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert again.to_dict() == plan.to_dict()
        assert not {"mapping", "multi", "stream_devices", "placements", "lower_bound"} & set(plan.options)
        if kind == "mapping":
            options = old["options"]
            section = plan.devices
            # what was stored twice is now derived, and equal to what was stored
            placed = sorted(json.dumps(p, sort_keys=True) for p in section.placements(plan.ops, plan.batch))
            assert placed == sorted(json.dumps(p, sort_keys=True) for p in options["placements"])
            assert section.objective_value(plan.predicted_latency, plan.batch) == pytest.approx(options["predicted"])
            assert plan.bounds["lower_bound"] == options["lower_bound"]
            assert [d.name for d in section.devices] == options["stream_devices"]
            assert [d.threads for d in section.devices] == options["stream_threads"]
            assert section.split_batch == options["split_batch"]
        if kind == "model batch":
            assert plan.models.load == old["options"]["multi"]["load"]
            assert plan.models.batched == old["options"]["multi"]["batched"]


def test_a_split_batch_stores_only_the_jobs_beyond_the_timeline():
    plan = schedule_module.load(BEFORE / "map_dag_ea_split_throughput.json")
    doc = plan.to_dict()
    assert "placements" not in doc["options"] and "placements" not in doc["devices"]
    timeline = {(o.name, plan.devices.devices[o.stream].name, o.start, o.finish) for o in plan.ops}
    assert not any((j.name, j.device, j.start, j.finish) in timeline for j in plan.devices.jobs)
    assert plan.devices.split_batch


@pytest.fixture
def before(tmp_path, monkeypatch):
    """The plans made before the sections, in a folder of their own that is the working directory (the model
    batch's plan names its model file relative to it)."""
    folder = tmp_path / "before"
    shutil.copytree(BEFORE, folder)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("OPSCHED_CACHE_DIR", str(tmp_path / "cache"))
    return folder


@pytest.mark.parametrize("plan, models", [("optimize_ios.json", ["tiny.py:model"]),
                                          ("map_cpu2_heft.json", ["tiny.py:model"]),
                                          ("multi_copies.json", ["tiny.py:model"])])
def test_plans_written_before_the_sections_still_run_and_verify(before, capsys, plan, models):
    assert main(["run", *models, "--plan", plan, "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["max_abs_error"] <= 1e-4
    if plan.startswith("map"):
        assert sum(result["devices"].values()) == 5
    if plan.startswith("multi"):
        assert len(result["models"]) == 3 and max(result["model_errors"]) <= 1e-4


def _edited(before: Path, name: str, edit) -> str:
    doc = schedule_module.load(before / name).to_dict()
    edit(doc)
    path = before / f"edited-{name}"
    path.write_text(json.dumps(doc))
    return str(path)


EDITS = {
    "a stream beyond the platform's devices": ("map_cpu2_heft.json", lambda d: d["ops"][0].__setitem__("stream", 2)),
    "a device left out": ("map_cpu2_heft.json", lambda d: d["devices"]["platform"]["devices"].pop()),
    "a billion threads": ("map_cpu2_heft.json",
                          lambda d: d["devices"]["platform"]["devices"][0].__setitem__("threads", 10**9)),
    "an unknown kind": ("map_cpu2_heft.json",
                        lambda d: d["devices"]["platform"]["devices"][0].__setitem__("kind", "tpu")),
    "a transfer to no device": ("map_cpu2_heft.json",
                                lambda d: d["devices"]["transfers"][0].__setitem__("to_device", "x")),
    "a transfer of no unit": ("map_cpu2_heft.json",
                              lambda d: d["devices"]["transfers"][0].__setitem__("value", "nope")),
    # the fuzz suite's find: the chart of a mapping drew its axis to infinity (matplotlib's ValueError, exit 1)
    "an infinite finish": ("map_cpu2_heft.json", lambda d: d["ops"][0].__setitem__("finish", float("inf"))),
    "an unknown objective": ("map_cpu2_heft.json", lambda d: d["devices"].__setitem__("objective", "fast")),
    "both sections": ("map_cpu2_heft.json", lambda d: d.__setitem__("models", {"models": 1})),
    "models not counted": ("multi_copies.json", lambda d: d["models"].__setitem__("models", "three")),
    "no copies": ("multi_copies.json", lambda d: d["models"]["load"].__setitem__("copies", 0)),
    "an unknown rewrite": ("multi_copies.json", lambda d: d["models"]["rewrites"].append("teleport")),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_section_is_refused_in_one_line(before, capsys, edit):
    name, change = EDITS[edit]
    path = _edited(before, name, change)
    for command in (["show", path, "--gantt", str(before / "g.png"), "--force"],
                    ["run", "tiny.py:model", "--plan", path, "--repeats", "1"]):
        status = main(command)
        err = capsys.readouterr().err
        if command[0] == "show" and edit in ("a transfer of no unit", "an unknown rewrite"):
            assert status == 0  # it fits a plan; what it does not fit is the graph, which show does not load
            continue
        assert status == 2, (edit, command, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("opsched: error: ")


def test_a_plan_of_one_kind_given_to_another_job_is_refused_in_one_line(before, capsys):
    for command, why in ((["run", "tiny.py:model", "--copies", "2", "--plan", "map_cpu2_heft.json"], "opsched multi"),
                         (["run", "tiny.py:model", "tiny.py:model", "--plan", "optimize_ios.json"], "opsched multi"),
                         (["run", "tiny.py:model", "--plan", "optimize_ios.json", "--engine", "ray"],
                          "maps no devices"),
                         (["run", "squeezenet", "--plan", "multi_copies.json"], "made for the models")):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and why in err, (command, err)


def test_the_sections_are_parsed_only_in_schedule_py():
    source = Path(schedule_module.__file__).parent
    readers = [p for p in source.rglob("*.py") if p.name != "schedule.py"
               and ("stream_devices" in p.read_text() or 'options["multi"]' in p.read_text())]
    assert readers == []


def test_a_section_that_is_not_an_object_is_refused():
    doc = schedule_module.load(BEFORE / "map_cpu2_heft.json").to_dict()
    doc["devices"] = "cpu2"
    with pytest.raises(ScheduleError, match="devices section"):
        schedule_module.from_dict(doc, "x.json")
