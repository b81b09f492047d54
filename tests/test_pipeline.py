"""The one runner: candidates verified, dropped with a reason, timed, re-timed when unsteady, the fastest
verified chosen; the peers as the design describes them."""

import json
import os

import pytest
import torch

from opsched.cli import main
from opsched.evaluation import Candidate, evaluate


def test_evaluate_drops_wrong_and_failing_candidates_and_chooses_the_fastest_verified(clock):
    # (the configurations' times on a clock only they move: with real sleeps, one pause of the machine's in three
    # rounds could tie the fastest with eager)
    x = torch.ones(4)

    def boom():
        raise RuntimeError("The size of tensor a (28) must match the size of tensor b (56)\nmore lines")

    ev = evaluate([Candidate("slow", clock.runner(0.004, value=x)), Candidate("fast", clock.runner(0.001, value=x)),
                   Candidate("wrong", lambda: x + 1), Candidate("broken", boom),
                   Candidate("eager", clock.runner(0.002, value=x), "peer", 1),
                   Candidate("eager", clock.runner(0.003, value=x), "peer", 2)],
                  reference=x, repeats=3)
    assert ev.chosen == "fast"
    assert set(ev.measured_ms) == {"slow", "fast", "eager"}
    assert ev.threads["eager"] == 1 and ev.kinds["eager"] == "peer"
    assert ev.fastest("peer") == "eager" and ev.fastest("schedule") == "fast"
    assert "differ" in ev.dropped["wrong"]
    assert ev.dropped["broken"] == "failed: RuntimeError: The size of tensor a (28) must match the size of tensor b (56)"
    assert any("broken dropped" in w for w in ev.warnings)


def test_evaluate_remeasures_a_timing_that_was_wildly_off(clock):
    x = torch.ones(2)
    calls = [0]
    # the first timing round is hit by a burst of load on every sample
    disturbed = clock.runner(lambda: 0.02 if 3 <= calls[0] <= 7 else 0.001, calls, value=x)
    ev = evaluate([Candidate("plan", disturbed, expected_ms=1.0), Candidate("eager", clock.runner(0.001, value=x), "peer")],
                  reference=x, repeats=5)
    assert ev.measured_ms["plan"] < 5.0 and not ev.warnings


def test_evaluate_says_when_a_figure_cannot_be_trusted(clock):
    x = torch.ones(2)
    ev = evaluate([Candidate("plan", clock.runner(0.005, value=x), expected_ms=0.1)], reference=x, repeats=3)
    assert ev.measured_ms["plan"] > 4.0
    assert any("its prediction" in w for w in ev.warnings)


def test_a_candidates_prepare_and_settle_surround_each_call_untimed(clock):
    events = []

    def step(name):
        def run():
            if name != "run":
                clock.now += 0.005
            events.append(name)
            return torch.ones(1)
        return run

    ev = evaluate([Candidate("quick", step("run"), prepare=step("prepare"), settle=step("settle"))], torch.ones(1),
                  repeats=4)
    assert ev.measured_ms["quick"] < 2.0  # the 10 ms of each prepare and settle are not in it
    calls = len(events) // 3
    assert calls >= 1 + 2 + 4  # the verifying call, two warm-up calls, four timed ones (a re-timing adds more)
    assert events == ["prepare", "run", "settle"] * calls


def test_torch_compile_peers_are_compiled_in_isolation_per_thread_count(monkeypatch):
    from torch._inductor.codecache import PyCodeCache

    from opsched.peers import torch_compile

    # each thread count's compilation starts with dynamo reset: what inductor generated between two resets is
    # that thread count's code
    starts = []
    reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (starts.append(len(PyCodeCache.modules)), reset())[1])
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 64, 64)
    one, two = torch_compile(model, (x,), 2)
    assert (one.threads, two.threads) == (1, 2) and len(starts) == 2
    modules = list(PyCodeCache.modules)

    def code(first: int, end: int) -> str:
        return "\n".join(open(m.__file__).read() for m in modules[first:end])

    # inductor bakes the thread count into its OpenMP kernels: the 1-thread runner must not run 2-thread code
    assert "num_threads(2)" in code(starts[1], len(modules)) and "num_threads(2)" not in code(starts[0], starts[1])
    with torch.inference_mode():
        want = model(x)
    assert torch.allclose(one.run(), want, atol=1e-4) and torch.allclose(two.run(), want, atol=1e-4)


