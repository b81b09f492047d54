"""Every GPU claim opsched makes, measured in one prepared run (called by benchmarks/gpu_check.sh).

A GPU is lent by the quarter hour, on a machine that reaches no package index: this script runs each step in
a process of its own under its own time limit, records a step that fails or runs out of time and goes on, and
writes what it has after every step (``DIR/gpu_check.json`` and ``DIR/gpu_check.md``), so that whatever was
measured survives. It exits non-zero only when the GPU itself is unusable.

Steps, most important first (each models step times its configurations interleaved, CUDA events around
each call, after verifying every one against the model's own outputs):

- ``gpu``: the device, driver, CUDA and PyTorch versions, and a matrix product on the device.
- ``tests``: the suite's CUDA tests (tests/test_cuda*.py) on the device.
- ``model:NAME`` for GoogLeNet, Inception V3, RandWire, SqueezeNet and NASNet-A at batch 1: eager, the whole
  model captured as one CUDA graph (``torch.cuda.graph``), opsched's sequential, LIOS, Nimble and IOS plans on
  streams and replayed as CUDA graphs (costs measured on this GPU), IOS's and LIOS's plans searched again on
  costs measured with the launches hidden (``@replayed``, as ``--cuda-graph`` costs them) and replayed as CUDA
  graphs, torch.compile ``reduce-overhead`` and
  ``max-autotune-no-cudagraphs``; beside each plan what the measured cost model predicted and what the
  simulator (``sim:NAME``, the catalogue GPU closest to this one) predicts for the same schedule.
- ``multi``: 16 small CNNs and a ResNet-18 trunk with 8 heads through the pipeline of ``opsched multi --cuda-graph``,
  against running them one after another (eager, and as one CUDA graph), on threads with a stream each and
  torch.func.vmap; fused training of 8 small CNNs against training them one after another (exact against
  separate training).
- ``end-to-end``: ``opsched optimize torchvision:googlenet --device cuda`` as a user runs it, and
  ``torch.compile(model, backend="opsched")``, both verified.

``--dry-run`` runs the same steps without a GPU: the CUDA backend through the test suite's stand-in
(tests/cuda_standin.py) on CPU tensors, small images and few repeats, so that the script itself is tried
before a GPU is paid for. Its figures mean nothing and are labelled so.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--only STEP ...] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    name: str
    limit_s: float  # on the GPU; a dry run gets its own limits (DRY_LIMIT_S)
    goal: str = ""


# The GPU step models: (opsched model spec, label, image size on the GPU, IOS's max block size). NASNet's blocks
# are bounded at 14: with simulated costs its IOS search took 0.9 s at 10 (the bound of the first GPU runs, whose
# plan fell 8% short of its goal), 5.8 s at 14 and 45.5 s at 20 on one core of a 2-core Xeon, and on the H200 the
# searches at 10 took 6-9x their simulated time (stages are timed on the device as the search asks); at 20 the
# step did not finish its searches in 200 s (docs/gpu_runs/2026-11-27-h200-1.*).
MODELS = {
    "googlenet": ("torchvision:googlenet", "GoogLeNet", None, 20),
    "inception_v3": ("inception_v3", "Inception V3", None, 20),
    "randwire": ("randwire", "RandWire", None, 20),
    "squeezenet": ("squeezenet", "SqueezeNet", None, 20),
    "nasnet": ("nasnet", "NASNet-A large", None, 14),
}
DRY_IMAGE = {"googlenet": 64, "inception_v3": 75, "randwire": 64, "squeezenet": 64, "nasnet": 64}
# From the first H100 run (docs/gpu_runs/): capture, profile and search took 5-19 s a model, reduce-overhead
# compiled in 5-31 s (NASNet's not within 73 s), and max-autotune-no-cudagraphs did not finish compiling
# GoogLeNet in what its step had left; it has a step of its own, before SqueezeNet's (which that session
# measured whole in a second run), and what the budget leaves it.
STEPS = [
    Step("gpu", 60),
    Step("tests", 120),
    Step("model:googlenet", 75, "IOS >= 1.7x one sequential CUDA graph (Opara's 1.68x); never behind torch.compile"),
    Step("multi", 100, "several models >= 3x one after another"),
    Step("end-to-end", 50),
    Step("model:inception_v3", 75, "IOS >= 1.3x one sequential CUDA graph; never behind torch.compile"),
    Step("model:randwire", 75, "IOS >= 1.3x one sequential CUDA graph; never behind torch.compile"),
    Step("model:nasnet", 200, "IOS >= 1.3x one sequential CUDA graph; never behind torch.compile"),
    Step("autotune:googlenet", 240, "never behind torch.compile's best mode"),
    Step("model:squeezenet", 50),  # measured whole in the first GPU session's second run: last
]
DRY_LIMIT_S = 240
METHODS = ["sequential", "lios", "nimble", "ios"]
# searched again on the costs of replayed graphs (launches hidden), and run as CUDA graphs only
REPLAYED, REPLAYED_METHODS = "@replayed", ["ios", "lios"]
COMPILE_MODES = ["reduce-overhead", "max-autotune-no-cudagraphs"]  # a model step compiles the first, autotune the second
# a GPU's marketing name -> the simulator's catalogue entry that models it
SIM_NAMES = {"V100": "v100", "A100": "a100", "H100": "h100", "H200": "h100", "T4": "t4", "3080": "rtx3080",
             "K80": "k80"}


# --- the driver ------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md and gpu_check.log")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the CUDA backend on the stand-in, on CPU")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="these steps alone (gpu always runs)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for all the steps together; a step gets what is left if less than its "
                             "own limit (default 450)")
    parser.add_argument("--install-seconds", type=float, help=argparse.SUPPRESS)  # from gpu_check.sh
    parser.add_argument("--install-status", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)  # run one step in this process (the driver's child)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        return run_step(args.step, Path(args.result), args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in STEPS]
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"gpu_check: no step {', '.join(unknown)}; the steps are {', '.join(names)}", file=sys.stderr)
            return 2
    steps = [s for s in STEPS if not args.only or s.name in args.only or s.name == "gpu"]
    report: dict[str, Any] = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "host": platform.node(), "python": platform.python_version(), "steps": {}}
    if args.install_status is not None:
        report["steps"]["install"] = {"status": "ok" if args.install_status == 0 else
                                      f"failed (pip exit status {args.install_status})",
                                      "seconds": args.install_seconds}
    deadline = time.monotonic() + args.budget
    log = out / "gpu_check.log"
    log.write_text("")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for step in steps:
        left = deadline - time.monotonic()
        limit = min(DRY_LIMIT_S if args.dry_run else step.limit_s, left)
        if limit < 10:
            report["steps"][step.name] = {"status": "not run: the budget was spent", "seconds": 0}
            continue
        print(f"[gpu_check] {step.name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        try:
            report["steps"][step.name] = entry = run_child(step, limit, args.dry_run, log)
        except Stopped as stopped:
            report["steps"][step.name] = stopped.entry
            write_report(report, out)
            print(f"[gpu_check] stopped by {stopped} during {step.name}; what was measured is in {out}",
                  file=sys.stderr)
            return 5
        print(f"[gpu_check] {step.name}: {entry['status']} in {entry['seconds']:.0f} s", file=sys.stderr, flush=True)
        write_report(report, out)
        if step.name == "gpu" and entry["status"] != "ok" and not args.dry_run:
            print("[gpu_check] the GPU is not usable: stopping", file=sys.stderr)
            return 3
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    write_report(report, out)
    print((out / "gpu_check.md").read_text())
    return 0


def run_child(step: Step, limit: float, dry_run: bool, log: Path) -> dict[str, Any]:
    """Run ``step`` in a process of its own, killed at ``limit`` seconds; what it recorded before then is
    kept (each step writes its result file as it goes)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--out", folder, "--step", step.name,
                   "--result", str(result)] + (["--dry-run"] if dry_run else [])
        started = time.monotonic()
        with log.open("a") as sink:
            sink.write(f"\n===== {step.name} =====\n")
            sink.flush()
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                                       start_new_session=True)
            stopped = None
            try:
                code = process.wait(timeout=limit)
                status = "ok" if code == 0 else f"failed (exit status {code})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit:.0f} s"
            except Stopped as signal_received:  # the check itself was stopped: keep what the step measured
                status, stopped = f"stopped: {signal_received}", signal_received
            _end_group(process)  # the step, or what it left running (compile workers)
        entry = {"status": status, "seconds": round(time.monotonic() - started, 1), "limit_s": round(limit)}
        if result.exists():
            try:
                entry["result"] = json.loads(result.read_text())
            except json.JSONDecodeError as error:  # killed while writing
                entry["result"] = {"error": f"result unreadable: {error}"}
        if status != "ok":
            entry["log_tail"] = _tail(log, 25)
        if stopped is not None:
            stopped.entry = entry
            raise stopped
        return entry


