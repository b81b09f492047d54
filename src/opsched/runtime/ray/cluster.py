"""Joining a Ray cluster for the Ray engine: a local Ray started for a run, or the cluster at an address,
probed first; the errors it reports; which nodes a plan needs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from opsched.errors import OpschedError

NODE_RESOURCE = "opsched_node:"
NODE_SHARE = 0.01       # of a node's resource per actor: a node declaring 1 hosts up to 100 devices
CONNECT_SECONDS = 5.0   # for the address's port to answer
PROBE_SECONDS = 15.0    # for a Ray driver to connect there and list the cluster's resources
START_SECONDS = 120.0   # for every actor to be placed and to load its units
RUN_SECONDS = 60.0      # for one inference
PING_SECONDS = 2.0      # for an actor to say how it is, after a failure



class RayUnavailable(OpschedError):
    """Ray is not installed."""


class ClusterError(OpschedError):
    """No usable Ray: the address does not answer, a local Ray cannot start, or the cluster lacks a node of
    the plan."""


class DeviceFailed(RuntimeError):
    """A run on Ray failed; ``device`` names the device whose actor died, raised or did not finish (None when
    Ray failed otherwise)."""

    def __init__(self, device: str | None, what: str):
        super().__init__(f"device {device!r} {what}" if device else f"the run on Ray failed: {what}")
        self.device = device


class UnitError(RuntimeError):
    """Raised inside an actor, in one picklable line: a unit raised, or a value the call needed was never made
    because an earlier call of the same inference failed."""


def import_ray(local: bool = False) -> Any:
    """The ``ray`` module, or :class:`RayUnavailable` in one line. ``local``: Ray is about to be started on this
    machine for one run."""
    if local and "ray" not in sys.modules:
        # Unless told when it is imported that it runs on one machine, Ray advertises this machine's network
        # address and its servers listen on every interface; a Ray started for one run stays on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run sends no usage report
    # A failed run is reported once, by DeviceFailed: without this, every call downstream of the failure is
    # logged again when its reference is dropped.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--engine ray needs Ray, which is not installed: pip install 'opsched[ray]'") from None
    return ray


@contextlib.contextmanager
def ray_cluster(nodes: Sequence[str], cpus: int, address: str | None = None) -> Iterator[str]:
    """Ray for one run, yielding what it is: the cluster this process is already connected to (left as it
    is; ``address``, if given, must be its own), the cluster at ``address`` (disconnected after), or a Ray
    started here for the run, on loopback, declaring ``opsched_node:<node>`` for each of ``nodes`` and ``cpus``
    CPUs (shut down after, even on error). A cluster that lacks one of ``nodes`` is refused in one line
    (:class:`ClusterError`), before any actor is made."""
    ray = import_ray(local=address is None)
    if ray.is_initialized():
        connected = ray.get_runtime_context().gcs_address
        if address is not None and address not in (connected, "auto"):
            raise ClusterError(f"this process is connected to the Ray cluster at {connected}, not {address}")
        where = f"the Ray cluster at {connected}, which this process was connected to"
        check_nodes(ray.cluster_resources(), nodes, where)
        yield where
        return
    # CRITICAL: the engine reports a failure itself, in one line; Ray would log it again from its threads
    quiet = {"logging_level": logging.CRITICAL, "log_to_driver": False}
    if address is not None:
        where = f"the Ray cluster at {address}"
        check_nodes(probe(address), nodes, where)
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # noqa: BLE001 - connecting fails in many ways; one line for the user
            raise ClusterError(f"cannot connect to {where}: {first_line(e)}") from None
    else:
        where = "a local Ray started for the run"
        # Ray's memory monitor kills workers when the machine, not Ray, runs short of memory: in a Ray that
        # holds only this run's actors, it would end the run for what other programs use.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    try:
        if address is None:
            with _ctrl_c_held():
                try:
                    # "local": a new Ray even when this machine runs a cluster (ray start), whose nodes are the user's
                    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                             resources={NODE_RESOURCE + n: 1.0 for n in dict.fromkeys(nodes)}, **quiet)
                except Exception as e:  # noqa: BLE001 - Ray fails to start in many ways; one line for the user
                    raise ClusterError(f"could not start a local Ray: {first_line(e)}") from None
        yield where
    except BaseException as error:
        # The frames it came through hold Ray's objects: a channel read that Ctrl-C interrupted holds a buffer of
        # Ray's shared memory, whose release, once Ray was down, crashed the process (SIGSEGV, as the run ended).
        chained: BaseException | None = error
        while chained is not None:
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__context__
        raise
    finally:
        with _ctrl_c_held():
            ray.shutdown()  # also the processes of a start that failed


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C while Ray starts or shuts down, and raise it once that is over: Ray interrupted halfway leaves
    processes behind. Its start, say, has not yet recorded the processes it started, so that shutting it down
    cannot end them: the raylet's agents outlived an interrupted ``opsched run`` by a minute (measured). Signal
    handlers belong to the main thread: elsewhere, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            raise KeyboardInterrupt


_PROBE = """
import json, logging, sys
try:
    import ray
    ray.init(address=sys.argv[1], logging_level=logging.CRITICAL, log_to_driver=False)
    print(json.dumps({"resources": ray.cluster_resources()}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {str(e).strip()}"}))
"""


def probe(address: str, seconds: float = PROBE_SECONDS) -> dict[str, float]:
    """The resources of the Ray cluster at ``address``, asked by a child process once its port answers:
    ``ray.init`` retries an address that does not answer for minutes, printing from its C++ core on stderr,
    and a child process can be given a deadline and its output kept."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if colon and port.isdigit():  # HOST:PORT (``auto`` is found by Ray itself, and said by the probe)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as e:
            raise ClusterError(f"cannot reach a Ray cluster at {address}: {e.strerror or e}") from None
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address], check=False, capture_output=True,
                              text=True, timeout=seconds, env=env)
    except subprocess.TimeoutExpired as e:
        said = _last_ray_log(e.stderr.decode(errors="replace") if e.stderr else "")
        raise ClusterError(f"no Ray cluster answered at {address} within {seconds:g} s"
                           + (f" (Ray: {said})" if said else "")) from None
    lines = done.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {
        "error": first_line(done.stderr) if done.stderr.strip() else "the probe printed nothing"}
    if "error" in answer:
        raise ClusterError(f"cannot connect to a Ray cluster at {address}: {first_line(answer['error'])}")
    return answer["resources"]


def _last_ray_log(stderr: str) -> str:
    """The message of the last line Ray's C++ core logged (``[time W pid tid] file.cc:line: message``), which
    says why it keeps retrying: an authentication token missing, say."""
    lines = [line for line in stderr.splitlines() if line.startswith("[")]
    return lines[-1].split("] ", 1)[-1].split(": ", 1)[-1].strip() if lines else ""


def check_nodes(resources: dict[str, float], nodes: Sequence[str], where: str) -> None:
    """Refuse a cluster none of whose Ray nodes declares ``opsched_node:<node>`` for one of ``nodes``."""
    missing = [n for n in dict.fromkeys(nodes) if resources.get(NODE_RESOURCE + n, 0.0) < NODE_SHARE]
    if missing:
        declare = ", ".join(f'"{NODE_RESOURCE}{n}": 1' for n in missing)
        raise ClusterError(f"{where} has no Ray node for the plan's node(s) {', '.join(missing)}: start one "
                           f"for each with ray start --resources='{{{declare}}}'")


def first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
