"""``opsched map`` under bad input and limits: random platforms, mapping DAGs and hand-edited mapped plans; Ctrl-C
and time limits of the solvers; mapped plans to run."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsched.graph.ir import Graph
from opsched.schedule import ScheduleError
from support.fault_trials import is_json
from support.process_watch import session_processes
from support.small_models import HANG_SECONDS

MAP_METHODS = ("best-device", "met", "greedy", "heft", "sa", "ea", "milp", "milp-split")


def cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """``opsched ARGV`` in this process (the command line's own ``main``): exit status, stdout, stderr."""
    from opsched.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse refusing an option exits; nothing else should
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_refused(code: int, out: str, err: str, what: Any = "") -> None:
    """Bad input: exit 2, nothing on stdout, exactly one line on stderr, no traceback."""
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("opsched: error: ") \
        and "Traceback" not in err, (what, code, out[:200], err[-2000:])


def mapping_problem(dag: Path, platform: Path, objective: str = "latency", batch: int = 1) -> Any:
    """The problem ``opsched map DAG --platform PLATFORM`` solves, built as the command builds it."""
    from opsched.mapping import graphfile
    from opsched.mapping.platform import load_platform
    from opsched.mapping.problem import build_problem

    graph, latencies, edge_bytes = graphfile.read(str(dag))
    return build_problem(graph, load_platform(str(platform)), objective, batch, latencies or None, edge_bytes or None)


def rounding(problem: Any) -> float:
    """How far a proven-optimal MILP may be above the true optimum: CP-SAT works on times rounded to steps of
    about 1e-6 of the longest possible schedule, one rounding per job and transfer."""
    horizon = sum(max(t for row in problem.times[u] for t in row if math.isfinite(t)) for u in range(problem.n))
    horizon += sum(max((problem.comm(a, b, x, y, 1) for x in range(problem.devices) for y in range(problem.devices)),
                       default=0.0) for a, b in problem.graph.edges)
    return 1e-9 + 1e-6 * horizon * (problem.n * problem.pieces + len(problem.graph.edges))


def check_mapped(result: dict[str, Any], problem: Any) -> None:
    """What ``opsched map --json`` printed is a valid mapping of ``problem``: every piece of every unit placed
    once (``mapping.plan.check``), on each device one job at a time, each job after its inputs have arrived
    (transfer times included, from the printed times, independent of the simulator), and ``predicted`` and
    every printed time equal to the replay of that mapping; the lower bound is below its makespan."""
    from opsched.mapping.plan import Job, Mapping, check
    from opsched.mapping.replay import replay

    graph, names = problem.graph, problem.platform.names
    per_piece = problem.batch // problem.pieces
    pieces: dict[tuple[int, int, float, float], list[int]] = {}
    for p in result["placements"]:
        first, count = p["inputs"]
        key = (graph.index[p["name"]], names.index(p["device"]), p["start"], p["finish"])
        pieces.setdefault(key, []).extend(range(first // per_piece, (first + count) // per_piece))
    times = {Job(u, d, tuple(sorted(qs))): (s, f) for (u, d, s, f), qs in pieces.items()}
    order: list[list[Job]] = [[] for _ in names]
    for job in sorted(times, key=lambda j: (times[j], j.unit)):
        order[job.device].append(job)
    mapping = Mapping(order)
    check(problem, mapping)
    timeline = replay(problem, mapping)
    tolerance = 1e-9 * max(1.0, timeline.makespan)
    for job, (s, f) in times.items():
        assert abs(timeline.start[job] - s) <= tolerance and abs(timeline.finish[job] - f) <= tolerance, job
    assert abs(result["makespan"] - timeline.makespan) <= tolerance, (result["makespan"], timeline.makespan)
    assert result["predicted"] == problem.objective_value(timeline.makespan), result["predicted"]
    job_of = {(j.unit, q): j for j in times for q in j.pieces}
    for a, b in graph.edges:
        for q in range(problem.pieces):
            ja, jb = job_of[(a, q)], job_of[(b, q)]
            arrives = times[ja][1] + problem.comm(a, b, ja.device, jb.device, 1)
            assert times[jb][0] >= arrives - tolerance, (graph.nodes[a].name, graph.nodes[b].name, q)
    for jobs in order:
        for x, y in itertools.pairwise(jobs):
            assert times[y][0] >= times[x][1] - tolerance, (x, y)
    assert result["lower_bound"] <= timeline.makespan + tolerance, (result["lower_bound"], timeline.makespan)


# A small DAG for the platform documents: plain latencies (times each device's scale), edge bytes, and 100 bytes
# of memory per unit, so that memory budgets, bandwidths and link latencies all matter.
PLATFORM_DAG = {"nodes": [{"name": "a", "latency": 2.0, "bytes": 100}, {"name": "b", "latency": 3.0, "bytes": 100},
                          {"name": "c", "latency": 1.5, "bytes": 100}, {"name": "d", "latency": 2.5, "bytes": 100}],
                "edges": [["a", "b", 40], ["a", "c", 10], ["b", "d", 25], ["c", "d"]]}
PLATFORM_DEFECTS = ("none", "none", "none", "none", "missing_name", "duplicate_name", "bad_name", "kind", "memory",
                    "bandwidth", "latency", "threads", "batch_sizes", "scale", "op_overhead", "unknown_link", "disconnected",
                    "links_type", "link_value", "devices_type", "device_type", "top_level", "truncate", "extra")
ODD_NUMBERS = (-1, 0, -0.5, "2", "fast", None, True, [], {}, float("nan"), float("inf"), float("-inf"), 1e-300)


def platform_document(seed: int) -> tuple[str, str]:
    """PLATFORM.json text and the defect put in: mostly well formed (1-4 devices; kinds, memory, threads, batch
    sizes, scales, nodes, links by pair, by node class and by default), some with one defect, some any JSON.
    Every choice comes from ``seed`` (hypothesis draws the seeds: each defect and odd value equally often)."""
    rng = random.Random(seed)
    if rng.random() < 0.05:
        return json.dumps(_any_json(rng, 3)), "any"
    count = rng.randint(1, 4)
    devices: list[Any] = []
    for i in range(count):
        device: dict[str, Any] = {"name": f"d{i}"}
        for key, values in (("kind", ["cpu", "sim:a100", "sim:t4", "sim:xeon"]), ("memory", [1e3, 1e6, "inf", 400]),
                            ("threads", [1, 2, 4]), ("batch_sizes", [[1], [1, 2, 4]]), ("scale", [0.5, 1, 3]),
                            ("node", ["n0", "n1"])):
            if rng.random() < 0.5:
                device[key] = rng.choice(values)
        devices.append(device)
    link = {"bandwidth": rng.choice([1, 10, 1e9, "inf"]), "latency": rng.choice([0, 0.5, 2])}
    links: dict[str, Any] = {}
    style = rng.choice(["default", "pairs", "classes"])
    if style == "default":
        links["default"] = link
    elif style == "classes":
        links.update({"intra-node": link, "inter-node": {**link, "latency": 1}})
    else:
        links.update({f"d{i}-d{j}": link for i in range(count) for j in range(i + 1, count)})
    doc: Any = {"name": "fuzz", "devices": devices, "links": links}
    defect = rng.choice(PLATFORM_DEFECTS)
    target = rng.choice(devices)
    if defect == "missing_name":
        del target["name"]
    elif defect == "duplicate_name":
        target["name"] = devices[0]["name"]
    elif defect == "bad_name":
        target["name"] = rng.choice(["", 3, None, ["d0"]])
    elif defect == "kind":
        target["kind"] = rng.choice(["gpu", "sim:nope", "cuda:x", "cuda:", "CPU", "", 3, None, ["cpu"]])
    elif defect in ("memory", "threads", "scale"):
        target[defect] = rng.choice([*ODD_NUMBERS, 1.5, 10**30])
    elif defect == "op_overhead":  # valid on a simulated device only
        target[defect] = rng.choice([*ODD_NUMBERS, 0.02])
    elif defect == "batch_sizes":
        target[defect] = rng.choice([[], [0], [-4], "4", [1.5], [True], [2], 4, None])
    elif defect in ("bandwidth", "latency"):
        key = rng.choice(sorted(links) or ["default"])  # one device by pairs has no link
        links[key] = {**links.get(key, link), defect: rng.choice(ODD_NUMBERS)}
        if rng.random() < 0.2:
            del links[key][defect]
    elif defect == "unknown_link":
        links[rng.choice(["d0-ghost", "ghost-d0", "d0d1", "d0-d0", "-", "", "d0-d1-d2"])] = link
    elif defect == "disconnected":
        links.clear()
        if rng.random() < 0.5:
            links["d0-d1"] = link
    elif defect == "links_type":
        doc["links"] = rng.choice([[], "default", 3, None, [link]])
    elif defect == "link_value":
        links[rng.choice(sorted(links) or ["default"])] = rng.choice([3, {}, {"latency": 1}, [], None, "fast"])
    elif defect == "devices_type":
        doc["devices"] = rng.choice([[], {}, "d0", None, 3])
    elif defect == "device_type":
        devices[rng.randrange(count)] = rng.choice(["d0", 3, None, [], True])
    elif defect == "top_level":
        doc = rng.choice([[doc], "platform", 3, None, True])
    elif defect == "extra":
        target[rng.choice(["colour", "speed"])] = rng.choice([1, "x", None])
    text = json.dumps(doc)
    if defect == "truncate":
        text = text[:rng.randrange(len(text))]
    return text, defect


def _any_json(rng: random.Random, depth: int) -> Any:
    """Any JSON value, at most ``depth`` deep; objects' keys mostly a platform's or a plan's."""
    kind = rng.randrange(7 if depth > 0 else 5)
    if kind < 5:
        return [None, rng.random() < 0.5, rng.randint(-3, 10**6), rng.uniform(-1e6, 1e6), "d0"][kind]
    if kind == 5:
        return [_any_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["devices", "links", "name", "default", "x"]): _any_json(rng, depth - 1)
            for _ in range(rng.randint(0, 3))}


def check_platform_document(text: str, directory: Path, method: str = "heft", subprocess_too: bool = False) -> str:
    """Map :data:`PLATFORM_DAG` onto the platform ``text`` through the command line: exit 0 with a valid mapping
    (:func:`check_mapped`), or exit 2 with one line; never a traceback. Returns "mapped" or "refused"."""
    dag, platform = directory / "platform-dag.json", directory / "platform.json"
    dag.write_text(json.dumps(PLATFORM_DAG))
    platform.write_text(text)
    argv = ["map", str(dag), "--platform", str(platform), "--method", method, "--time-limit", "1", "--json"]
    code, out, err = cli(argv)
    if subprocess_too:  # the real executable agrees with the in-process entry
        done = subprocess.run([sys.executable, "-m", "opsched", *argv], capture_output=True, text=True,
                              timeout=HANG_SECONDS, check=False)
        assert (done.returncode, done.stderr) == (code, err), (done.returncode, done.stderr, code, err)
    if code != 0:
        assert_refused(code, out, err, text)
        return "refused"
    check_mapped(json.loads(out), mapping_problem(dag, platform))
    return "mapped"


MAPPING_DAG_DEFECTS = ("none", "none", "none", "none", "none", "missing_device", "unknown_device", "empty_latency",
                       "latency_value", "latency_type", "bytes_value", "cycle", "self_loop", "edge_shape",
                       "unknown_edge", "node_bytes")


def mapping_case(seed: int, max_units: int = 7) -> dict[str, Any]:
    """A DAG JSON for mapping (latency objects per device, or a plain latency; edge bytes on some edges), its
    platform (2-3 devices), an objective and batch, and at most one defect, recorded in ``defect`` (only when
    it was put in: a defect that needs something the graph lacks is left out). Every choice comes from ``seed``."""
    rng = random.Random(seed)
    devices = ["x", "y", "z"][:rng.randint(2, 3)]
    platform = {"devices": [{"name": d} for d in devices],
                "links": {"default": {"bandwidth": rng.choice([1, 2, 4]), "latency": rng.choice([0, 0.5, 1])}}}
    names = [f"v{i}" for i in range(rng.randint(1, max_units))]
    nodes: list[Any] = []
    for name in names:
        if rng.random() < 0.2:
            nodes.append({"name": name, "latency": rng.randint(0, 48) / 4})
        else:
            nodes.append({"name": name, "latency": {d: rng.randint(0, 48) / 4 for d in devices}})
    edges: list[Any] = []
    for j, b in enumerate(names):
        for a in names[:j]:
            if rng.random() < 0.35:
                edges.append([a, b] + ([rng.randint(0, 10)] if rng.random() < 0.5 else []))
    objective, batch = rng.choice([("latency", 1)] * 3 + [("throughput", 4), ("throughput", 8)])
    defect = rng.choice(MAPPING_DAG_DEFECTS)
    per_device = [n for n in nodes if isinstance(n["latency"], dict)]
    applied = defect
    if defect == "missing_device" and per_device:
        del rng.choice(per_device)["latency"][rng.choice(devices)]
    elif defect == "unknown_device" and per_device:
        rng.choice(per_device)["latency"]["w"] = 1.0
    elif defect == "empty_latency":
        rng.choice(nodes)["latency"] = {}
    elif defect == "latency_value" and per_device:
        rng.choice(per_device)["latency"][rng.choice(devices)] = rng.choice(
            [-1, "fast", None, True, [], float("nan"), float("inf")])
    elif defect == "latency_type":
        rng.choice(nodes)["latency"] = rng.choice([[1, 2], "fast", None, -3, float("nan")])
    elif defect == "bytes_value" and edges:
        rng.choice(edges)[2:] = [rng.choice([-1, "many", None, True, [], float("nan"), float("inf")])]
    elif defect == "cycle" and edges:
        a, b = rng.choice(edges)[:2]
        edges.append([b, a] + ([3] if rng.random() < 0.5 else []))
    elif defect == "self_loop":
        edges.append([names[0], names[0], 1])
    elif defect == "edge_shape":
        edges.append(rng.choice([[names[0]], [names[0], names[-1], 1, 2], f"{names[0]}->{names[-1]}", [1, 2, 3],
                                 None]))
    elif defect == "unknown_edge":
        edges.append([names[0], "ghost", 3])
    elif defect == "node_bytes":
        rng.choice(nodes)["bytes"] = rng.choice([-5, "lots", None, float("nan"), float("inf")])
    else:
        applied = "none"
    return {"dag": {"nodes": nodes, "edges": edges}, "platform": platform, "objective": objective, "batch": batch,
            "defect": applied}


def check_mapping_case(case: dict[str, Any], directory: Path, methods: Sequence[str] = MAP_METHODS,
                       time_limit: float = 0.5) -> dict[str, Any]:
    """A defective case is refused in one line; a well-formed one maps with every method in ``methods``, and the
    answers hold: each mapping valid with ``predicted`` its replay (:func:`check_mapped`), every lower bound
    below every method's makespan, no method below one proven optimal, ``optimal`` claimed only by the MILPs
    (the MILP's only when CP-SAT's status is OPTIMAL). Returns what happened, for the counts."""
    dag, platform = directory / "map-dag.json", directory / "map-platform.json"
    dag.write_text(json.dumps(case["dag"]))
    platform.write_text(json.dumps(case["platform"]))
    argv = ["map", str(dag), "--platform", str(platform), "--objective", case["objective"], "--batch",
            str(case["batch"]), "--time-limit", str(time_limit), "--json", "--method"]
    if case["defect"] != "none":
        assert_refused(*cli([*argv, methods[0]]), case)
        return {"refused": 1}
    problem = mapping_problem(dag, platform, case["objective"], case["batch"])
    results = {}
    for method in methods:
        code, out, err = cli([*argv, method])
        assert code == 0, (method, case, code, err)
        results[method] = json.loads(out)
        check_mapped(results[method], problem)
    best = min(r["makespan"] for r in results.values())
    slack = rounding(problem)
    proven = 0
    for method, r in results.items():
        assert r["lower_bound"] <= best + slack, (method, r["lower_bound"], best)
        if r["optimal"]:
            proven += 1
            assert method in ("milp", "milp-split") and r["makespan"] <= best + slack, (method, r["makespan"], best)
            assert method != "milp" or r["stats"]["status"] == "OPTIMAL", r["stats"]
    return {"mapped": 1, "proven_optimal": proven, "answers": len(results)}


# Hand edits of a mapped plan (``opsched map MODEL --out plan.json``), as for plans above but for what a mapped plan
# adds in its devices section: the platform's devices (stream k runs on device k), their kinds and threads, the
# transfers, the jobs of a split batch and the figures.
MAPPED_MUTATIONS = ("drop_op", "duplicate_op", "stream", "move_op", "device_name", "platform_devices", "device_kind",
                    "device_threads", "time", "format", "truncate", "split_batch", "section", "options",
                    "transfers", "figures", "batch", "fingerprint")


def mutate_mapped(doc: dict[str, Any], rng: random.Random, kind: str) -> str:
    """Edit a mapped plan's JSON by hand as a user might (or break it); return the text to load."""
    doc = json.loads(json.dumps(doc))
    ops, section = doc["ops"], doc["devices"]
    listed = section["platform"]["devices"]
    names = [d["name"] for d in listed]
    if kind == "drop_op":
        ops.pop(rng.randrange(len(ops)))
    elif kind == "duplicate_op":
        ops.append(dict(rng.choice(ops)))
    elif kind == "stream":
        rng.choice(ops)["stream"] = rng.choice([-1, len(listed), len(listed) + 1, len(ops) - 1, len(ops), 10**12,
                                                "1", 1.5, None])
    elif kind == "move_op":  # onto another device, its times kept
        rng.choice(ops)["stream"] = rng.randrange(len(listed))
    elif kind == "device_name":
        new = rng.choice(["gpu9", names[0], names[-1], "", 3, None])
        if rng.random() < 0.5 or not section["transfers"]:
            rng.choice(listed)["name"] = new
        else:
            rng.choice(section["transfers"])[rng.choice(["from_device", "to_device"])] = new
    elif kind == "platform_devices":
        section["platform"]["devices"] = rng.choice([listed[:-1], [], None, listed[0], listed + [dict(listed[0])],
                                                     [1, 2], listed[::-1]])
    elif kind == "device_kind":
        rng.choice(listed)["kind"] = rng.choice(["sim:a100", "sim:t4", "cuda:0", None, "tpu", 3, "cpu"])
    elif kind == "device_threads":
        rng.choice(listed)["threads"] = rng.choice([0, -1, "x", 10**9, 1.5, 2, True, None, {"cpu0": 1}])
    elif kind == "time":
        op = rng.choice(ops)
        op[rng.choice(["start", "finish"])] = rng.choice([-5.0, 0.0, float("nan"), float("inf"), 1e308, "x", None])
    elif kind == "format":
        doc["format"] = rng.choice(["opsched.schedule/2", "opsched.schedule/0", None, 1])
    elif kind == "split_batch":
        op = rng.choice(ops)
        job = {"name": op["name"], "device": names[0], "start": op["start"], "finish": op["finish"], "pieces": [0]}
        section["jobs"] = rng.choice([None, "x", [{}], [3], [job], [dict(job, pieces=[9])], [dict(job, device="x")]])
    elif kind == "section":
        doc["devices"] = rng.choice([None, False, "yes", 0, [], {}])
    elif kind == "options":
        doc["options"] = rng.choice([None, [], "x", 3, {}, {"mapping": True}])
    elif kind == "transfers":
        if rng.random() < 0.5 or not section["transfers"]:
            section["transfers"] = rng.choice([None, "x", [{}], [3]])
        else:
            rng.choice(section["transfers"])[rng.choice(["start", "finish", "value", "inputs"])] = rng.choice(
                ["x", None, -1, [], "nope"])
        if rng.random() < 0.3:
            section["platform"] = rng.choice([None, "cpu2", {}, [], {"name": 3}])
    elif kind == "figures":
        where, key = rng.choice([(section, "optimal"), (section, "objective"), (section, "time_unit"),
                                 (section, "pieces"), (doc["bounds"], "lower_bound"), (doc, "predicted_latency")])
        where[key] = rng.choice([None, "x", [], -1.0, float("nan"), {}])
    elif kind == "batch":
        doc["batch"] = rng.choice([2, 0, -1, "x", None, 1.5, []])
    elif kind == "fingerprint":
        doc["graph"]["fingerprint"] = rng.choice(["0" * 16, None, 3])
    text = json.dumps(doc, indent=1)
    if kind == "truncate":
        text = text[:rng.randrange(len(text))]
    return text


def mapped_plans(directory: Path, spec: str) -> dict[str, dict[str, Any]]:
    """Mapped plans of the model ``spec`` written by ``opsched map --out``: HEFT and the MILP on ``cpu2`` (two real
    CPU devices), the MILP for throughput (batch 4, which may split it), HEFT on the simulated ``diviml``."""
    plans = {}
    for name, extra in (("heft", ["--method", "heft"]), ("milp", ["--method", "milp", "--time-limit", "1"]),
                        ("throughput", ["--method", "milp", "--time-limit", "1", "--objective", "throughput",
                                        "--batch", "4"]),
                        ("simulated", ["--method", "heft", "--platform", "diviml"])):
        path = directory / f"mapped-{name}.json"
        platform = [] if "--platform" in extra else ["--platform", "cpu2"]
        code, _, err = cli(["map", spec, *platform, *extra, "--out", str(path), "--force", "--json"])
        assert code == 0, err
        plans[name] = json.loads(path.read_text())
    return plans


def check_mapped_plan_text(text: str, directory: Path, spec: str, gantt: bool = False) -> dict[str, str]:
    """Give an edited mapped plan to ``opsched show`` (JSON and table; ``--trace``, and ``--gantt`` when asked) and
    to ``opsched run MODEL --plan``: each refuses it in one line (exit 2) or accepts it, show then printing its
    summary and run verifying it against eager (exit 0). Returns each command's verdict."""
    plan = directory / "edited.json"
    plan.write_text(text)
    trace, png = directory / "trace.json", directory / "gantt.png"
    verdict = {}
    show = ["show", str(plan), "--trace", str(trace), "--force"] + (["--gantt", str(png)] if gantt else [])
    code, out, err = cli([*show, "--json"])
    if code == 0:
        json.loads(out)
        code, out, err = cli(show)  # the table too
        assert code == 0 and out, (code, err[-2000:])
        verdict["show"] = "accepted"
    else:
        assert_refused(code, out, err, text[:300])
        verdict["show"] = "refused"
    code, out, err = cli(["run", spec, "--plan", str(plan), "--repeats", "1", "--json"])
    if code == 0:
        result = json.loads(out)
        assert result["max_abs_error"] <= 1e-3, result
        verdict["run"] = "accepted"
    else:
        assert_refused(code, out, err, text[:300])
        verdict["run"] = "refused"
    return verdict


def big_mapping_problem(directory: Path, units: int = 150, seed: int = 1) -> tuple[Path, Path]:
    """A DAG JSON of ``units`` units, each reading some of the six before it, with integer costs on three devices
    and edge bytes, and its platform: CP-SAT proves nothing about it within many seconds."""
    rng = random.Random(seed)
    devices = ("a", "b", "c")
    nodes = [{"name": f"v{i}", "latency": {d: rng.randint(1, 20) for d in devices}} for i in range(units)]
    edges = [[f"v{j}", f"v{i}", rng.randint(0, 10)] for i in range(units) for j in range(max(0, i - 6), i)
             if rng.random() < 0.3]
    dag, platform = directory / f"big-{units}.json", directory / "big-platform.json"
    dag.write_text(json.dumps({"nodes": nodes, "edges": edges}))
    platform.write_text(json.dumps({"devices": [{"name": d} for d in devices],
                                    "links": {"default": {"bandwidth": 1, "latency": 1}}}))
    return dag, platform


def chained_mapping_problem(directory: Path, modules: int = 2, width: int = 22, seed: int = 1) -> tuple[Path, Path]:
    """``modules`` modules of ``width`` sparsely linked units, each module read from the one unit that ends the
    module before: MILP-SPLIT's exact path (cut units), each module's MILP for each pair of devices a second or
    more of CP-SAT (cut units are found at once, where a graph without them spends seconds in its decomposition)."""
    rng = random.Random(seed)
    devices = ("a", "b", "c")
    nodes: list[dict[str, Any]] = [{"name": "in", "latency": {d: 1 for d in devices}}]
    edges: list[list[Any]] = []
    cut = "in"
    for m in range(modules):
        names = [f"m{m}u{i}" for i in range(width)]
        for i, name in enumerate(names):
            nodes.append({"name": name, "latency": {d: rng.randint(1, 20) for d in devices}})
            preds = [names[j] for j in range(max(0, i - 4), i) if rng.random() < 0.08] or [cut]
            edges += [[p, name, rng.randint(0, 10)] for p in preds]
        cut = f"m{m}out"
        nodes.append({"name": cut, "latency": {d: 1 for d in devices}})
        edges += [[name, cut, rng.randint(0, 10)] for name in names]
    dag, platform = directory / f"chained-{modules}x{width}.json", directory / "big-platform.json"
    dag.write_text(json.dumps({"nodes": nodes, "edges": edges}))
    platform.write_text(json.dumps({"devices": [{"name": d} for d in devices],
                                    "links": {"default": {"bandwidth": 1, "latency": 1}}}))
    return dag, platform


def no_process_left(group: int) -> bool:
    """Whether the session ``group`` (a command started in a session of its own) has no process left, those that
    made process groups of their own (as Ray's workers do) included."""
    return not session_processes(group)


def map_interrupt_trial(directory: Path, method: str, delay: float, time_limit: float = 30.0,
                        units: int = 150) -> dict[str, Any]:
    """Start ``opsched map`` with ``method`` on :func:`big_mapping_problem` (MILP-SPLIT: on
    :func:`chained_mapping_problem`, so that the signal finds it solving) and send SIGINT after ``delay`` seconds.
    Check: exit 130 with the one line ``opsched: interrupted`` (or 0 with its JSON when it finished first), no
    traceback, ``--out`` absent or a complete plan, no process of its session left, and how soon it stopped."""
    dag, platform = (chained_mapping_problem(directory) if method == "milp-split"
                     else big_mapping_problem(directory, units))
    out = directory / f"plan-{time.monotonic_ns()}.json"
    # --quiet: the trial checks what the interrupt is reported as, not MILP-SPLIT's progress lines before it
    argv = [sys.executable, "-m", "opsched", "map", str(dag), "--platform", str(platform), "--method", method,
            "--time-limit", str(time_limit), "--out", str(out), "--json", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(delay)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(signal.SIGINT)
    signalled = time.perf_counter()
    try:
        stdout, stderr = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"method": method, "delay": delay, "hung": True, "stderr": stderr[-500:]}
    stopped_after = time.perf_counter() - signalled
    plan = "absent"
    if out.exists():
        try:
            from opsched.schedule import load

            load(out)
            plan = "complete"
        except ScheduleError:
            plan = "truncated"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return {"method": method, "delay": round(delay, 2), "signalled": sent, "exit": proc.returncode,
            "stderr": lines[:3], "stderr_lines": len(lines), "hung": False, "stopped_after_s": round(stopped_after, 2),
            "plan": plan, "stdout_json": is_json(stdout), "no_process_left": no_process_left(proc.pid)}


def time_limit_trial(directory: Path, method: str, time_limit: float, units: int = 150) -> dict[str, Any]:
    """``opsched map`` with ``method`` and ``--time-limit`` on :func:`big_mapping_problem`: the wall time of the
    whole command and the solve time it reports."""
    dag, platform = big_mapping_problem(directory, units)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "opsched", "map", str(dag), "--platform", str(platform), "--method",
                           method, "--time-limit", str(time_limit), "--json"], capture_output=True, text=True,
                          timeout=HANG_SECONDS + 10 * time_limit, check=False)
    wall = time.perf_counter() - started
    result = json.loads(done.stdout) if done.returncode == 0 else {}
    return {"method": method, "time_limit": time_limit, "exit": done.returncode, "stderr": done.stderr[-300:],
            "wall_s": round(wall, 2), "solve_s": round(result.get("solve_seconds", math.nan), 2),
            "solve_over_limit_s": round(result.get("solve_seconds", math.nan) - time_limit, 2),
            "predicted": result.get("predicted"), "lower_bound": result.get("lower_bound")}


def mapped_module_plan(graph: Graph, method: str = "heft", seed: int = 0, platform: str | dict[str, Any] = "cpu2"
                       ) -> Any:
    """A mapped plan of ``graph`` on ``platform`` (a built-in's name, by default ``cpu2``: two CPU devices of one
    thread each; or a PLATFORM.json document), from seeded random unit costs (the units' table latencies where they
    have them; what the costs are does not matter to whether the outputs are right)."""
    from opsched.mapping.plan import to_schedule
    from opsched.mapping.platform import load_platform, platform_from_dict
    from opsched.mapping.problem import build_problem
    from opsched.mapping.solve import solve

    rng = random.Random(seed)
    costs = [float(rng.randint(1, 9)) for _ in graph.nodes]
    devices = load_platform(platform) if isinstance(platform, str) else platform_from_dict(platform)
    problem = build_problem(graph, devices, measure=lambda device, threads: costs)
    solved = solve(problem, method, time_limit=2)
    return to_schedule(problem, solved.mapping, solved.timeline, method, solved.lower_bound, solved.optimal,
                       solved.stats)
