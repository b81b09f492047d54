"""PyTorch's chatter silenced on one thread only (opsched.quiet): a capture or ONNX export on a background build's
thread once dropped, for as long as it ran, every other thread's warnings, torch logs and error output (a
process-wide warnings filter, logger levels, file descriptor 2 on /dev/null)."""

import logging
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

from opsched import quiet
from opsched.quiet import this_thread_quiet
from opsched.runtime.kernels import onnx_bytes


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _chatter(who: str) -> None:
    warnings.warn(f"warning from {who}")
    logging.getLogger("torch._dynamo").warning("torch log from %s", who)
    sys.stderr.write(f"stderr from {who}\n")


def _chatter_while_quiet_elsewhere(quiet_threads: int) -> None:
    """``quiet_threads`` threads each chatter inside this_thread_quiet while this one chatters, then leave it in
    the order they entered it."""
    entered = [threading.Event() for _ in range(quiet_threads)]
    leave = [threading.Event() for _ in range(quiet_threads)]

    def quiet(k):
        with this_thread_quiet():
            _chatter(f"quiet thread {k}")
            entered[k].set()
            leave[k].wait(10)
            _chatter(f"quiet thread {k}")

    threads = [threading.Thread(target=quiet, args=(k,)) for k in range(quiet_threads)]
    for thread, event in zip(threads, entered):
        thread.start()
        assert event.wait(10)
    _chatter("the main thread")
    for thread, event in zip(threads, leave):
        event.set()
        thread.join(10)
        _chatter("the main thread")


def test_a_quiet_thread_drops_its_own_chatter_and_no_other_threads(capfd):
    kept = _Kept()
    logging.getLogger("torch._dynamo").addHandler(kept)
    stderr = sys.stderr
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _chatter_while_quiet_elsewhere(quiet_threads=2)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(kept)
    assert sys.stderr is stderr  # given back once the last quiet thread left, whichever order they left in
    assert [str(w.message) for w in seen] == ["warning from the main thread"] * 3
    assert kept.messages == ["torch log from the main thread"] * 3
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "quiet thread" in line or line.startswith("stderr")] == [
        "stderr from the main thread"] * 3  # (torch's own handler writes the logs there too)


@pytest.mark.parametrize("parent", ["torch", "torch._dynamo"])
def test_a_torch_logger_made_while_a_thread_is_quiet_is_quiet_there_too(parent):
    # torch.export's first run imports modules that make loggers: they have no filter of their own yet. A handler
    # above them (torch's own, on the torch logger and on each log torch registers, or one a user adds to keep
    # torch's logs in a file) still drops their records
    kept = _Kept()
    logging.getLogger(parent).addHandler(kept)
    child = f"{parent}.opsched_test.made_while_quiet"
    try:
        with this_thread_quiet():
            logging.getLogger(child).warning("a record from a logger made meanwhile")
        logging.getLogger(child).warning("one once the thread is not quiet")
    finally:
        logging.getLogger(parent).removeHandler(kept)
    assert kept.messages == ["one once the thread is not quiet"]


def test_a_process_without_stderr_is_left_without_it(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, some daemons
    with this_thread_quiet():
        warnings.warn("dropped")
    assert sys.stderr is None


def test_an_error_filter_does_not_reach_a_quiet_thread():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error, or pytest's filterwarnings = error
        with this_thread_quiet():
            warnings.warn("the exporter's note")  # dropped, not raised
        try:
            warnings.warn("the user's own")
        except UserWarning:
            pass
        else:
            raise AssertionError("the user's warning filter was not applied once the thread was no longer quiet")


class _Unexportable(torch.nn.Module):
    def forward(self, x):
        return torch.special.airy_ai(x)


FAILED_EXPORT = textwrap.dedent("""
    import torch
    from opsched.runtime.kernels import onnx_bytes

    class Unexportable(torch.nn.Module):
        def forward(self, x):
            return torch.special.airy_ai(x)  # no ONNX symbol: the exporter prints the graph, then raises

    try:
        onnx_bytes(Unexportable(), (torch.randn(3),))
    except Exception as e:
        print("raised:", "airy_ai" in str(e), flush=True)
    torch._C._jit_onnx_log("the log, from a thread not exporting")
""")


def test_a_failed_export_prints_nothing_and_the_exporters_log_is_left_to_other_callers():
    # in a process of its own: the exporter's log goes through C++'s buffered standard output, seen at exit
    done = subprocess.run([sys.executable, "-c", FAILED_EXPORT], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["raised: True", "the log, from a thread not exporting"]
    assert done.stderr == ""


def test_after_an_export_this_thread_warns_logs_and_writes_to_stderr_again(capfd):
    stderr = sys.stderr
    with pytest.raises(Exception, match="airy_ai"):
        onnx_bytes(_Unexportable(), (torch.randn(3),))
    assert sys.stderr is stderr and not quiet._quiet
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("always", append=True)  # last: a filter the export left behind would still win
        warnings.warn("after the export")
    assert [str(w.message) for w in seen] == ["after the export"]
    logging.getLogger("torch._dynamo").warning("torch log after the export")  # torch's own handler: stderr
    sys.stderr.write("sys.stderr after the export\n")
    os.write(2, b"fd 2 after the export\n")
    err = capfd.readouterr().err
    assert "torch log after the export" in err and "sys.stderr after the export\n" in err, err
    assert "fd 2 after the export\n" in err, err
