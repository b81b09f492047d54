import json
import textwrap

import pytest
import torch

from opsched.cli import main
from opsched.errors import ModelSpecError
from opsched.models import load_model


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_graph_json_has_the_contract_fields(capsys):
    code, out, err = run(capsys, "graph", "squeezenet", "--image-size", "64", "--json")
    assert code == 0, err
    doc = json.loads(out)
    for key in ("model", "units", "edges", "blocks", "max_block_width", "flops"):
        assert key in doc
    assert doc["model"] == "squeezenet" and 40 <= doc["units"] <= 60 and doc["blocks"] == len(doc["block_table"])


def test_graph_text_summary_has_a_block_table(capsys):
    code, out, _ = run(capsys, "graph", "squeezenet", "--image-size", "64", "--batch", "2")
    assert code == 0
    assert "units" in out and "widest block" in out and "first unit" in out and "(batch 2)" in out


def test_graph_reads_dag_json(capsys, tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"nodes": [{"name": "a", "latency": 1}, {"name": "b", "latency": 1}],
                                "edges": [["a", "b"]]}))
    code, out, _ = run(capsys, "graph", str(path), "--json")
    assert code == 0 and json.loads(out)["units"] == 2


@pytest.mark.parametrize("argv", [[], ["graph"]])
def test_help_on_every_command(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv + ["--help"])
    assert info.value.code == 0
    assert "usage: opsched" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["graph", "resnet9000"], "unknown model 'resnet9000'"),
    (["graph", "torchvision:nosuchnet"], "torchvision has no model 'nosuchnet'"),
    (["graph", "timm:nosuchnet"], "timm has no model 'nosuchnet'"),
    (["graph", "missing.py:f"], "no such model file"),
    (["graph", "squeezenet", "--input-shape", "1xthree"], "bad input shape"),
])
def test_bad_model_specs_give_one_line_and_status_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_bad_flag_values_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["graph", "squeezenet", "--batch", "0"])
    assert info.value.code == 2


FACTORY = textwrap.dedent("""
    import torch
    def bare():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    def with_inputs():
        return torch.nn.Linear(6, 2), (torch.randn(2, 6),)
    def broken():
        raise RuntimeError("no weights here")
""")


