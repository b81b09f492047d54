"""The Ray engine (``opsched run --engine ray``) under soak, load, Ctrl-C and faults."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from opsched.compare import compare_outputs
from opsched.graph.ir import Graph
from support.fault_trials import MODEL_FILE, is_json
from support.map_trials import mapped_module_plan
from support.process_watch import descendants, open_descriptors, process_table, session_processes, soak, still_alive
from support.small_models import HANG_SECONDS, call_with_deadline

# two 1-thread CPU devices on two nodes, as docs/ray.md runs GoogLeNet; ray_cluster declares both on this machine
TWO_NODES = {"devices": [{"name": "cpu0", "kind": "cpu", "node": "n0", "threads": 1},
                         {"name": "cpu1", "kind": "cpu", "node": "n1", "threads": 1}],
             "links": {"default": {"bandwidth": "inf", "latency": 0}}}
FORMS = {"compiled-graph": True, "remote-calls": False}  # RayModule(compiled=...)


def ray_case(directory: Path, name: str = "branches") -> tuple[torch.nn.Module, Graph, tuple, Any, list[str]]:
    """A model as ``opsched run`` loads it, GoogLeNet at 64x64 or :data:`MODEL_FILE`'s CNN of three branches
    (written to ``directory``), with a HEFT plan of it on :data:`TWO_NODES` saved there: the model, its graph, its
    inputs, the plan, and what ``opsched run`` is given to run that plan."""
    from opsched.commands.common import load_and_capture

    if name == "googlenet":
        spec, image = "torchvision:googlenet", 64
    else:
        (directory / "branches.py").write_text(MODEL_FILE)
        spec, image = f"{directory / 'branches.py'}:make", None
    loaded, graph, _, _ = load_and_capture(argparse.Namespace(batch=None, input_shape=None, image_size=image), spec,
                                           "cpu")
    plan = mapped_module_plan(graph, "heft", platform=TWO_NODES)
    plan.save(directory / "ray-plan.json")
    argv = [spec, *(["--image-size", str(image)] if image else []), "--plan", str(directory / "ray-plan.json")]
    return loaded.model, graph, tuple(loaded.inputs), plan, argv


def actor_pids(module: Any) -> list[int]:
    """The process ids of a RayModule's actors, as each says."""
    import ray

    return [ray.get(actor.status.remote())[0] for actor in module.actors]


def ray_soak(model: torch.nn.Module, graph: Graph, inputs: tuple, plan: Any, calls: int, warmup: int,
             modules: int = 0) -> dict[str, Any]:
    """:func:`soak` of a RayModule in each form, outputs compared with ``model``'s and the actors followed, then
    ``modules`` more modules made, called once and closed, with this process's descriptors before and after; all on
    a local Ray started here by ``ray_cluster``, and then whether any process of that Ray is left once it is shut
    down."""
    from opsched.runtime.ray import RayModule, ray_cluster

    results: dict[str, Any] = {}
    with ray_cluster(["n0", "n1"], cpus=4):
        for form, compiled in FORMS.items():
            make = functools.partial(RayModule, graph, plan, compiled=compiled)
            results[form] = soak(make, inputs, calls=calls, warmup=warmup, reference=model, processes=actor_pids)
            fds_before = open_descriptors()
            for _ in range(modules):
                with make() as module, torch.inference_mode():
                    module(*inputs)
            gc.collect()
            results[form]["modules_made_and_closed"] = {"modules": modules, "fds_before": fds_before,
                                                        "fds_after": open_descriptors()}
        ray_processes = descendants(os.getpid())
    results["ray_processes"] = sorted(set(ray_processes.values()))
    results["ray_processes_left"] = sorted(ray_processes[p] for p in still_alive(ray_processes))
    return results


# What /proc names a process by (its first 15 characters), for the moments of a run on Ray a signal can find
RAY_MOMENTS = {"ray": "ray::RuntimeEnv", "actors": "ray::DeviceWork", "graph": "ray::DAGDriverP"}