CUDA_HOME_WARNING = "No CUDA runtime is found, using CUDA_HOME='%s'"  # torch.utils.cpp_extension's


def test_while_inductor_compiles_the_cuda_home_warning_alone_is_dropped():
    import logging

    from opsched.runtime.kernels import without_cuda_home_warning

    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.utils.cpp_extension")
    handler = Seen()
    logger.addHandler(handler)
    try:
        with without_cuda_home_warning():
            logger.warning(CUDA_HOME_WARNING, "/usr/local")
            logger.warning("Error checking compiler version for %s", "c++")
        logger.warning(CUDA_HOME_WARNING, "/usr/local")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Error checking compiler version for c++", CUDA_HOME_WARNING % "/usr/local"]


@pytest.mark.skipif(torch.cuda.is_available() or not (torch.cuda._is_compiled() and torch.version.cuda),
                    reason="torch warns of a CUDA toolkit without a CUDA runtime only when built for CUDA without one")
def test_the_torch_compile_peer_says_nothing_of_a_cuda_toolkit_on_a_machine_without_a_gpu(tmp_path):
    # on a machine with nvcc and no GPU, the peer's first compilation printed, in the middle of the run:
    # W1123 05:44:32.789000 18248 site-packages/torch/utils/cpp_extension.py:183] [0/0] No CUDA runtime is found, ...
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from opsched.peers import torch_compile

        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
        torch_compile(model, (torch.randn(1, 3, 8, 8),), 1)
    """)
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}  # a toolkit, as far as torch can tell
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr, done.stderr


def test_onnxruntime_peer_verifies_against_eager_or_is_left_out_with_a_note():
    from opsched.peers import onnxruntime

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    found, note = onnxruntime(model, (x,), 2)
    try:
        import onnxruntime as _  # noqa: F401
    except ImportError:
        assert not found and "not installed" in note
        return
    assert note is None and [c.label for c in found] == ["onnxruntime@1", "onnxruntime@2"]
    ev = evaluate(found, reference=model(x).detach(), repeats=2)
    assert ev.errors["onnxruntime"] < 1e-5 and set(ev.measured_ms) == {"onnxruntime"}
    # and it is really compared: against another model's outputs, the sessions are dropped
    other = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    ev = evaluate(found, reference=other(x).detach(), repeats=2)
    assert not ev.measured_ms and "differs from the model's" in ev.dropped["onnxruntime"]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_optimize_drops_a_schedule_that_does_not_verify_and_hands_back_one_that_does(capsys, tmp_path, monkeypatch):
    from opsched.runtime.module import OptimizedModule

    run = OptimizedModule.run

    def ios_goes_wrong(self, flat):  # as a wrong merge or a capture bug would make it
        out = run(self, flat)
        return out + 1.0 if self.schedule.method == "ios" else out

    monkeypatch.setattr(OptimizedModule, "run", ios_goes_wrong)
    plan = tmp_path / "plan.json"
    code, out, err = _run(capsys, "optimize", "squeezenet", "--image-size", "48", "--repeats", "2", "--out", str(plan),
                          "--json")
    assert code == 0, err
    result = json.loads(out)
    assert "ios" in result["dropped"] and "differ" in result["dropped"]["ios"]
    assert "ios dropped" in err
    assert result["plan_method"] != "ios" and result["max_error"] <= 1e-3
    saved = json.loads(plan.read_text())
    assert saved["options"]["measured_as"] == result["plan_method"]
    assert result["plan_method"].split("+")[0] == saved["method"]  # (+regions: the scheduler's plan, compiled)
    assert saved["options"]["chosen"]["name"] == result["chosen"]
    # the simplest of those that no other beats (the model itself first), and the noise it was judged by
    assert result["chosen"] == result["tie"][0] and min(result["measured_ms"], key=result["measured_ms"].get) in \
        result["tie"]
    assert 0.0 <= result["noise"]["same_program_spread"] < 1.0


def test_run_executes_the_configuration_the_plan_chose(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, _, err = _run(capsys, "optimize", "squeezenet", "--image-size", "48", "--repeats", "2", "--method",
                        "sequential", "--out", str(plan), "--json")
    assert code == 0, err
    doc = json.loads(plan.read_text())
    doc["options"]["chosen"] = {"name": "eager", "kind": "peer", "threads": 1}
    plan.write_text(json.dumps(doc))
    code, out, err = _run(capsys, "run", "squeezenet", "--image-size", "48", "--plan", str(plan), "--repeats", "2",
                          "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["chosen"] == "eager" and {"eager", doc["options"]["measured_as"]} <= set(result["measured_ms"])


@pytest.mark.parametrize("streams", [None, 3])
def test_lios_on_a_cpu_defaults_to_one_stream_per_core(capsys, tmp_path, streams):
    extra = ["--streams", str(streams)] if streams else []
    code, _, err = _run(capsys, "optimize", "squeezenet", "--image-size", "48", "--cost", "sim:v100", "--method",
                          "lios", "--out", str(tmp_path / "p.json"), "--json", *extra)
    assert code == 0, err
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["options"]["streams"] == (streams or 8)  # a simulated GPU keeps LIOS's 8 streams


def test_one_python_call_per_job_returns_what_the_command_reports(tmp_path, monkeypatch):
    import opsched
    import opsched.multi  # a subpackage shadows a lazy attribute of its name: the calls must not share one

    monkeypatch.setenv("OPSCHED_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(1, 3, 16, 16)
    result = opsched.optimize(model, (x,), method="ios", repeats=3)
    assert {"eager", "sequential", "ios"} <= set(result.measured_ms)
    ev = result.evaluation
    assert result.chosen == ev.tie[0] and min(result.measured_ms, key=result.measured_ms.get) in ev.tie
    plan = result.plan()
    assert plan.measured.chosen["name"] == result.chosen and plan.measured.measured_as in result.schedules
    plan.save(tmp_path / "plan.json")
    with torch.inference_mode():
        assert torch.allclose(result.module(x), model(x), atol=1e-5)  # the chosen configuration, called as the model
    mapped = opsched.map(model, (x,), platform="cpu2", method="heft", repeats=3)
    assert mapped.plan().kind == "mapping" and {"heft", "cpu0 alone", "eager"} <= set(mapped.measured_ms)
    simulated = opsched.map(model, (x,), platform="diviml", method="heft")
    assert simulated.evaluation is None and simulated.plan().devices.platform["name"] == "diviml"
    batch = opsched.optimize_batch([model, model], (x,), methods=["sequential"], repeats=3, cache=False)
    assert batch.plan().kind == "model batch" and batch.chosen in batch.measured_ms


def test_no_schedule_verified_names_why_for_the_other_graphs_schedules_too():
    from opsched.errors import VerificationError
    from opsched.jobs import require_a_plan
    from opsched.pipeline import Outcome

    x = torch.ones(3)

    def fails(why):
        def run():
            raise RuntimeError(why)
        return run

    ev = evaluate([Candidate("ios", fails("batched broke")), Candidate("hivemind+unbatched", fails("apart broke")),
                   Candidate("eager", lambda: x, "peer")], reference=x, repeats=3)
    outcome = Outcome(None, {"ios": None}, also={"+unbatched": Outcome(None, {"hivemind+unbatched": None})},
                      evaluation=ev)
    with pytest.raises(VerificationError, match="ios: .*batched broke.*hivemind\\+unbatched: .*apart broke"):
        require_a_plan(outcome)
