"""Load on ``opsched serve`` beside what a user would run instead, on this machine (measured).

Each configuration is a server in a process of its own, on the local machine only, fed by this process:

- ``eager``: every request on its own, the model itself (``--max-batch 1 --no-optimize``), in one process: a plain
  server;
- ``batched``: each model's requests batched across time, the models themselves, never fused (``--no-optimize
  --no-fuse``), in one process: per-model dynamic batching, as Triton's dynamic batcher or Ray Serve's
  ``@serve.batch`` do;
- ``opsched``: ``opsched serve`` as it comes (each model's plans, each block on the kernels that measured faster,
  requests of several models fused, the models in a process of their own);
- ``opsched-local``: the same with the models in the server's process (``--engine local``);
- ``opsched-onnxruntime``: the same with the plans' units run as ONNX Runtime kernels (``--kernels onnxruntime``);
  ``opsched-eager`` on eager kernels (``--kernels eager``, the default before ``auto``);
- ``opsched-ray``: the same in Ray Serve deployments on a local Ray (``--engine ray``, one replica);
- ``opsched-nodelay``: ``opsched serve --max-delay-ms 0`` (a batch is what queued while the last call ran);
- ``ceiling``: the same server with every model replaced by a copy of its output (a constant), in one process: what
  the protocol alone allows, reported beside every row; ``ceiling-process``, the same with ``--engine process``.
  Where both ran, each round's ratio is to the higher of the two.

Load: closed-loop (``--clients`` clients, each sending its next request when its answer arrives) and open-loop
(Poisson arrivals at each of ``--rates`` requests/s, whatever the answers), each for ``--seconds`` after a warm-up,
spreading requests over the models at random, with JSON tensors and with Triton's binary tensors. Per run: the
requests sent and answered a second within the measured window (the load generator shares this machine's two
cores with the server: an open loop sends what it manages), p50 and p99 latency, errors, the CPU time the server's
processes and the load generator used per answered request, and the first answers of each model checked against the
model run here on the same input (``opsched.compare``). Every row goes to ``--out`` as a JSON line with the machine,
versions, date and commit. The load generator is an aiohttp client (``pip install '.[serve,bench]'``).

    python benchmarks/serve_load.py --workloads cnn16 --configs eager batched opsched ceiling --out docs/serve_load.jsonl
    python benchmarks/serve_load.py --workloads cnn16 --configs opsched --soak 600 --soak-rate 50   # the soak
    python benchmarks/serve_load.py --out docs/serve_load.jsonl --plot docs/serve_load.png           # the chart
    python benchmarks/serve_load.py --workloads cnn16 --interleave 5 --seconds 6 --warmup 1 --out docs/serve_load_interleaved.jsonl

With ``--interleave ROUNDS`` every configuration's server is started first and the loads take turns between them,
round after round, so that the machine's slow and fast phases fall on all of them alike; ``--table`` then gives the
medians over the rounds, and each ratio as the median of the rounds' own ratios with their range.

Workloads: ``cnn16`` (16 small CNNs, 32 px), ``resnet18x16`` (16 ResNet-18, 64 px), ``mixed`` (SqueezeNet 1.1,
MobileNetV3-small, ShuffleNet V2 x0.5, MNASNet 0.5; 64 px).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from sweep import appender

CONFIGS = {
    "eager": {"optimize": False, "fuse": False, "max_batch": 1, "max_delay_ms": 0.0, "engine": "local"},
    "batched": {"optimize": False, "fuse": False, "engine": "local"},
    "opsched": {},
    "opsched-local": {"engine": "local"},
    "opsched-onnxruntime": {"optimize_options": {"kernels": "onnxruntime"}},
    "opsched-eager": {"optimize_options": {"kernels": "eager"}},
    "opsched-ray": {"engine": "ray"},
    "opsched-nodelay": {"max_delay_ms": 0.0},
    "ceiling": {"optimize": False, "fuse": False, "max_batch": 1, "max_delay_ms": 0.0, "engine": "local"},
    "ceiling-process": {"optimize": False, "fuse": False, "max_batch": 1, "max_delay_ms": 0.0, "engine": "process"},
}


def workload(name: str) -> dict[str, tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]:
    """The workload's models by served name, each with its example input (seeded: client and server agree)."""
    import torchvision
    from multi import small_cnn

    torch.manual_seed(0)
    if name == "cnn16":
        return {f"cnn{k}": (small_cnn().eval(), (torch.randn(1, 3, 32, 32),)) for k in range(16)}
    if name == "resnet18x16":
        return {f"resnet{k}": (torchvision.models.resnet18().eval(), (torch.randn(1, 3, 64, 64),)) for k in range(16)}
    if name == "mixed":
        makers = [torchvision.models.squeezenet1_1, torchvision.models.mobilenet_v3_small,
                  torchvision.models.shufflenet_v2_x0_5, torchvision.models.mnasnet0_5]
        return {make.__name__: (make().eval(), (torch.randn(1, 3, 64, 64),)) for make in makers}
    raise SystemExit(f"unknown workload {name!r}")


