"""Progress on stderr: a tqdm bar on a terminal; elsewhere (pytest's capture is not a terminal, as a CI log
or a pipe is not) a line as a step starts, one every PERIOD seconds at most, and one as it ends."""

import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tqdm import tqdm

from opsched import progress
from opsched.cli import main
from opsched.progress import PERIOD, progress_bar, quiet, say

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def clock(monkeypatch):
    """The seconds opsched.progress reads, set by the test."""
    now = SimpleNamespace(seconds=0.0)
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: now.seconds))
    return now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_long_step_prints_a_line_as_it_starts_every_period_and_as_it_ends(capsys, clock):
    assert PERIOD == 10.0  # the lines below are for it
    with progress_bar("profiling 47 units", 300, unit="run") as bar:
        for _ in range(300):  # 75 s, a tick every 0.25 s
            clock.seconds += 0.25
            bar.update(1)
    assert capsys.readouterr().err.splitlines() == [
        "profiling 47 units: 0/300 runs",
        *(f"profiling 47 units: {40 * k}/300 runs, {10 * k} s" for k in range(1, 8)),
        "profiling 47 units: 300/300 runs, done in 75.0 s",
    ]


def test_a_slow_tick_is_one_line_however_long_it_took(capsys, clock):
    bar = progress_bar("searching", 3, unit="block")
    for seconds in (1.0, 45.0, 46.0):  # the second block took 44 s: one line, not four
        clock.seconds = seconds
        bar.update(1)
    bar.close()
    bar.close()
    assert capsys.readouterr().err.splitlines() == [
        "searching: 0/3 blocks", "searching: 2/3 blocks, 45 s", "searching: 3/3 blocks, done in 46.0 s"]


def test_a_step_ended_by_an_error_or_ctrl_c_says_nothing_after_it(capsys, clock):
    with pytest.raises(KeyboardInterrupt), progress_bar("profiling 3 units", 8, unit="run") as bar:
        bar.update(1)
        raise KeyboardInterrupt
    assert capsys.readouterr().err.splitlines() == ["profiling 3 units: 0/8 runs"]


def test_a_mapping_search_stopped_by_ctrl_c_says_nothing_after_it(capsys, clock):
    from opsched.commands.map import search_progress

    with pytest.raises(KeyboardInterrupt), search_progress("sa") as update:
        update(0, 4000)
        clock.seconds = 12.0
        update(100, 4000)
        raise KeyboardInterrupt
    assert capsys.readouterr().err.splitlines() == ["sa: 0/4000", "sa: 100/4000, 12 s"]


def test_on_a_terminal_a_step_is_a_tqdm_bar_and_a_phase_a_line(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    say("scheduling with ios ...")
    bar = progress_bar("searching", 5, unit="block")
    assert isinstance(bar, tqdm)
    for _ in range(5):
        bar.update(1)
    bar.close()
    text = terminal.getvalue()
    assert text.startswith("scheduling with ios ...\n")
    assert "\r" in text and "searching" in text and "done in" not in text  # redrawn in place


@pytest.mark.parametrize("on_a_terminal", [True, False])
def test_quiet_prints_no_phase_and_no_progress(monkeypatch, on_a_terminal):
    stderr = Terminal() if on_a_terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with quiet():
        say("scheduling with ios ...")
        with progress_bar("searching", 5, unit="block") as bar:
            bar.update(5)
    say("compiling the schedules ...")  # quiet ends with the block
    assert stderr.getvalue() == "compiling the schedules ...\n"


# -- the commands --

def test_schedule_prints_its_search_progress_off_a_terminal_and_json_alone_on_stdout(capsys):
    stage = str(EXAMPLES / "randwire_stage.json")
    assert main(["schedule", stage, "--method", "ios", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["ops"]) == 33
    start, end = err.splitlines()  # the search takes well under PERIOD: no line in between
    blocks = re.fullmatch(r"searching: 0/(\d+) blocks", start).group(1)
    assert re.fullmatch(rf"searching: {blocks}/{blocks} blocks, done in \d+\.\d s", end), err
    assert main(["schedule", stage, "--method", "ios", "--json", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_map_prints_a_line_as_the_search_starts_and_ends_not_one_per_step(capsys):
    assert main(["map", str(EXAMPLES / "heft_topcuoglu.json"), "--platform", str(EXAMPLES / "heft_platform.json"),
                 "--method", "sa", "--time-limit", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    start, end = err.splitlines()  # sa reports every 100 of its 4000 steps
    assert start == "sa: 0/4000" and re.fullmatch(r"sa: \d+/4000, done in \d+\.\d s", end), err
    assert main(["map", str(EXAMPLES / "heft_topcuoglu.json"), "--platform", str(EXAMPLES / "heft_platform.json"),
                 "--method", "sa", "--time-limit", "1", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_a_model_that_does_not_load_is_one_line_with_no_progress_before_it(capsys):
    assert main(["optimize", "resnet9000", "--cost", "sim:t4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and "unknown model 'resnet9000'" in err


def test_kernels_this_installation_lacks_are_one_line_before_anything_loads(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    assert main(["optimize", "squeezenet", "--kernels", "onnxruntime"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and "pip install 'opsched[onnx]'" in err


def test_a_multi_batch_that_does_not_load_is_one_line(capsys):
    assert main(["multi", "resnet9000", "--copies", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and "resnet9000" in err


def test_map_progress_ends_when_the_search_does_not_after_the_lower_bound(capsys, monkeypatch):
    # the lower bound, computed after the search, took 23 s of "milp-split: 192/192, done in 63.3 s" for a
    # 40 s search on GPT-3
    from opsched.mapping import bound

    def slow_bound(*args, **kwargs):
        assert ", done in " in capsys.readouterr().err  # the bar closed as the last module finished
        return 0.0

    monkeypatch.setattr(bound, "lower_bound", slow_bound)
    dag, platform = str(EXAMPLES / "heft_topcuoglu.json"), str(EXAMPLES / "heft_platform.json")
    assert main(["map", dag, "--platform", platform, "--method", "milp-split", "--time-limit", "5"]) == 0