class Stopped(Exception):
    """The check received SIGTERM or SIGINT (a harness's time limit): the running step is ended and what it
    measured is written before the check exits."""

    entry: dict[str, Any] | None = None


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _end_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the step and everything it started had already ended
        pass
    process.wait()


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


# --- the steps, each in its own process -------------------------------------------------------------------------

class Recorder:
    """A step's result, written to its file at every ``save`` so that a step killed at its limit keeps what it
    measured."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def save(self, **values: Any) -> None:
        self.data.update(values)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, default=str))
        temporary.replace(self.path)


def run_step(name: str, result: Path, dry_run: bool) -> int:
    record = Recorder(result)
    record.save(dry_run=dry_run)  # on every step's figures: a dry run's are the stand-in's, on a CPU
    with device_context(dry_run):
        if name == "gpu":
            gpu_step(record, dry_run)
        elif name == "tests":
            return tests_step(record, dry_run)
        elif name.startswith("model:"):
            model_step(name.removeprefix("model:"), record, dry_run, COMPILE_MODES[:1])
        elif name.startswith("autotune:"):
            model_step(name.removeprefix("autotune:"), record, dry_run, COMPILE_MODES[1:])
        elif name == "multi":
            multi_step(record, dry_run)
        elif name == "end-to-end":
            end_to_end_step(record, dry_run)
    return 0


@contextlib.contextmanager
def device_context(dry_run: bool):
    """The CUDA backend's device: the real one, or on a dry run the suite's stand-in on CPU tensors. On the GPU,
    float32 throughout: cuDNN's default TF32 convolutions round to 10 bits of mantissa, and every configuration
    is verified at float32's tolerance (as the suite's GPU tests run)."""
    if not dry_run:
        import torch

        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from cuda_standin import CudaStandIn

    from opsched.runtime import cuda

    with cuda.use_api(CudaStandIn()):
        yield


def gpu_step(record: Recorder, dry_run: bool) -> None:
    import torch

    from opsched.runtime import cuda

    api = cuda.current_api()
    record.save(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                describe=api.describe(), commit=_commit())
    if not dry_run:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=30)
        record.save(nvidia_smi=smi.stdout.strip() or smi.stderr.strip(), gpu=torch.cuda.get_device_name(),
                    multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count)
    size = 512 if dry_run else 4096
    a = torch.randn(size, size, device=api.device)
    product = a @ a
    api.synchronize()
    start, end = api.new_event(timing=True), api.new_event(timing=True)
    api.record(start, api.current_stream())
    for _ in range(10):
        product = a @ a
    api.record(end, api.current_stream())
    api.synchronize()
    ms = api.elapsed_ms(start, end) / 10
    record.save(sgemm_size=size, sgemm_ms=round(ms, 4), sgemm_tflops=round(2 * size ** 3 / ms / 1e9, 1),
                finite=bool(torch.isfinite(product).all()))


def _commit() -> str:
    """The commit measured: ``GPU_CHECK_COMMIT`` where the tree was copied without its history, else git's."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def tests_step(record: Recorder, dry_run: bool) -> int:
    """The suite's CUDA tests, in a pytest of their own (the stand-in's tests and, on a GPU, those marked to
    need one)."""
    report = record.path.with_name("junit.xml")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_cuda*.py"))
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rfEs",
               f"--junitxml={report}", *files]
    done = subprocess.run(command, check=False, cwd=ROOT)
    counts = junit_counts(report) if report.exists() else {}
    record.save(files=files, exit_status=done.returncode, **counts)
    return 0 if done.returncode == 0 else 1


