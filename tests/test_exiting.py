"""A script that ends while a plan is built in the background exits as it should (src/opsched/exiting.py): the
build stops at its next measurement and the exit waits for it. Before, the daemon thread was abandoned inside
PyTorch and the process died with SIGABRT ("terminate called without an active exception")."""

import subprocess
import sys
import textwrap
import time

import pytest

from opsched.exiting import Stopped, start_background, stop_point

SCRIPT = textwrap.dedent("""
    import threading, torch
    from opsched.runtime.guarded import GuardedModule, PlanBuilder
    from opsched.timing import interleaved_samples

    measuring = threading.Event()
    a = torch.randn(768, 768)

    def matmul():  # inside PyTorch, the GIL released, nearly all the time
        measuring.set()
        for _ in range(4):
            torch.mm(a, a)

    class MeasuringForever(PlanBuilder):
        def build(self, model, inputs):
            interleaved_samples([matmul, matmul], repeats=10**6)
            raise AssertionError("the measurement was not stopped")

    model = torch.nn.Linear(4, 4)
    guarded = GuardedModule(model, MeasuringForever(), say=print)
    assert torch.equal(guarded(torch.ones(2, 4)), model(torch.ones(2, 4)))  # the model answers meanwhile
    assert measuring.wait(120)
    print("exiting", flush=True)
""")


@pytest.mark.parametrize("ending", ["", "raise SystemExit(3)"])
def test_exiting_while_a_plan_is_measured_in_the_background_stops_it_and_exits_normally(ending):
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", SCRIPT + ending], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == (3 if ending else 0), (run.returncode, run.stderr[-2000:])
    assert "exiting" in run.stdout and "built in the background" in run.stdout, run.stdout
    assert "terminate" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert time.perf_counter() - began < 120  # stopped, not measured to the end


def test_stop_points_raise_only_in_background_threads_once_exiting(monkeypatch):
    from opsched import exiting

    stop_point()  # not exiting: nothing
    monkeypatch.setattr(exiting._exiting, "is_set", lambda: True)
    stop_point()  # the main thread (running the exit itself) is never stopped
    raised = []

    def work():
        try:
            stop_point()
        except Stopped as e:
            raised.append(e)
            raise

    start_background(work, (), "test-stop-point").join()
    assert len(raised) == 1
    assert not exiting._running  # a thread that ended is forgotten