class Constant(torch.nn.Module):
    """A model's copy for the ceiling: its output for one sample, repeated for the batch."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.register_buffer("output", output)

    def forward(self, x):
        return self.output.expand(x.shape[0], *self.output.shape[1:]).clone()


def run_server(name: str, config: str, port: int, max_batch: int, max_delay_ms: float) -> None:
    import opsched

    models = workload(name)
    if config.startswith("ceiling"):
        with torch.inference_mode():
            models = {k: (Constant(m(*x)), x) for k, (m, x) in models.items()}
    options = {"max_batch": max_batch, "max_delay_ms": max_delay_ms, **CONFIGS[config]}
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn drains; exit 0 after
    opsched.serve(models, port=port, queue_size=1024, **options)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bodies(models: dict, binary: bool, inputs: dict[str, str], seed: int = 1) -> dict[str, list]:
    """A few requests for each model (one sample each, its input named as ``inputs`` says): body, headers, and
    the input."""
    rng = torch.Generator().manual_seed(seed)
    made = {}
    for name, (_, example) in models.items():
        made[name] = []
        for _ in range(4):
            x = torch.randn(example[0].shape, generator=rng)
            entry = {"name": inputs[name], "shape": list(x.shape), "datatype": "FP32"}
            if binary:
                raw = x.numpy().astype(np.float32).tobytes()
                entry["parameters"] = {"binary_data_size": len(raw)}
                head = json.dumps({"inputs": [entry], "outputs": [{"name": "output_0",
                                                                   "parameters": {"binary_data": True}}]}).encode()
                made[name].append((head + raw, {"Inference-Header-Content-Length": str(len(head)),
                                                "Content-Type": "application/octet-stream"}, x))
            else:
                entry["data"] = x.flatten().tolist()
                made[name].append((json.dumps({"inputs": [entry]}).encode(), {"Content-Type": "application/json"}, x))
    return made


def decoded(headers, content: bytes, binary: bool) -> torch.Tensor:
    """The first output of an answer (its headers and body)."""
    if binary:
        length = int(headers["Inference-Header-Content-Length"])
        out = json.loads(content[:length])["outputs"][0]
        return torch.from_numpy(np.frombuffer(content[length:], dtype=np.float32).copy()).reshape(out["shape"])
    out = json.loads(content)["outputs"][0]
    return torch.tensor(out["data"]).reshape(out["shape"])


def processes(pid: int) -> list[int]:
    """``pid`` and the processes it started, theirs too (``--engine process``'s models' process), from /proc."""
    found = [pid]
    with contextlib.suppress(OSError):  # a process that has just ended
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that has just ended
                for child in (task / "children").read_text().split():
                    found += processes(int(child))
    return found


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` and the processes it started have used (user and system), from /proc."""
    used = 0.0
    for process in processes(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
            used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def resident_mb(pid: int) -> float:
    """The resident memory of process ``pid`` and the processes it started, in MB, from /proc."""
    kb = 0
    for process in processes(pid):
        with contextlib.suppress(OSError, StopIteration):
            lines = Path(f"/proc/{process}/status").read_text().splitlines()
            kb += next(int(line.split()[1]) for line in lines if line.startswith("VmRSS"))
    return kb / 1024


async def load(url: str, requests: dict, binary: bool, mode: str, level: float, seconds: float, warmup: float,
               check: dict | None, check_all: bool = False, pid: int | None = None, memory: bool = False) -> dict:
    """Closed loop (``level`` clients) or open loop (``level`` requests/s, Poisson) for ``seconds`` after
    ``warmup``: answered requests/s, latencies, errors, and answers checked against ``check`` (model by name): the
    first three of each model, or with ``check_all`` every one. With ``pid`` (the server's process), the CPU time
    it used in the measured window per answered request, and with ``memory`` its resident memory every five
    seconds (both with the processes it started: the models' own process). The client is aiohttp's: at 0.2 ms of
    CPU a request it leaves the cores to the server (httpx's took 3.3 ms, more than the server's own work, and its
    rate was the client's)."""
    import aiohttp

    from opsched.compare import compare_outputs

    names = list(requests)
    latencies: list[float] = []
    errors = checked = wrong = sent_measured = 0
    started = time.perf_counter()
    measuring = started + warmup
    ending = measuring + seconds
    seen: dict[str, int] = {}
    sent_all = lost = 0  # lost: sent and never answered (the connection failed or timed out)
    resident: list[tuple[float, float]] = []  # (seconds into the run, MB)
    cpu: dict[str, float] = {}  # the server's and this process's CPU seconds as the measured window opens and closes

    async def one(session, rng):
        nonlocal errors, checked, wrong, sent_measured, sent_all, lost
        name = rng.choice(names)
        body, headers, x = rng.choice(requests[name])
        sent = time.perf_counter()
        sent_measured += measuring <= sent < ending
        sent_all += 1
        try:
            async with session.post(f"{url}/v2/models/{name}/infer", data=body, headers=headers) as response:
                content = await response.read()
                status, answer_headers = response.status, response.headers
        except (TimeoutError, aiohttp.ClientError):
            lost += 1
            return
        done = time.perf_counter()
        if status != 200:
            errors += sent >= measuring
            return
        if sent >= measuring and done <= ending:
            latencies.append(done - sent)
        if check is not None and (check_all or seen.get(name, 0) < 3):
            seen[name] = seen.get(name, 0) + 1
            checked += 1
            with torch.inference_mode():
                wrong += not compare_outputs(decoded(answer_headers, content, binary), check[name](x)).ok

    async def sample():
        await asyncio.sleep(max(measuring - time.perf_counter(), 0))
        if pid:
            cpu["server"] = cpu_seconds(pid)
        cpu["client"] = time.process_time()
        while (now := time.perf_counter()) < ending:
            if memory:
                resident.append((round(now - started, 1), round(resident_mb(pid), 1)))
            await asyncio.sleep(min(5.0, ending - now))
        if pid:
            cpu["server"] = cpu_seconds(pid) - cpu["server"]
        cpu["client"] = time.process_time() - cpu["client"]

    sampler = asyncio.ensure_future(sample())
    connector = aiohttp.TCPConnector(limit=0)  # a connection for every request in flight, as a client each would
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        if mode == "closed":
            async def client_loop(k):
                rng = random.Random(k)
                while time.perf_counter() < ending:
                    await one(session, rng)

            await asyncio.gather(*(client_loop(k) for k in range(int(level))))
        else:
            rng = random.Random(0)
            tasks = []
            while (now := time.perf_counter()) < ending:
                tasks.append(asyncio.ensure_future(one(session, random.Random(rng.random()))))
                await asyncio.sleep(max(rng.expovariate(level) - (time.perf_counter() - now), 0))
            await asyncio.gather(*tasks)
    await sampler
    ms = sorted(1000 * t for t in latencies)

    def per_request(seconds_used: float | None) -> float | None:
        return round(1000 * seconds_used / len(ms), 3) if ms and seconds_used is not None else None

    return {"sent_per_s": round(sent_measured / seconds, 1), "answered_per_s": round(len(ms) / seconds, 1),
            "p50_ms": round(statistics.median(ms), 2) if ms else None,
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2) if ms else None, "errors": errors,
            "checked": checked, "wrong": wrong, "sent": sent_all, "lost": lost,
            "server_cpu_ms": per_request(cpu.get("server")), "client_cpu_ms": per_request(cpu.get("client")),
            **({"memory_mb": resident} if memory else {})}