def junit_counts(path: Path) -> dict[str, Any]:
    from xml.etree import ElementTree

    cases = list(ElementTree.parse(path).getroot().iter("testcase"))
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {"tests": len(cases), "failed": len(failed), "skipped": len(skipped),
            "passed": len(cases) - len(failed) - len(skipped), "failed_names": failed}


def model_step(key: str, record: Recorder, dry_run: bool, modes: list[str]) -> None:
    """One model at batch 1: every configuration verified against the model, then timed interleaved with CUDA
    events; torch.compile's ``modes`` are added one at a time, each followed by a timing of everything built
    so far, so that a compile that outlasts the step's limit still leaves the other figures."""
    import torch

    from opsched.cost.simulate import SimulatedGPU
    from opsched.evaluation import Candidate, evaluate, module_runner, reference_outputs
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.peers import cuda_graph_peer, eager
    from opsched.pipeline import cost_model, method_options, search
    from opsched.runtime import cuda
    from opsched.runtime.module import OptimizedModule

    spec, label, image, block = MODELS[key]
    api = cuda.current_api()
    started = time.perf_counter()
    loaded = load_model(spec, batch=1, image_size=DRY_IMAGE[key] if dry_run else image)
    model = loaded.model.eval().to(api.device)
    inputs = tuple(x.to(api.device) for x in loaded.inputs)
    graph = capture(model, inputs, name=key)
    captured_s = time.perf_counter() - started
    cost, operator = cost_model(graph, inputs, "measured", device="cuda", cache=False)
    profiled_s = time.perf_counter() - started - captured_s
    # the costs of plans replayed as CUDA graphs: the same runs queued behind a hold, their launches hidden
    replayed, _ = cost_model(graph, inputs, "measured", device="cuda", cache=False, replayed=True)
    replayed_s = time.perf_counter() - started - captured_s - profiled_s
    sim_name = simulated_device(api.describe())
    sim = SimulatedGPU(graph, sim_name)
    schedules, search_s = {}, {}
    for method, base, costs in [*((m, m, cost) for m in METHODS),
                                *((f"{m}{REPLAYED}", m, replayed) for m in REPLAYED_METHODS)]:
        began = time.perf_counter()
        schedules[method] = search(graph, costs, base, **method_options(
            base, max_block_size=8 if dry_run else block, default_streams=8))
        search_s[method] = round(time.perf_counter() - began, 3)
        record.save(model=label, search_s=search_s)  # a step stopped at its limit says how far its search got
    record.save(model=label, spec=spec, units=len(graph), input_shape=list(inputs[0].shape), sim=sim_name,
                capture_s=round(captured_s, 2), profile_s=round(profiled_s, 2), search_s=search_s,
                profile_replayed_s=round(replayed_s, 2), capacity=cost.capacity, contention=cost.contention,
                capacity_replayed=replayed.capacity, contention_replayed=replayed.contention,
                handoff_ms=cost.sync_overhead, handoff_replayed_ms=replayed.sync_overhead,
                unit_ms={name: round(cost.op_latency(i), 5) for name, i in graph.index.items()},  # to recalibrate
                unit_replayed_ms={name: round(replayed.op_latency(i), 5) for name, i in graph.index.items()},
                predicted_ms={m: s.predicted_latency for m, s in schedules.items()},
                simulated_ms={m: simulated_ms(graph, s, sim) for m, s in schedules.items()},
                stages={m: None if s.stages is None else len(s.stages) for m, s in schedules.items()})
    sync = api.synchronize
    candidates = [*eager(model, inputs, 1, sync), *cuda_graph_peer(model, inputs, sync)]
    for method, schedule in schedules.items():
        for graph_mode in (False, True) if not method.endswith(REPLAYED) else (True,):
            module = OptimizedModule(graph, schedule, 1, operator, device="cuda", cuda_graph=graph_mode)
            candidates.append(Candidate(f"{method}{'+graph' if graph_mode else ''}",
                                        module_runner(module, inputs, 1, sync)))
    reference = reference_outputs(model, inputs, torch.get_num_threads())
    repeats = 3 if dry_run else 15
    compile_s: dict[str, float] = {}
    dropped: dict[str, str] = {}
    for phase in [None, *modes]:
        if phase is not None:
            began = time.perf_counter()
            candidates.append(Candidate(f"compile:{phase}", compiled_runner(model, inputs, phase, sync), "peer"))
            compile_s[phase] = round(time.perf_counter() - began, 1)
        verified = evaluate(candidates, reference, repeats=repeats)
        dropped.update(verified.dropped)
        kept = [c for c in candidates if c.name in verified.measured_ms]
        events = event_medians(kept, verified, rounds=3 if dry_run else 5, repeats=3 if dry_run else 10)
        record.save(compile_s=compile_s, event_ms=events, wall_ms=verified.measured_ms, errors=verified.errors,
                    dropped=dropped, noise_floor=verified.noise_floor, chosen=verified.chosen, tie=verified.tie,
                    compile_modes_timed=[m for m in modes if f"compile:{m}" in verified.measured_ms])
        candidates = kept


