"""Measured on a GPU, beside the simulator: every zoo model, each scheduler (sequential, greedy, LIOS, Nimble,
IOS) searched with costs measured on this GPU, each schedule run on CUDA streams and replayed as one CUDA
graph, verified against eager PyTorch and timed with CUDA events; beside each figure, what the simulated GPU
(``sim:NAME``, the catalogue device closest to this one) predicts for the same schedule, so that the
simulator's error per network on a real device is known. Writes docs/gpu.md (IOS's README table, measured).

    python benchmarks/gpu_zoo.py [--models inception_v3 ...] [--batch 1] [--sim v100] [--repeats 60]

Needs a CUDA device: without one it says so in one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from opsched.cost.devices import DEVICES
from opsched.cost.simulate import SimulatedGPU
from opsched.evaluation import Candidate, evaluate, module_runner, reference_outputs
from opsched.graph.capture import capture
from opsched.models import ZOO, load_model
from opsched.pipeline import cost_model, method_options, search
from opsched.runtime import cuda
from opsched.runtime.module import OptimizedModule
from opsched.schedule import from_stages, from_streams

METHODS = ["sequential", "greedy", "lios", "nimble", "ios"]
LABELS = {"sequential": "Sequential", "greedy": "Greedy", "lios": "LIOS", "nimble": "Nimble", "ios": "IOS"}
# a GPU's marketing name -> the catalogue entry that models it
NAMES = {"V100": "v100", "A100": "a100", "H100": "h100", "T4": "t4", "3080": "rtx3080", "K80": "k80"}
ROUNDS = 5  # timings are taken in interleaved rounds, so that drift spreads over every configuration


def simulated_device(gpu_name: str, chosen: str | None) -> str:
    """The catalogue device for this GPU (``--sim`` overrides)."""
    if chosen:
        return chosen.removeprefix("sim:")
    for marker, name in NAMES.items():
        if marker in gpu_name:
            return name
    return "v100"


def simulated_ms(graph, schedule, sim: SimulatedGPU) -> float:
    """What the simulator predicts for ``schedule`` (found with measured costs)."""
    index = graph.index
    if schedule.stages is not None:
        stages = [(st.strategy, [[index[u] for u in g] for g in st.groups]) for st in schedule.stages]
        return from_stages(graph, sim, schedule.method, stages).predicted_latency
    streams = [[index[u] for u in units] for units in schedule.streams()]
    return from_streams(graph, sim, schedule.method, streams).predicted_latency


def one_model(name: str, batch: int, sim_name: str, repeats: int, max_block_size: int) -> dict:
    api = cuda.current_api()
    loaded = load_model(name, batch=batch)
    model = loaded.model.eval().to(api.device)
    inputs = tuple(x.to(api.device) for x in loaded.inputs)
    graph = capture(model, inputs, name=name)
    started = time.perf_counter()
    cost, operator = cost_model(graph, inputs, "measured", device="cuda")
    sim = SimulatedGPU(graph, sim_name)
    schedules = {m: search(graph, cost, m, **method_options(m, max_block_size=max_block_size, default_streams=8))
                 for m in METHODS}
    searched = time.perf_counter() - started
    candidates = [Candidate("eager", module_runner(model, inputs, 1, api.synchronize), "peer")]
    for method, schedule in schedules.items():
        for graph_mode in (False, True):
            module = OptimizedModule(graph, schedule, 1, operator, device="cuda", cuda_graph=graph_mode)
            candidates.append(Candidate(f"{method}{'+graph' if graph_mode else ''}",
                                        module_runner(module, inputs, 1, api.synchronize)))
    verified = evaluate(candidates, reference_outputs(model, inputs, torch.get_num_threads()), repeats=3)
    kept = [c for c in candidates if c.name in verified.measured_ms]
    samples: dict[str, list[float]] = {c.name: [] for c in kept}
    for _ in range(ROUNDS):
        for c in kept:
            samples[c.name].append(cuda.time_cuda(c.run, repeats=max(1, repeats // ROUNDS), warmup=1))
    measured = {n: statistics.median(s) for n, s in samples.items()}
    rows = []
    for method, schedule in schedules.items():
        rows.append({"method": method, "streams_ms": measured.get(method), "graph_ms": measured.get(f"{method}+graph"),
                     "predicted_ms": schedule.predicted_latency, "simulated_ms": simulated_ms(graph, schedule, sim),
                     "search_s": schedule.stats.get("search_seconds")})
    return {"model": name, "units": len(graph), "eager_ms": measured.get("eager"), "rows": rows,
            "dropped": verified.dropped, "profile_and_search_s": searched, "capacity": cost.capacity,
            "contention": cost.contention}


def _ms(value: float | None) -> str:
    return "dropped" if value is None else f"{value:.2f}"


def _error(predicted: float, measured: float | None) -> str:
    return "-" if not measured else f"{100 * (predicted / measured - 1):+.0f}%"


def markdown(results: list[dict], gpu: str, sim_name: str, batch: int) -> str:
    """docs/gpu.md: the measured table in IOS's README layout, then each schedule beside its predictions."""
    lines = ["# opsched on a GPU: measured, beside the simulator", "",
             (f"Measured with `python benchmarks/gpu_zoo.py` on **{gpu}** ({datetime.date.today()}, PyTorch "
             f"{torch.__version__}, CUDA {torch.version.cuda}), batch {batch}: milliseconds per inference, CUDA "
             "events around each call, medians of interleaved rounds; every schedule verified against eager "
             "PyTorch first. Schedules were searched with costs measured on this GPU. The simulated column "
             f"is `sim:{sim_name}`'s prediction for the same schedule."), "",
             "## Latency (ms), IOS's README layout", "",
             "| network | eager | " + " | ".join(LABELS[m] for m in METHODS) + " | IOS speedup over sequential |",
             "|---|---|" + "---|" * len(METHODS) + "---|"]
    for mode, key in (("streams", "streams_ms"), ("CUDA graph", "graph_ms")):
        for r in results:
            by = {row["method"]: row[key] for row in r["rows"]}
            speedup = f"{by['sequential'] / by['ios']:.2f}x" if by.get("sequential") and by.get("ios") else "-"
            lines.append(f"| {r['model']} ({mode}) | {_ms(r['eager_ms'])} | "
                         + " | ".join(_ms(by.get(m)) for m in METHODS) + f" | {speedup} |")
    lines += ["", "## Each schedule: measured, the measured cost model's prediction, the simulator's", "",
              ("| network | method | streams ms | CUDA graph ms | measured-cost prediction (error) | "
               f"sim:{sim_name} (error) | search s |"), "|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            lines.append(f"| {r['model']} | {row['method']} | {_ms(row['streams_ms'])} | {_ms(row['graph_ms'])} | "
                         f"{row['predicted_ms']:.2f} ({_error(row['predicted_ms'], row['streams_ms'])}) | "
                         f"{row['simulated_ms']:.2f} ({_error(row['simulated_ms'], row['streams_ms'])}) | "
                         f"{row['search_s'] or 0:.1f} |")
    lines += ["", f"## The simulator's error per network (sim:{sim_name} against streams, measured)", "",
              "| network | units | mean abs error | IOS error | measured capacity | contention |",
              "|---|---|---|---|---|---|"]
    for r in results:
        errors = [abs(row["simulated_ms"] / row["streams_ms"] - 1) for row in r["rows"] if row["streams_ms"]]
        ios = next(row for row in r["rows"] if row["method"] == "ios")
        mean = f"{100 * statistics.mean(errors):.0f}%" if errors else "-"
        lines.append(f"| {r['model']} | {r['units']} | {mean} | {_error(ios['simulated_ms'], ios['streams_ms'])} | "
                     f"{r['capacity']:.2f} | {r['contention']:.2f} |")
    dropped = [f"- {r['model']}: {name} dropped: {why}" for r in results for name, why in r["dropped"].items()]
    if dropped:
        lines += ["", "Dropped (failed or did not verify):", "", *dropped]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(ZOO))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sim", choices=[*DEVICES, *(f"sim:{d}" for d in DEVICES)],
                        help="the simulated device to compare with (default: the one matching this GPU's name)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--max-block-size", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "gpu.md"))
    args = parser.parse_args()
    if not cuda.available():
        print("gpu_zoo: PyTorch sees no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 1
    gpu = cuda.current_api().describe().split("|")[1]
    sim_name = simulated_device(gpu, args.sim)
    results = []
    for name in args.models:
        print(f"{name} ...", file=sys.stderr, flush=True)
        results.append(one_model(name, args.batch, sim_name, args.repeats, args.max_block_size))
        Path(args.out).write_text(markdown(results, gpu, sim_name, args.batch))  # a partial table survives a crash
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