def start_server(name: str, config: str, args: argparse.Namespace, append) -> tuple | None:
    """``config``'s server of workload ``name`` in a process of its own, once ready: ``(process, url, seconds it
    took)``; None (and a ``failed`` row) where it did not get ready in time."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", name, config, "--port", str(port),
                               "--max-batch", str(args.max_batch), "--max-delay-ms", str(args.max_delay_ms)],
                              stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5):
                return server, url, round(time.perf_counter() - started, 1)
        except OSError:  # not listening yet, or not ready (an HTTPError is an OSError)
            pass
        if server.poll() is not None or time.perf_counter() - started > args.prepare_timeout:
            append({"workload": name, "config": config, "failed": "not ready in time" if server.poll() is None
                    else f"exit {server.returncode}: {server.stderr.read().strip().splitlines()[-1:]}"})
            stop_server(server)
            return None
        time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


def runs_of(args: argparse.Namespace) -> list[tuple[bool, str, float]]:
    """Every (binary, closed or open loop, clients or rate) the arguments ask for."""
    loads = [("closed", args.clients)] * (args.clients > 0) + [("open", rate) for rate in args.rates]
    return [(t == "binary", mode, level) for t in args.tensors for mode, level in loads]


def served_inputs(url: str, models: dict) -> dict[str, str]:
    """Each model's input as the server names it (its forward's parameter)."""
    def metadata(name: str) -> dict:
        with urllib.request.urlopen(f"{url}/v2/models/{name}", timeout=30) as response:
            return json.loads(response.read())

    return {k: metadata(k)["inputs"][0]["name"] for k in models}


def run_row(name: str, config: str, models: dict, binary: bool, mode: str, level: float, row: dict,
            args: argparse.Namespace, prepared: float) -> dict:
    return {"workload": name, "models": len(models), "config": config, "tensors": "binary" if binary else "json",
            "load": mode, ("clients" if mode == "closed" else "rate_per_s"): level, "max_batch": args.max_batch,
            "max_delay_ms": args.max_delay_ms, "prepared_s": prepared, **row}


def answers_of(config: str, models: dict) -> dict | None:
    """The models the answers of ``config``'s server are checked against (none for the ceiling's constants)."""
    return None if config.startswith("ceiling") else {k: m for k, (m, _) in models.items()}


def turn(name: str, config: str, started: tuple, models: dict, inputs: dict, binary: bool, mode: str, level: float,
         args: argparse.Namespace, append, **extra) -> dict:
    """One load on ``config``'s server (``started`` as :func:`start_server` gives it), its answers checked: the row,
    with ``extra``'s fields, appended to the record and its main figures printed."""
    server, url, prepared = started
    row = asyncio.run(load(url, bodies(models, binary, inputs), binary, mode, level, args.seconds, args.warmup,
                           answers_of(config, models), pid=server.pid))
    row = append(run_row(name, config, models, binary, mode, level, {**row, **extra}, args, prepared))
    print(json.dumps({k: row[k] for k in ("workload", "config", "tensors", "load", *extra, "answered_per_s", "p50_ms",
                                          "p99_ms", "errors", "wrong")}), flush=True)
    return row


