"""A script that ends while a plan is built in the background exits as it should (src/opsched/exiting.py): the
build stops at its next measurement and the exit waits for it. Before, the daemon thread was abandoned inside
PyTorch and the process died with SIGABRT ("terminate called without an active exception")."""

import subprocess
import sys
import textwrap
import time

import pytest

from opsched.exiting import Stopped, start_background, stop_point

MEASURING = textwrap.dedent("""
    import threading, time, torch
    from opsched.runtime.guarded import GuardedModule, Plan, PlanBuilder
    from opsched.runtime.guards import call_signature
    from opsched.timing import interleaved_samples

    measuring = threading.Event()
    a = torch.randn(768, 768)

    def matmul():  # inside PyTorch, the GIL released, nearly all the time
        measuring.set()
        for _ in range(4):
            torch.mm(a, a)

    class MeasuringForever(PlanBuilder):
        def build(self, model, inputs):
            if inputs[0].shape[0] == 3:  # asked for once the exit began: made at once (the model answers)
                return Plan(call_signature(inputs), inputs, None, "eager", note="made during the exit")
            interleaved_samples([matmul, matmul], repeats=10**6)
            raise AssertionError("the measurement was not stopped")

    model = torch.nn.Linear(4, 4)
    guarded = GuardedModule(model, MeasuringForever(), say=print)
    assert torch.equal(guarded(torch.ones(2, 4)), model(torch.ones(2, 4)))  # the model answers meanwhile
    assert measuring.wait(120)
""")

# a user's own thread, which the interpreter waits for: measuring when the exit begins, it is not stopped
USERS_THREAD = textwrap.dedent("""
    import threading, torch
    from opsched.timing import interleaved_samples

    a = torch.randn(256, 256)
    started = threading.Event()

    def measure():
        started.set()
        interleaved_samples([lambda: torch.mm(a, a)] * 2, repeats=200)
        print("measured to the end", flush=True)

    threading.Thread(target=measure).start()
    started.wait()
""")


def _run(script):
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("ending", ["", "raise SystemExit(3)"])
def test_exiting_while_a_plan_is_measured_in_the_background_stops_it_and_exits_normally(ending):
    script = MEASURING + 'print("exiting at", time.time(), flush=True)\n' + ending
    run = _run(script)
    ended = time.time()
    assert run.returncode == (3 if ending else 0), (run.returncode, run.stderr[-2000:])
    assert "built in the background" in run.stdout, run.stdout
    assert "terminate" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    exiting_at = float(run.stdout.split("exiting at")[1].split()[0])
    assert ended - exiting_at < 60  # stopped within a sample (a few ms), not measured to the end (never)


def test_a_call_made_while_the_interpreter_exits_builds_its_plan_in_the_callers_thread():
    # from an atexit handler: the builder is stopping, so a plan asked for then is made at once, never queued
    # for a builder that is gone (wait_for_builds would wait forever)
    script = MEASURING + textwrap.dedent("""
        import atexit
        def at_exit():
            x = torch.ones(3, 4)
            assert torch.equal(guarded(x), model(x))
            guarded.wait_for_builds(timeout=30)
            print("at exit:", guarded.plans[call_signature((x,))].note, flush=True)
        atexit.register(at_exit)
    """)
    run = _run(script)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "at exit: made during the exit" in run.stdout, (run.stdout, run.stderr[-2000:])


def test_a_users_own_thread_measuring_at_exit_is_not_stopped():
    run = _run(USERS_THREAD)
    assert (run.returncode, run.stdout) == (0, "measured to the end\n"), run.stderr[-2000:]


def test_stop_points_raise_only_in_background_threads_once_exiting(monkeypatch):
    import threading

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

    users = threading.Thread(target=work)  # a user's thread: not stopped
    users.start()
    users.join()
    assert raised == []
    thread = start_background(work, (), "test-stop-point")
    thread.join()
    assert len(raised) == 1
    assert thread not in exiting._running  # a thread that ended is forgotten
