"""How far the cost models are from what they model.

Part 1, SIMULATED: the simulated GPUs beside what IOS published for a V100 at batch 1 (sequential and IOS
schedule latencies), the K80/V100 ratio on Inception V3, and Inception V3 at batch 1 and 32. Nothing runs:
every opsched figure in this part is simulated.

Part 2, MEASURED on this CPU: for each model, the measured cost model's stage predictions (from the
units' in-place timings, before the stage was measured) against the stages measured in place, and the
whole IOS and sequential schedules as predicted against their runs timed afterwards (interleaved with
each other, medians). Median and worst absolute error.

    python benchmarks/cost_accuracy.py [--part sim|cpu|both] [--models ...] [--repeats 9]
                                       [--out docs/cost_accuracy.jsonl]

Every row printed is also appended to --out as a JSON line (its table, its figures, the machine, versions, date
and commit): docs/cost-models.md's tables.
"""

import argparse
import statistics

import torch
from sweep import appender

from opsched.cost.measure import stages_of
from opsched.cost.simulate import SimulatedGPU
from opsched.evaluation import evaluate, reference_outputs
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.pipeline import method_options, schedule_candidates, search
from opsched.runtime.profile import measured_cost
from opsched.schedulers import make_schedule

PUBLISHED_LIOS_RTX3080 = {"inception_v3": "1.59x", "nasnet": "1.36x", "randwire": "1.13x",
                          "squeezenet": "below 1x"}
PUBLISHED_V100 = {"inception_v3": (6.51, 4.03), "randwire": (8.49, 6.02), "nasnet": (22.95, 16.04),
                  "squeezenet": (0.86, 0.73)}


class Record:
    """Appends each row, named by its table, with where and when it was made, to a JSON-lines file."""

    def __init__(self, path: str):
        self.append = appender(path)

    def __call__(self, table: str, **row) -> None:
        self.append({"table": table, **row})