def measure(name: str, config: str, args: argparse.Namespace, append) -> None:
    started = start_server(name, config, args, append)
    if started is None:
        return
    server, url, prepared = started
    try:
        models = workload(name)
        inputs = served_inputs(url, models)
        if args.soak:
            row = asyncio.run(load(url, bodies(models, True, inputs), True, "open", args.soak_rate, args.soak,
                                   args.warmup, answers_of(config, models), check_all=True, pid=server.pid,
                                   memory=True))
            row = append(run_row(name, config, models, True, "soak", args.soak_rate, row, args, prepared))
            print(json.dumps({k: row[k] for k in ("answered_per_s", "p99_ms", "errors", "wrong", "lost", "checked")}),
                  flush=True)
            return
        for binary, mode, level in runs_of(args):
            turn(name, config, started, models, inputs, binary, mode, level, args, append)
    finally:
        stop_server(server)


def interleave(name: str, args: argparse.Namespace, append) -> None:
    """Every configuration's server started at once and left idle between its turns; then for each load, ``args.
    interleave`` rounds in which each configuration takes its turn (the order shuffled, seeded, each round), so
    that the machine's slow and fast phases fall on all of them alike. Each turn is a row with its round and the
    run's id; :func:`table` gives the medians over the rounds and each ratio as the median of the rounds' own."""
    servers = {}
    run = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        for config in args.configs:
            print(f"{name}: starting {config} ...", file=sys.stderr, flush=True)
            started = start_server(name, config, args, lambda row: append({**row, "run": run}))
            if started is not None:
                servers[config] = started
        if not servers:
            return
        models = workload(name)
        inputs = {config: served_inputs(url, models) for config, (_, url, _) in servers.items()}
        for binary, mode, level in runs_of(args):
            for round_ in range(args.interleave):
                order = list(servers)
                random.Random(round_).shuffle(order)  # no configuration always follows the same one
                for config in order:
                    turn(name, config, servers[config], models, inputs[config], binary, mode, level, args, append,
                         run=run, round=round_)
    finally:
        for server, _, _ in servers.values():
            stop_server(server)
    # the medians and ratios the table shows, kept in the record beside the rounds they come from
    for summary in interleaved_summaries([json.loads(line) for line in Path(args.out).read_text().splitlines()]):
        if summary["run"] == run:
            append(summary)


