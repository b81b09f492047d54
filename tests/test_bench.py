"""opsched bench: presets, resumable CSV, markdown and plots (on a simulated GPU and small inputs, to stay
quick; the measured path is the same code as opsched optimize's)."""

import pytest

from opsched import bench
from opsched.errors import OpschedError
from opsched.report.plots import write_plots


def test_presets_name_the_papers_experiments():
    quick = bench.preset_cases("quick")
    assert {c.cost for c in quick} == {"sim:v100", "measured"}
    pruning = bench.preset_cases("pruning", models=["squeezenet"])
    assert [v for c in pruning for v in c.variants] == [
        {"max_group_size": r, "max_groups": s} for r in (1, 2, 3) for s in (3, 8)]
    with pytest.raises(OpschedError, match="unknown preset"):
        bench.preset_cases("everything")
    with pytest.raises(OpschedError, match="unknown method"):
        bench.preset_cases("quick", methods=["magic"])


def test_a_run_writes_rows_once_and_resumes(tmp_path):
    case = bench.Case("schedules", "squeezenet", 1, "sim:t4", ["sequential", "ios", "lios"], image_size=64)
    rows = bench.run([case], tmp_path)
    assert [r["method"] for r in rows] == ["sequential", "ios", "lios"]
    assert all(r["simulated"] == "True" for r in rows)
    ios = next(r for r in rows if r["method"] == "ios")
    assert float(ios["predicted_ms"]) <= float(ios["sequential_predicted_ms"])  # IOS never loses to sequential
    assert int(ios["transitions"]) > 0 and float(ios["lower_bound_ms"]) <= float(ios["predicted_ms"])
    before = (tmp_path / "results.csv").read_text()
    assert bench.run([case], tmp_path) == rows and (tmp_path / "results.csv").read_text() == before
    table = bench.markdown(rows)
    assert "SIMULATED" in table and "| squeezenet | 1 |" in table
    plots = write_plots(rows, tmp_path)
    assert {p.name for p in plots} == {"throughput-sim-t4.png", "search-time.png"}


def test_each_row_says_where_when_and_with_what_it_was_measured(tmp_path):
    import json

    import torch

    case = bench.Case("schedules", "squeezenet", 1, "sim:t4", ["sequential"], image_size=64)
    (tmp_path / "results.csv").write_text(  # a file of an earlier opsched, without those columns
        "preset,model,batch,cost,simulated,method,variant,predicted_ms\n"
        "schedules,randwire,1,sim:t4,True,ios,,1.5\n")
    rows = bench.run([case], tmp_path)
    assert [r["model"] for r in rows] == ["randwire", "squeezenet"]  # the earlier row kept, under today's columns
    assert rows[0]["predicted_ms"] == "1.5" and rows[0]["date"] == ""
    assert rows[1]["date"] and "cores" in rows[1]["machine"]
    assert json.loads(rows[1]["versions"])["torch"] == torch.__version__


def test_specialisation_costs_each_schedule_on_the_other_settings(tmp_path):
    cases = [bench.Case("specialisation", "squeezenet", b, c, ["sequential", "ios"], image_size=64)
             for c in ("sim:v100", "sim:k80") for b in (1, 4)]
    rows = bench.run(cases, tmp_path)
    crossed = [r for r in rows if r["variant"].startswith("made_for=")]
    assert len(crossed) == 4 * 3
    for r in crossed:  # a schedule made for the setting itself is never beaten by one made for another
        own = next(o for o in rows if o["method"] == "ios" and not o["variant"] and o["cost"] == r["cost"]
                   and o["batch"] == r["batch"])
        assert float(own["predicted_ms"]) <= float(r["predicted_ms"]) + 1e-9