def ray_interrupt_trial(directory: Path, run_args: Sequence[str], at: float | str | None, repeats: int = 5
                        ) -> dict[str, Any]:
    """Start ``opsched run RUN_ARGS --engine ray`` (a local Ray started for the run) in a session of its own and
    send SIGINT ``at`` seconds after the start, or once a process of the kind :data:`RAY_MOMENTS` names for ``at``
    appears (``ray``: the local Ray is starting, the raylet's agents up; ``actors``: a device's actor; ``graph``: the
    compiled graph is built, the measured runs follow), or never (None). Check: exit 130 with the one line
    ``opsched: interrupted`` (or 0 with its JSON when it finished first), no traceback, no hang, and no process of
    its session left (Ray's daemons, agents and workers; pgrep's raylet and gcs_server of the session too)."""
    argv = [sys.executable, "-m", "opsched", "run", *run_args, "--engine", "ray", "--repeats", str(repeats), "--json"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: set[str] = set()
    signalled = None
    while proc.poll() is None and signalled is None:
        seen.update(session_processes(proc.pid).values())
        elapsed = time.perf_counter() - started
        if (isinstance(at, float) and elapsed >= at) or (isinstance(at, str) and RAY_MOMENTS[at] in seen):
            proc.send_signal(signal.SIGINT)
            signalled = elapsed
        time.sleep(0.02)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"at": at, "hung": True, "stderr": stderr[-500:]}
    seconds = time.perf_counter() - started
    left = session_processes(proc.pid)
    later = still_alive(left, seconds=10.0)
    moment = next((m for m in ("graph", "actors", "ray") if RAY_MOMENTS[m] in seen), "before ray")
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {"at": at, "signal_after_s": None if signalled is None else round(signalled, 2), "moment": moment,
            "exit": proc.returncode, "seconds": round(seconds, 2), "stderr": lines[:3], "stderr_lines": len(lines),
            "traceback": "Traceback" in stderr, "hung": False, "stdout_json": is_json(stdout),
            "left_at_exit": sorted(left.values()), "left_after_10s": sorted(left[p] for p in later),
            "ray_daemons_left": _ray_daemons(proc.pid)}


def _ray_daemons(session: int) -> list[int]:
    """The process ids of the raylets and gcs_servers alive in the session ``session`` (pgrep; zombies left out:
    they have ended, their parent has yet to collect them)."""
    done = subprocess.run(["pgrep", "-s", str(session), "-f", "raylet|gcs_server"], capture_output=True, text=True,
                          check=False)
    return sorted({int(p) for p in done.stdout.split()} & set(process_table()))


def failing_unit(run: Callable[..., Any], on_call: int) -> Callable[..., Any]:
    """A unit's callable ``run``, raising on its ``on_call``-th call. A closure, which Ray pickles by value: shipped
    to an actor, where this script cannot be imported, it counts the calls made there."""
    calls = [0]

    def unit(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == on_call:
            raise RuntimeError("The size of tensor a (28) must match the size of tensor b (27)")
        return run(*args)

    return unit


def ray_fault_trial(model: torch.nn.Module, graph: Graph, inputs: tuple, plan: Any, unit: str, compiled: bool,
                    on_call: int = 3) -> dict[str, Any]:
    """A RayModule (on the connected Ray) whose unit ``unit`` raises on its ``on_call``-th call: the calls before
    must equal eager, that one raise one DeviceFailed naming the unit's device and the unit, a later call raise it
    again at once, the actors end, and a new RayModule of the plan then give eager's outputs."""
    from opsched.runtime.ray import DeviceFailed, RayModule

    k = graph.index[unit]
    faulty = copy.copy(graph)
    faulty.nodes = tuple(dataclasses.replace(n, run=failing_unit(n.run, on_call)) if i == k else n
                         for i, n in enumerate(graph.nodes))
    device = plan.devices.devices[next(op.stream for op in plan.ops if op.name == unit)].name
    with torch.inference_mode():
        want = model(*inputs)
    # the failing unit is Python code, which the rewrite for reordered convolutions cannot read: eager kernels
    plan = dataclasses.replace(plan, unit_kernels={n.name: "eager" for n in graph.nodes})
    module = RayModule(faulty, plan, compiled=compiled, run_seconds=20)
    pids = actor_pids(module)
    right = 0
    error: Exception | None = None
    started = time.perf_counter()
    try:
        for _ in range(on_call):
            right += compare_outputs(call_with_deadline(module, inputs), want).ok
    except DeviceFailed as e:
        error = e
    failed_after = time.perf_counter() - started
    try:
        call_with_deadline(module, inputs)
        again = "returned"
    except DeviceFailed as e:
        again = "DeviceFailed" if str(e) == str(error) else f"DeviceFailed: {e}"
    module.close()
    with RayModule(graph, plan, compiled=compiled) as fresh:
        fresh_right = compare_outputs(call_with_deadline(fresh, inputs), want).ok
    return {"form": "compiled-graph" if compiled else "remote-calls", "unit": unit, "device": device,
            "right_before": right, "error": None if error is None else str(error),
            "named": error is not None and error.device == device and f"unit {unit!r}" in str(error)
            and "\n" not in str(error), "seconds_to_fail": round(failed_after, 2), "later_call": again,
            "actors_left": len(still_alive(pids)), "new_module_right": fresh_right}