def last_runs(path: str) -> dict[tuple, dict]:
    """The rows in ``path`` by workload, configuration, tensors, load and its level: the last run of each (a
    record keeps earlier runs after it; failed starts and soaks left out)."""
    rows: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "failed" in row or row.get("load") == "soak" or "run" in row:  # interleaved: interleaved_table
            continue
        level = row.get("clients") or row.get("rate_per_s")
        rows[(row["workload"], row["config"], row["tensors"], row["load"], level)] = row
    return rows


def table(path: str) -> str:
    """The markdown table of the rows in ``path`` (the last run of each workload, configuration, tensors and load),
    the ceiling's answered requests/s beside every row."""
    rows = last_runs(path)
    header = ("| workload | tensors | load | configuration | sent/s | answered/s | p50 ms | p99 ms | errors | wrong "
              "(checked) | ceiling answered/s | against eager | against batched |")
    lines = [header, "|" + "---|" * 13]
    for (name, config, tensors, load_, level), row in rows.items():
        if config == "ceiling":
            continue
        ceiling = rows.get((name, "ceiling", tensors, load_, level), {}).get("answered_per_s")
        eager = rows.get((name, "eager", tensors, load_, level), {}).get("answered_per_s")
        batched = rows.get((name, "batched", tensors, load_, level), {}).get("answered_per_s")
        what = f"{level} clients" if load_ == "closed" else f"Poisson {level:g}/s"
        answered = row["answered_per_s"]

        def ratio(base, answered=answered):
            return f"{answered / base:.2f}x" if base else "-"

        lines.append(f"| {name} | {tensors} | {what} | {config} | {row.get('sent_per_s', '-')} | {row['answered_per_s']} | "
                     f"{row['p50_ms']} | {row['p99_ms']} | {row['errors'] + row.get('lost', 0)} | {row['wrong']} "
                     f"({row['checked']}) | {ceiling if ceiling is not None else '-'} | {ratio(eager)} | "
                     f"{ratio(batched)} |")
    return "\n".join(lines)


def _median(by_round: dict[int, dict], field: str) -> float | None:
    values = [r[field] for r in by_round.values() if r.get(field) is not None]  # older rows lack the CPU times
    return round(statistics.median(values), 2) if values else None