def compiled_runner(model: Any, inputs: tuple, mode: str, sync: Any) -> Any:
    """``torch.compile(model, mode=mode)`` with inductor's freezing (PyTorch's setting for inference, as the
    ``torch_compile`` peer compiles; opsched's capture folds batch norms too), compiled (and, for reduce-overhead,
    its CUDA graph recorded) before it is timed."""
    import torch
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode)

    def run() -> Any:
        torch.compiler.cudagraph_mark_step_begin()  # each call a new step: its outputs replace the last call's
        with torch.no_grad():
            out = compiled(*inputs)
        sync()
        return out

    with inductor_config.patch(freezing=True):
        for _ in range(3):  # compiles on the first call; cudagraph trees record on the second, replay from the third
            run()
    return run


def event_medians(candidates: list, verified: Any, rounds: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per call with CUDA events around each call, the candidates interleaved round by
    round so that drift spreads over all of them."""
    from opsched.runtime import cuda

    samples: dict[str, list[float]] = {c.name: [] for c in candidates}
    for _ in range(rounds):
        for c in candidates:
            samples[c.name].append(cuda.time_cuda(verified.runs.get(c.name, c.run), repeats=repeats, warmup=1))
    return {name: round(statistics.median(s), 4) for name, s in samples.items()}


def simulated_device(describe: str) -> str:
    """The simulator's catalogue GPU closest to the device ``describe`` names (``v100`` when none matches)."""
    for marker, name in SIM_NAMES.items():
        if marker in describe:
            return name
    return "v100"


def simulated_ms(graph: Any, schedule: Any, sim: Any) -> float:
    """What the simulated GPU predicts for ``schedule`` (a schedule found with measured costs)."""
    from opsched.schedule import from_stages, from_streams

    index = graph.index
    if schedule.stages is not None:
        stages = [(st.strategy, [[index[u] for u in g] for g in st.groups]) for st in schedule.stages]
        return round(from_stages(graph, sim, schedule.method, stages).predicted_latency, 4)
    streams = [[index[u] for u in units] for units in schedule.streams()]
    return round(from_streams(graph, sim, schedule.method, streams).predicted_latency, 4)


def multi_step(record: Recorder, dry_run: bool) -> None:
    """Several models on the device, through the pipeline ``opsched multi --cuda-graph`` runs
    (:func:`opsched.multi.optimize`): the fused plans replayed as CUDA graphs against the models one after another
    (eager, and captured as one CUDA graph), on threads (a stream each) and vmap; then fused training against
    training one after another."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from multi import copies, shared_extractor, small_cnn

    from opsched.multi.optimize import optimize
    from opsched.multi.train import compare_training
    from opsched.runtime import cuda

    device = cuda.current_api().device
    repeats = 3 if dry_run else 15
    # a dry run has fewer models: the stand-in replays a captured graph slowly, kernel by kernel on the host
    count, heads = (4, 2) if dry_run else (16, 8)
    cases = [(f"{count} small CNNs, batch 1, 32 px", lambda: copies(small_cnn, count), (1, 3, 32, 32)),
             (f"ResNet-18 trunk with {heads} heads, batch 1, 64 px", lambda: shared_extractor(heads), (1, 3, 64, 64))]
    for title, make, shape in cases:
        torch.manual_seed(0)
        models = [m.to(device) for m in make()]
        x = torch.randn(*shape, device=device)
        began = time.perf_counter()
        result = optimize(models, (x,), repeats=repeats, cache=False, cuda_graph=True, device="cuda")
        evaluation = result.outcome.evaluation
        ms = evaluation.measured_ms
        best_peer = evaluation.fastest("peer")
        plan = evaluation.fastest("schedule")
        record.save(**{title: {
            "measured_ms": ms, "chosen": evaluation.chosen, "model_error": max(result.model_errors),
            "dropped": evaluation.dropped, "noise_floor": evaluation.noise_floor, "plan": plan,
            "best_peer": best_peer, "seconds": round(time.perf_counter() - began, 1),
            "plan_over_one_after_another": _ratio(ms, "sequential_models", plan),
            "plan_over_best_peer": _ratio(ms, best_peer, plan)}})
    torch.manual_seed(0)
    models = [m.to(device) for m in copies(small_cnn, 8)]
    x = torch.randn(4, 3, 32, 32, device=device)
    training = compare_training(models, (x,), steps=5 if dry_run else 21, device="cuda")
    record.save(training={k: v for k, v in training.items() if not isinstance(v, torch.Tensor)})


def _ratio(ms: dict[str, float], slower: str | None, faster: str | None) -> float | None:
    if not slower or not faster or slower not in ms or faster not in ms:
        return None
    return round(ms[slower] / ms[faster], 3)


def end_to_end_step(record: Recorder, dry_run: bool) -> None:
    """``opsched optimize --device cuda`` as a user runs it (its JSON), and ``torch.compile(backend="opsched")``
    verified and timed beside eager."""
    import torch
    import torchvision

    from opsched.cli import main as cli
    from opsched.evaluation import Candidate, evaluate, module_runner, reference_outputs
    from opsched.peers import eager
    from opsched.runtime import cuda

    size = 64 if dry_run else 224
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "plan.json"
        answer = Path(folder) / "answer.json"
        with answer.open("w") as sink, contextlib.redirect_stdout(sink):
            code = cli(["optimize", "torchvision:googlenet", "--device", "cuda", "--image-size", str(size),
                        "--cuda-graph", "--no-cache", "--json", "-q", "--out", str(plan),
                        "--repeats", "3" if dry_run else "15"])
        text = answer.read_text()
        summary = json.loads(text) if code == 0 and text.strip() else {"output": text[-2000:]}
        record.save(optimize={key: summary.get(key) for key in ("chosen", "measured_ms", "max_errors", "dropped",
                                                                 "warnings", "output")} | {"exit_status": code})
    api = cuda.current_api()
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(api.device)
    x = torch.randn(1, 3, size, size, device=api.device)
    began = time.perf_counter()
    compiled = torch.compile(model, backend="opsched")
    with torch.no_grad():
        compiled(x)
    compile_s = time.perf_counter() - began
    sync = api.synchronize
    verified = evaluate([*eager(model, (x,), 1, sync),
                         Candidate("backend_opsched", module_runner(_no_grad(compiled), (x,), 1, sync))],
                        reference_outputs(model, (x,), torch.get_num_threads()), repeats=3 if dry_run else 15)
    record.save(backend={"model": "resnet18", "compile_s": round(compile_s, 1), "wall_ms": verified.measured_ms,
                         "errors": verified.errors, "dropped": verified.dropped})


def _no_grad(module: Any) -> Any:
    import torch

    def call(*inputs: Any) -> Any:
        with torch.no_grad():
            return module(*inputs)

    return call


# --- the report -------------------------------------------------------------------------------------------------

def markdown(report: dict[str, Any]) -> str:
    """The figures of ``report`` as tables, with the machine, and each goal beside what was measured."""
    steps = report["steps"]
    gpu = steps.get("gpu", {}).get("result", {})
    lines = ["# gpu_check" + (" (DRY RUN: the stand-in on a CPU, figures meaningless)" if report["dry_run"] else ""),
             "", (f"Started {report['started']} on {report['host']}; Python {report['python']}, PyTorch "
             f"{gpu.get('torch')}, CUDA {gpu.get('cuda')}, opsched commit {gpu.get('commit')}."),
             (f"GPU: {gpu.get('nvidia_smi', gpu.get('describe'))}; a {gpu.get('sgemm_size')}-square float32 matrix "
             f"product {gpu.get('sgemm_ms')} ms ({gpu.get('sgemm_tflops')} TFLOP/s)."), "",
             "## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {e['status']} | {e['seconds']} |" for name, e in steps.items()]
    tests = steps.get("tests", {}).get("result")
    if tests:
        lines += ["", (f"CUDA tests: {tests.get('passed')} passed, {tests.get('failed')} failed, "
                  f"{tests.get('skipped')} skipped ({', '.join(tests.get('files', []))}).")]
        lines += [f"- failed: {n}" for n in tests.get("failed_names", [])]
    models = [(n, e["result"]) for n, e in steps.items()
              if n.split(":")[0] in ("model", "autotune") and e.get("result", {}).get("event_ms")]
    if models:
        names = ["eager", "cuda_graph", *[f"compile:{m}" for m in COMPILE_MODES],
                 *[f"{m}{suffix}" for m in METHODS for suffix in ("", "+graph")],
                 *[f"{m}{REPLAYED}+graph" for m in REPLAYED_METHODS]]
        lines += ["", "## One model, batch 1: milliseconds per call (CUDA events, medians of interleaved rounds)", "",
                  ("CUDA events are recorded around each call on the current stream, and a call ends by "
                   "synchronising: the times include the host's launches, as a caller waits for them. `chosen` is "
                   "this check's choice among every configuration (wall clock, above the run's noise, "
                   "opsched.noise); the ratios are of CUDA-event medians. A step marked partial stopped at its "
                   "limit: its figures are those of the last phase it finished."), "",
                  "| step | units | " + " | ".join(names) + " | chosen | chosen over cuda_graph | over best compile "
                  "| IOS+graph over cuda_graph | IOS@replayed+graph over cuda_graph |", "|---|---|" + "---|" * (len(names) + 5)]
        for step, r in models:
            ms = r["event_ms"]
            compiled = [ms[n] for n in ms if n.startswith("compile:")]
            chosen = r.get("chosen")
            partial = "" if steps[step]["status"] == "ok" else " (partial)"
            lines.append(f"| {step}{partial} | {r['units']} | " + " | ".join(_cell(ms.get(n)) for n in names)
                         + f" | {chosen} | {_speedup(ms.get('cuda_graph'), ms.get(chosen))}"
                         f" | {_speedup(min(compiled) if compiled else None, ms.get(chosen))}"
                         f" | {_speedup(ms.get('cuda_graph'), ms.get('ios+graph'))}"
                         f" | {_speedup(ms.get('cuda_graph'), ms.get(f'ios{REPLAYED}+graph'))} |")
        lines += ["", "## Predictions beside the measurements (CUDA events)", "",
                  ("| step | method | streams ms | measured-cost prediction (error) | as a CUDA graph ms | simulated "
                  "(error against streams; against the graph) | search s |"), "|---|---|---|---|---|---|---|"]
        for step, r in models:
            for m in [*METHODS, *(f"{m}{REPLAYED}" for m in REPLAYED_METHODS)]:
                if m not in r["predicted_ms"]:  # a record from before the replayed costs
                    continue
                streams, graph = r["event_ms"].get(m), r["event_ms"].get(f"{m}+graph")
                lines.append(f"| {step} | {m} | {_cell(streams)} | "
                             f"{_cell(r['predicted_ms'][m])} ({_error(r['predicted_ms'][m], graph if REPLAYED in m else streams)}) | "
                             f"{_cell(graph)} | {_cell(r['simulated_ms'][m])} sim:{r['sim']} "
                             f"({_error(r['simulated_ms'][m], streams)}; {_error(r['simulated_ms'][m], graph)}) | "
                             f"{r['search_s'][m]} |")
        lines.append(f"\nMethods marked {REPLAYED} were searched on costs measured with their launches hidden, as "
                     "a replayed CUDA graph runs (opsched optimize --cuda-graph's costs); their prediction is of the "
                     "graph, not of streams.")
        for step, r in models:
            lines += [f"- {step}: dropped {name}: {why}" for name, why in r.get("dropped", {}).items()]
            lines.append(f"- {step}: capture {r['capture_s']} s, profile {r['profile_s']} s, torch.compile seconds "
                         f"{r.get('compile_s') or '-'}, largest scaled error "
                         f"{max(r.get('errors', {}).values(), default=0):.1e}")
    multi = steps.get("multi", {}).get("result")
    if multi:
        lines += ["", "## Several models (opsched multi's pipeline on the device; wall clock, ms per call)", "",
                  ("| case | plan | plan ms | one after another ms | the same as one CUDA graph ms | best peer (ms) | "
                   "plan over one after another | over best peer | largest scaled error |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for title, case in multi.items():
            if title == "training" or not isinstance(case, dict):  # training has a line of its own; dry_run a flag
                continue
            ms = case["measured_ms"]
            lines.append(f"| {title} | {case['plan']} | {_cell(ms.get(case['plan']))} | "
                         f"{_cell(ms.get('sequential_models'))} | {_cell(ms.get('cuda_graph'))} | {case['best_peer']} "
                         f"({_cell(ms.get(case['best_peer']))}) | {case['plan_over_one_after_another']} | "
                         f"{case['plan_over_best_peer']} | {case['model_error']:.1e} |")
        training = multi.get("training")
        if training:
            lines.append(f"\nFused training of 8 small CNNs at batch 4: {json.dumps(_brief(training))}")
    e2e = steps.get("end-to-end", {}).get("result")
    if e2e:
        lines += ["", "## End to end", "", (f"- `opsched optimize torchvision:googlenet --device cuda --cuda-graph`: "
                  f"{json.dumps(e2e.get('optimize'))}"), (f"- `torch.compile(resnet18, backend=\"opsched\")`: "
                  f"{json.dumps(e2e.get('backend'))}")]
    goals = [(s.name, s.goal) for s in STEPS if s.goal]
    lines += ["", "## Goals", ""] + [f"- {name}: {goal}" for name, goal in goals]
    return "\n".join(lines) + "\n"


def _brief(training: dict[str, Any]) -> dict[str, Any]:
    keys = ("verified", "why", "param_error", "max_param_diff", "float32_noise", "method", "steps", "ms_per_step",
            "speedup", "speedup_interval_99", "above_noise")
    return {k: training[k] for k in keys if k in training}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _speedup(slower: float | None, faster: float | None) -> str:
    return "-" if not slower or not faster else f"{slower / faster:.2f}x"


def _error(predicted: float, measured: float | None) -> str:
    return "-" if not measured else f"{100 * (predicted / measured - 1):+.0f}%"


if __name__ == "__main__":
    sys.exit(main())