def test_file_factory_specs(capsys, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(FACTORY)
    code, _, err = run(capsys, "graph", f"{path}:bare")
    assert code == 2 and "--input-shape" in err
    code, out, _ = run(capsys, "graph", f"{path}:bare", "--input-shape", "1x3x8x8", "--json")
    assert code == 0 and json.loads(out)["units"] == 1
    code, _, err = run(capsys, "graph", f"{path}:broken")
    assert code == 2 and "no weights here" in err
    code, _, err = run(capsys, "graph", f"{path}:nothing")
    assert code == 2 and "no callable 'nothing'" in err
    loaded = load_model(f"{path}:with_inputs", batch=5)
    assert loaded.inputs[0].shape == (5, 6)
    loaded = load_model(f"{path}:bare", input_shapes=[(2, 3, 8, 8)], batch=3)
    assert loaded.inputs[0].shape == (3, 3, 8, 8)


def test_timm_and_torchvision_specs():
    m = load_model("timm:resnet18", image_size=32)
    assert m.inputs[0].shape == (1, 3, 32, 32)
    m = load_model("torchvision:inception_v3", batch=2, image_size=80)
    assert m.inputs[0].shape == (2, 3, 80, 80)
    m = load_model("torchvision:r3d_18", image_size=16)  # a video model: a clip of 16 frames
    assert m.inputs[0].shape == (1, 3, 16, 16, 16)
    # by default at its weights' crop: 224 px for MViT, whose position encoding takes no other
    assert load_model("torchvision:mvit_v2_s").inputs[0].shape == (1, 3, 16, 224, 224)
    assert load_model("torchvision:r3d_18").inputs[0].shape == (1, 3, 16, 112, 112)
    with torch.no_grad():
        assert m.model(*m.inputs).shape == (1, 400)
    m = load_model("torchvision:deeplabv3_mobilenet_v3_large", image_size=32)  # no backbone weights fetched
    with torch.no_grad():
        assert m.model(*m.inputs)["out"].shape == (1, 21, 32, 32)
    with pytest.raises(ModelSpecError, match="batch must be at least 1"):
        load_model("squeezenet", batch=0)


@pytest.mark.parametrize("spec", ["timm:resmlp_12_224", "torchvision:vit_b_32"])
def test_models_whose_libraries_zero_their_heads_answer_by_their_input(spec):
    # untrained, these returned a constant zero: every plan "matched" them with an error of exactly 0
    m = load_model(spec)
    with torch.no_grad():
        first, other = m.model(*m.inputs), m.model(torch.randn_like(m.inputs[0]))
    assert first.abs().max() > 0 and (first - other).abs().max() > 1e-3


def write_dag(tmp_path):
    from opsched.graph import dagjson
    from opsched.models.synthetic import randwire_stage

    path = tmp_path / "stage.json"
    dagjson.write(randwire_stage(16, "ws", seed=2), path)
    return path


@pytest.mark.parametrize("method", ["sequential", "greedy", "lios", "nimble", "ios", "exact"])
def test_schedule_json_contract(capsys, tmp_path, method):
    path = write_dag(tmp_path)
    code, out, err = run(capsys, "schedule", str(path), "--method", method, "--json", "--streams", "3")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["method"] == method and doc["predicted_latency"] > 0
    assert set(doc["stats"]) >= {"states", "transitions", "search_seconds"}
    assert len(doc["ops"]) == 17 and set(doc["ops"][0]) == {"name", "stream", "start", "finish"}
    assert ("stages" in doc) == (method in ("sequential", "greedy", "ios"))
    assert doc["bounds"]["lower_bound"] <= doc["predicted_latency"] + 1e-9


def test_schedule_text_and_plan_file(capsys, tmp_path):
    path = write_dag(tmp_path)
    plan = tmp_path / "plan.json"
    code, out, _ = run(capsys, "schedule", str(path), "--method", "ios", "-r", "2", "-s", "4",
                       "--capacity", "3", "--sync-overhead", "0.5", "--out", str(plan))
    assert code == 0 and "predicted latency" in out and "lower bound" in out and "transitions" in out
    assert json.loads(plan.read_text())["options"]["max_group_size"] == 2
    code, _, err = run(capsys, "schedule", str(path), "--method", "ios", "--out", str(plan))
    assert code == 2 and "--force" in err
    assert run(capsys, "schedule", str(path), "--method", "ios", "--out", str(plan), "--force")[0] == 0


@pytest.mark.parametrize("argv,message", [
    (["schedule", "inception_v3", "--method", "ios"], "takes a DAG JSON file"),
    (["schedule", "nothere.json", "--method", "ios"], "cannot read"),
])
def test_schedule_bad_input(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_schedule_bad_capacity(capsys, tmp_path):
    path = write_dag(tmp_path)
    code, _, err = run(capsys, "schedule", str(path), "--method", "ios", "--capacity", "0.5")
    assert code == 2 and "capacity" in err


def test_shipped_examples_schedule_as_the_readme_says(capsys):
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    code, out, _ = run(capsys, "schedule", str(examples / "lios_fig3.json"), "--method", "lios", "--streams", "3",
                       "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["predicted_latency"] == 38 and doc["sequential_latency"] == 73
    code, out, _ = run(capsys, "schedule", str(examples / "randwire_stage.json"), "--method", "ios", "--json")
    assert code == 0 and len(json.loads(out)["ops"]) == 33


# -- optimize, run, show, cache --

def test_optimize_on_a_simulated_gpu_predicts_and_labels_it_simulated(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "optimize", "squeezenet", "--image-size", "64", "--cost", "sim:v100", "--json")
    assert code == 0, err
    doc = json.loads(out)
    for key in ("model", "batch", "device", "cost", "method", "units", "search_seconds", "plan", "predicted_ms"):
        assert key in doc
    assert doc["simulated"] is True and "measured_ms" not in doc
    assert set(doc["predicted_ms"]) == {"sequential", "greedy", "lios", "ios"}
    assert doc["predicted_ms"]["ios"] <= doc["predicted_ms"]["sequential"]
    plan = json.loads((tmp_path / doc["plan"]).read_text())
    assert plan["device"] == "sim:v100" and (tmp_path / doc["gantt"]).stat().st_size > 0
    first = (tmp_path / doc["plan"]).read_text()
    code, out, _ = run(capsys, "optimize", "squeezenet", "--image-size", "64", "--cost", "sim:v100", "--json")
    again = json.loads(out)
    assert code == 0 and again["plan"] == "opsched-squeezenet-b1-ios-2.json"  # the first run's files are kept
    assert again["gantt"] == "opsched-squeezenet-b1-ios-2.png" and (tmp_path / doc["plan"]).read_text() == first


def test_measured_text_says_how_the_choice_was_made_and_how_far_outputs_are(capsys, tmp_path):
    """The tables people read, not only the JSON: the chosen line gives the run's noise and the tie, the verified
    line the error at each output's scale."""
    code, out, err = run(capsys, "optimize", "squeezenet", "--image-size", "32", "--repeats", "3", "--method",
                         "sequential", "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("chosen"))
    assert "one program timed twice differed by" in chosen and ("tied with" in chosen or "every other configuration is beaten" in chosen)
    assert "of each output's magnitude" in next(line for line in out.splitlines() if line.startswith("verified"))
    code, out, err = run(capsys, "map", "squeezenet", "--image-size", "32", "--platform", "cpu2", "--method",
                         "greedy", "--time-limit", "1", "--repeats", "3", "--out", str(tmp_path / "m.json"))
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("chosen"))
    assert "one program timed twice differed by" in chosen and "of each output's magnitude" in chosen


def test_optimize_measured_runs_verifies_and_times_every_schedule(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = run(capsys, "optimize", "squeezenet", "--image-size", "48", "--repeats", "2", "--out",
                         str(plan), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc["measured_ms"]) >= {"eager", "sequential", "greedy", "lios", "ios"}
    assert doc["max_abs_error"] <= 1e-3 and doc["simulated"] is False and doc["eager_threads"] >= 1
    assert plan.exists() and (tmp_path / "plan.png").exists()
    # off a terminal, what it is doing is plain lines on stderr, a few per step (stdout is the JSON alone)
    lines = err.splitlines()
    assert {"capturing squeezenet ...", "scheduling with ios ...", "compiling the schedules ..."} <= set(lines), err
    assert any(line.startswith("verifying and measuring ") for line in lines), err
    profiling = [line for line in lines if line.startswith(f"profiling {doc['units']} units: ")]
    assert profiling[0].endswith(" runs") and ", done in " in profiling[-1], err
    # a second search of the same model measures no unit again
    code, out, err = run(capsys, "optimize", "squeezenet", "--image-size", "48", "--repeats", "2", "--out",
                         str(tmp_path / "again.json"), "--json")
    assert json.loads(out)["cost_model"]["units_measured"] == 0
    # run: the plan executes and verifies; another batch or another model is refused in one line
    # (at the image size the plan's call was made for, unless another is asked)
    code, out, err = run(capsys, "run", "squeezenet", "--plan", str(plan), "--repeats", "2", "--json")
    assert code == 0, err and json.loads(out)["max_abs_error"] <= 1e-3
    code, _, err = run(capsys, "run", "squeezenet", "--image-size", "48", "--batch", "2", "--plan", str(plan))
    assert code == 2 and "batch 1" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "run", "randwire", "--image-size", "48", "--plan", str(plan))
    assert code == 2 and "another graph" in err
    # show: a Gantt chart and a trace of the predicted timeline; nothing overwritten without --force
    trace = tmp_path / "trace.json"
    code, out, err = run(capsys, "show", str(plan), "--gantt", str(tmp_path / "g.png"), "--trace", str(trace))
    assert code == 0, err
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == doc["units"]
    code, _, err = run(capsys, "show", str(plan), "--trace", str(trace))
    assert code == 2 and "--force" in err
    # cache: info counts the measurements; clear empties it
    code, out, _ = run(capsys, "cache", "info", "--json")
    assert code == 0 and json.loads(out)["entries"] > 0
    code, out, _ = run(capsys, "cache", "clear", "--json")
    assert code == 0 and json.loads(out)["removed"] > 0
    code, out, _ = run(capsys, "cache", "info", "--json")
    assert json.loads(out)["entries"] == 0


@pytest.mark.parametrize("argv, message", [
    (["optimize", "squeezenet", "--cost", "sim:v99"], "unknown simulated device"),
    (["optimize", "squeezenet", "--cost", "guess"], "--cost takes"),
])
def test_optimize_rejects_bad_input_in_one_line(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_optimize_never_overwrites_a_file_it_did_not_write(capsys, tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    code, _, err = run(capsys, "optimize", "squeezenet", "--cost", "sim:t4", "--out", str(mine))
    assert code == 2 and "--force" in err and mine.read_text() == "{}"


def test_bench_writes_csv_markdown_and_plots(capsys, tmp_path):
    out = tmp_path / "b"
    code, stdout, err = run(capsys, "bench", "--preset", "search-cost", "--models", "squeezenet", "--cost", "sim:t4",
                            "--out", str(out), "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["rows"] == 2 and (out / "results.csv").exists() and (out / "results.md").exists()
    assert (out / "search-time.png").exists()


def test_optimize_batch_sizes_writes_every_signature_and_show_lists_them(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = run(capsys, "optimize", "squeezenet", "--image-size", "48", "--repeats", "2", "--batch-sizes",
                         "1,3", "--out", str(plan))
    assert code == 0, err
    also = [line for line in out.splitlines() if line.startswith("also ")]
    assert [line.split(":")[0] for line in also] == ["also       inputs (3, 3, 48, 48)"], out  # batch 1 is the plan's own
    assert "building a plan for input 0 (3, 3, 48, 48) float32 ..." in err.splitlines(), err
    code, out, err = run(capsys, "show", str(plan), "--json")
    assert code == 0, err
    rows = json.loads(out)["signatures"]
    assert [r["inputs"][0][0] for r in rows] == [1, 3] and all(r["chosen"] in r["measured_ms"] for r in rows)
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: one line, status 2
        main(["optimize", "squeezenet", "--batch-sizes", "1,0"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "batch sizes must be positive" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "optimize", "squeezenet", "--cost", "sim:v100", "--batch-sizes", "2",
                       "--out", str(tmp_path / "y.json"))
    assert code == 2 and "--batch-sizes makes measured plans" in err