def simulated(max_block_size: int, record: Record) -> None:
    print("## Simulated GPUs against IOS's published V100 figures (batch 1; opsched figures are SIMULATED)\n")
    print("| model | published seq ms | simulated seq ms | ratio | published IOS ms | simulated IOS ms | ratio | "
          "published speedup | simulated speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    graphs = {}
    for name, (seq_pub, ios_pub) in PUBLISHED_V100.items():
        m = load_model(name, batch=1)
        g = graphs[name] = capture(m.model, m.inputs)
        sim = SimulatedGPU(g, "v100")
        seq = make_schedule("sequential", g, sim).predicted_latency
        ios = make_schedule("ios", g, sim, max_block_size=max_block_size).predicted_latency
        record("v100 against IOS's paper", model=name, simulated=True, published_sequential_ms=seq_pub,
               sequential_ms=round(seq, 4), published_ios_ms=ios_pub, ios_ms=round(ios, 4),
               sequential_ratio=round(seq / seq_pub, 4), ios_ratio=round(ios / ios_pub, 4),
               published_speedup=round(seq_pub / ios_pub, 4), speedup=round(seq / ios, 4))
        print(f"| {name} | {seq_pub} | {seq:.2f} | {seq / seq_pub:.2f} | {ios_pub} | {ios:.2f} | {ios / ios_pub:.2f} | "
              f"{seq_pub / ios_pub:.2f}x | {seq / ios:.2f}x |", flush=True)
    g = graphs["inception_v3"]
    print("\n| Inception V3, simulated | sequential ms | IOS ms | speedup |\n|---|---|---|---|")
    rows = [(f"sim:{d} batch 1", g, d) for d in ("v100", "k80", "a100", "h100", "t4", "rtx3080")]
    m = load_model("inception_v3", batch=32)
    rows.append(("sim:v100 batch 32", capture(m.model, m.inputs), "v100"))
    for label, graph, device in rows:
        sim = SimulatedGPU(graph, device)
        seq = make_schedule("sequential", graph, sim).predicted_latency
        ios = make_schedule("ios", graph, sim, max_block_size=max_block_size).predicted_latency
        record("Inception V3 on each simulated GPU", device=label, simulated=True, sequential_ms=round(seq, 4),
               ios_ms=round(ios, 4), speedup=round(seq / ios, 4))
        print(f"| {label} | {seq:.2f} | {ios:.2f} | {seq / ios:.2f}x |", flush=True)
    print("\n(published: K80 about 3.4x slower than V100 on Inception V3)\n")
    print("## Held out: LIOS over sequential on the RTX 3080 (8 streams; opsched figures are SIMULATED)\n")
    print("| model | published | simulated |\n|---|---|---|")
    for name, published in PUBLISHED_LIOS_RTX3080.items():
        sim = SimulatedGPU(graphs[name], "rtx3080")
        seq = make_schedule("sequential", graphs[name], sim).predicted_latency
        lios = make_schedule("lios", graphs[name], sim, streams=8).predicted_latency
        record("LIOS on the RTX 3080, held out", model=name, simulated=True, published=published,
               sequential_ms=round(seq, 4), lios_ms=round(lios, 4), speedup=round(seq / lios, 4))
        print(f"| {name} | {published} | {seq / lios:.2f}x |", flush=True)
    print()


def measured(models: list[str], repeats: int, max_block_size: int, record: Record) -> None:
    print("## Measured cost model on this CPU (every figure measured)\n")
    print("| model | stages compared | stage error median / worst (from units) | schedule | predicted ms | "
          "measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    whole_errors = []
    cores = torch.get_num_threads()
    for name in models:
        m = load_model(name, batch=1)
        m.model.eval()
        g = capture(m.model, m.inputs)
        cost = measured_cost(g, m.inputs, cores=cores, cache=False)
        schedules = {k: search(g, cost, k, **method_options(k, max_block_size=max_block_size))
                     for k in ("sequential", "ios")}
        pairs = [(cost.predicted_when_measured[s], cost.measured_stages[s])
                 for s in cost.predicted_when_measured if s in cost.measured_stages
                 and (s[0] == "merge" or len(s[1]) > 1)]
        stage_errors = [abs(p / q - 1.0) for p, q in pairs if q > 0]
        candidates, _ = schedule_candidates(g, schedules, None, m.inputs, cores)
        timed = evaluate(candidates, reference_outputs(m.model, m.inputs, cores), repeats=repeats).measured_ms
        for k, s in schedules.items():
            error = s.predicted_latency / timed[k] - 1.0
            whole_errors.append(abs(error))
            stage_text = (f"{len(stage_errors)} | {100 * statistics.median(stage_errors):.0f}% / "
                          f"{100 * max(stage_errors):.0f}%") if stage_errors and k == "ios" else " | "
            record("measured cost model on this CPU", model=name, simulated=False, schedule=k,
                   stages=len(stages_of(s, g)), predicted_ms=round(s.predicted_latency, 4), measured_ms=round(timed[k], 4),
                   stage_errors=[round(e, 4) for e in stage_errors] if k == "ios" else None)
            print(f"| {name} | {stage_text} | {k} ({len(stages_of(s, g))} stages) | {s.predicted_latency:.1f} | "
                  f"{timed[k]:.1f} | {100 * error:+.0f}% |", flush=True)
        # what IOS gains over sequential, predicted and measured in one interleaved timing
        predicted = schedules["ios"].predicted_latency / schedules["sequential"].predicted_latency
        measured_ratio = timed["ios"] / timed["sequential"]
        record("IOS over sequential on this CPU", model=name, simulated=False, predicted_ratio=round(predicted, 3),
               measured_ratio=round(measured_ratio, 3), error=round(predicted / measured_ratio - 1.0, 3))
    print(f"\nwhole schedules: median absolute error {100 * statistics.median(whole_errors):.0f}%, "
          f"worst {100 * max(whole_errors):.0f}% (measured)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["sim", "cpu", "both"], default="both")
    parser.add_argument("--models", nargs="+", default=["squeezenet", "inception_v3", "randwire", "nasnet",
                                                        "torchvision:googlenet"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max-block-size", type=int, default=20)
    parser.add_argument("--out", default="docs/cost_accuracy.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    record = Record(args.out)
    if args.part in ("sim", "both"):
        simulated(args.max_block_size, record)
    if args.part in ("cpu", "both"):
        measured(args.models, args.repeats, args.max_block_size, record)


if __name__ == "__main__":
    main()