def _against(by_round: dict[int, dict], base: dict[int, dict] | None) -> list[float] | None:
    """The median of the rounds' ratios of answered requests/s to ``base``'s in the same round, and their lowest and
    highest."""
    ratios = [r["answered_per_s"] / base[k]["answered_per_s"] for k, r in by_round.items()
              if base and base.get(k, {}).get("answered_per_s")]
    if not ratios or by_round is base:
        return None
    return [round(statistics.median(ratios), 2), round(min(ratios), 2), round(max(ratios), 2)]


def _ceiling(by_config: dict[str, dict[int, dict]]) -> dict[int, dict] | None:
    """Each round's ceiling: the higher of the ceiling servers' (``ceiling``, ``ceiling-process``) that ran."""
    ceilings = [by_round for config, by_round in by_config.items() if config.startswith("ceiling")]
    if not ceilings:
        return None
    rounds = {k for by_round in ceilings for k in by_round}
    return {k: max((c[k] for c in ceilings if k in c), key=lambda r: r["answered_per_s"]) for k in rounds}


def interleaved_summaries(rows: list[dict]) -> list[dict]:
    """Of each workload's last interleaved run among ``rows``: per load and configuration, the medians over the
    rounds, and its answered requests/s against the plain server's, per-model batching's and the ceiling's (the
    median of the rounds' own ratios, with the lowest and highest); and a row for each server that did not start."""
    rows = [r for r in rows if "run" in r and "summary" not in r]
    last = {r["workload"]: r["run"] for r in rows}
    rows = [r for r in rows if r["run"] == last[r["workload"]]]
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in rows:
        if "failed" not in r:
            key = (r["workload"], r["tensors"], r["load"], r.get("clients") or r.get("rate_per_s"))
            groups.setdefault(key, {}).setdefault(r["config"], {})[r["round"]] = r
    summaries = [{"summary": True, "run": r["run"], "workload": r["workload"], "config": r["config"],
                  "failed": r["failed"]} for r in rows if "failed" in r]
    for (name, tensors, load_, level), by_config in groups.items():
        for config, by_round in by_config.items():
            summaries.append({
                "summary": True, "run": last[name], "workload": name, "tensors": tensors, "load": load_,
                "level": level, "config": config, "rounds": len(by_round),
                **{field: _median(by_round, field) for field in ("answered_per_s", "p50_ms", "p99_ms", "server_cpu_ms")},
                "errors": sum(r["errors"] + r.get("lost", 0) for r in by_round.values()),
                "wrong": sum(r["wrong"] for r in by_round.values()),
                "checked": sum(r["checked"] for r in by_round.values()),
                **{f"against_{base}": _against(by_round, by_config.get(base))
                   for base in ("eager", "batched", "opsched-local", "opsched-eager") if base in by_config},
                "against_ceiling": _against(by_round, _ceiling(by_config))})
    return summaries


