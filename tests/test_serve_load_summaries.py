"""benchmarks/serve_load.py's summaries of an interleaved run (what docs/serving.md's tables and plots quote):
medians over the rounds, ratios taken round by round against the baselines and the higher ceiling, and the plot."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture
def serve_load(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_load

    return serve_load


def _record(path: Path, rates: dict[str, list[float]]) -> None:
    rows = [{"workload": "cnn16", "config": config, "tensors": "json", "load": "closed", "clients": 32,
             "answered_per_s": rate, "p50_ms": 10.0 + k, "p99_ms": 20.0 + k, "errors": 0, "lost": 0, "wrong": 0,
             "checked": 4, "server_cpu_ms": 0.5, "run": "r1", "round": k, "machine": "test", "date": "2026-11-28"}
            for config, by_round in rates.items() for k, rate in enumerate(by_round)]
    random.Random(0).shuffle(rows)  # interleaved: the rounds' rows in any order
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ratios_are_taken_round_by_round_against_the_higher_ceiling(serve_load, tmp_path):
    rates = {"eager": [100.0, 50.0, 80.0], "batched": [200.0, 100.0, 100.0], "opsched": [300.0, 160.0, 240.0],
             "ceiling": [400.0, 150.0, 300.0], "ceiling-process": [350.0, 200.0, 320.0]}
    _record(tmp_path / "run.jsonl", rates)
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    summaries = {s["config"]: s for s in serve_load.interleaved_summaries(rows)}
    opsched = summaries["opsched"]
    assert opsched["rounds"] == 3 and opsched["answered_per_s"] == 240.0 and opsched["p99_ms"] == 21.0
    by_round = [o / e for o, e in zip(rates["opsched"], rates["eager"])]  # 3.0, 3.2, 3.0
    assert opsched["against_eager"] == [round(statistics.median(by_round), 2), 3.0, 3.2]
    ceilings = [max(a, b) for a, b in zip(rates["ceiling"], rates["ceiling-process"])]
    against = [o / c for o, c in zip(rates["opsched"], ceilings)]
    assert opsched["against_ceiling"] == [round(statistics.median(against), 2), round(min(against), 2),
                                          round(max(against), 2)]
    assert "against_eager" not in summaries["eager"] or summaries["eager"]["against_eager"] is None


def test_an_interleaved_run_is_plotted_from_its_medians(serve_load, tmp_path):
    pytest.importorskip("matplotlib")
    _record(tmp_path / "run.jsonl", {"eager": [100.0, 90.0], "opsched": [300.0, 280.0]})
    serve_load.plot(str(tmp_path / "run.jsonl"), str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 0