def interleaved_table(path: str) -> str:
    """The markdown table of :func:`interleaved_summaries` of the rows in ``path``; each ratio as its median
    [lowest, highest] over the rounds."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    lines = [("| workload | tensors | load | configuration | rounds | answered/s | p50 ms | p99 ms | server CPU ms a "
              "request | errors | wrong (checked) | against eager | against batched | of the ceiling |"),
             "|" + "---|" * 14]
    failed = []

    def ratio(r: list[float] | None) -> str:
        return f"{r[0]:.2f}x [{r[1]:.2f}, {r[2]:.2f}]" if r else "-"

    for s in interleaved_summaries(rows):
        if "failed" in s:
            failed.append(f"{s['workload']}: {s['config']} did not start ({s['failed']})")
            continue
        what = f"{s['level']} clients" if s["load"] == "closed" else f"Poisson {s['level']:g}/s"
        lines.append(f"| {s['workload']} | {s['tensors']} | {what} | {s['config']} | {s['rounds']} | "
                     f"{s['answered_per_s']} | {s['p50_ms']} | {s['p99_ms']} | {s.get('server_cpu_ms') or '-'} | "
                     f"{s['errors']} | {s['wrong']} "
                     f"({s['checked']}) | {ratio(s.get('against_eager'))} | {ratio(s.get('against_batched'))} | "
                     f"{ratio(s['against_ceiling'])} |")
    return "\n".join(lines + failed)


def plot(path: str, png: str) -> None:
    """Throughput against latency from the last run's rows in ``path`` (of an interleaved run, each
    configuration's medians over the rounds): for each workload and tensor encoding, each run as a point of answered
    requests/s against p99 milliseconds (filled) and p50 (hollow), coloured by configuration, shaped by load (closed
    loop, or the open loop's rate), written to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(last_runs(path).values())
    if not rows:  # an interleaved run: its medians, with the level named as a single run's row names it
        every = [json.loads(line) for line in Path(path).read_text().splitlines()]
        first = next(r for r in every if "run" in r and "summary" not in r)
        rows = [{**s, "machine": first["machine"], "date": first["date"],
                 ("clients" if s["load"] == "closed" else "rate_per_s"): s["level"]}
                for s in interleaved_summaries(every) if "failed" not in s]
    panels = sorted({(r["workload"], r["tensors"]) for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    loads = list(dict.fromkeys(f"{r['clients']} clients" if r["load"] == "closed" else f"Poisson {r['rate_per_s']:g}/s"
                               for r in rows))
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (name, tensors) in zip(axes[0], panels):
        for r in rows:
            if (r["workload"], r["tensors"]) != (name, tensors):
                continue
            load_ = f"{r['clients']} clients" if r["load"] == "closed" else f"Poisson {r['rate_per_s']:g}/s"
            color, marker = f"C{configs.index(r['config'])}", "os^vD"[loads.index(load_) % 5]
            ax.scatter(r["answered_per_s"], r["p99_ms"], color=color, marker=marker, s=40)
            ax.scatter(r["answered_per_s"], r["p50_ms"], facecolors="none", edgecolors=color, marker=marker, s=40)
        ax.set(title=f"{name}, {tensors} tensors", xlabel="answered requests/s",
               ylabel="latency (ms): p99 filled, p50 hollow", yscale="log")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=f"C{k}", marker="o", linestyle="", label=c) for k, c in enumerate(configs)]
    handles += [plt.Line2D([], [], color="grey", marker="os^vD"[k % 5], linestyle="", label=w)
                for k, w in enumerate(loads)]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    figure.suptitle(f"{rows[0]['machine']}, {rows[0]['date']} (measured)", fontsize=9)
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["cnn16"], choices=["cnn16", "resnet18x16", "mixed"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--clients", type=int, default=32, help="closed loop: clients (default 32; 0: no closed loop)")
    parser.add_argument("--rates", type=float, nargs="*", default=[50.0, 200.0],
                        help="open loop: Poisson arrival rates, requests/s (default 50 200)")
    parser.add_argument("--tensors", nargs="+", default=["json", "binary"], choices=["json", "binary"])
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds a run (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--prepare-timeout", type=float, default=900.0, help="seconds for a server to be ready")
    parser.add_argument("--soak", type=float, metavar="SECONDS",
                        help="instead: one open-loop run this long at --soak-rate on the first config, every answer "
                             "checked, the server's resident memory (its processes') read every five seconds")
    parser.add_argument("--soak-rate", type=float, default=50.0)
    parser.add_argument("--interleave", type=int, metavar="ROUNDS",
                        help="start every configuration's server at once, then take turns: each load this many "
                             "rounds, every configuration once a round (a row each, --seconds long)")
    parser.add_argument("--out", default="docs/serve_load.jsonl")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out's rows and stop")
    parser.add_argument("--plot", metavar="PNG", help="draw throughput against latency from --out's rows and stop")
    parser.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_server(*args.serve, args.port, args.max_batch, args.max_delay_ms)
        return
    if args.table:
        print(table(args.out))
        if any('"run": ' in line for line in Path(args.out).read_text().splitlines()):
            print("\ninterleaved:\n")
            print(interleaved_table(args.out))
        return
    if args.plot:
        plot(args.out, args.plot)
        return
    append = appender(args.out)
    for name in args.workloads:
        if args.interleave:
            interleave(name, args, append)
            continue
        for config in args.configs:
            print(f"{name}: {config} ...", file=sys.stderr, flush=True)
            measure(name, config, args, append)


if __name__ == "__main__":
    main()
