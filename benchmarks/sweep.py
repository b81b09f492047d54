"""Every classification model we can load, through the whole pipeline as a user would run it: capture, the
measured cost model, sequential and IOS schedules (and, with ``--kernels auto`` where it offers it, the whole graph
on Inductor, as a plain ``opsched optimize`` makes them), execution, verification against eager (each output at its
own scale, opsched.compare), and the interleaved timing of every candidate beside the peers; the configuration
opsched chooses (above the run's noise, opsched.noise) and how its best plan compares with eager and with the
fastest peer. Every figure is measured on this machine.

Each model runs in its own process (a crash, a hang or a memory blow-up costs that model only, and is a
row of the table); rows are appended to OUT.jsonl as they finish, so an interrupted sweep resumes. Each row
records the machine, the versions and the date, its noise floor (one program timed twice in the same rounds)
and which candidates ran as one program.

    python benchmarks/sweep.py [--models NAME ...] [--image-size N] [--peers] [--kernels auto|eager|...]
                               [--timeout 900] [--out docs/sweep]

Without --image-size each model runs at its own usual input size. Writes OUT.jsonl and OUT.md (the table).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from opsched.provenance import machine

# every torchvision classifier but the ones a 2-core, 24 GiB machine cannot time in minutes (over 100 GFLOPs)
TORCHVISION_TOO_LARGE = {"regnet_y_128gf", "vit_h_14"}
TIMM = ["resnet26d", "dla34", "dpn68", "hrnet_w18_small", "inception_v4", "legacy_xception", "mixnet_s",
        "tf_efficientnet_b0", "ghostnet_100", "res2net50_26w_4s", "selecsls42b", "rexnet_100", "cspresnet50",
        "levit_128", "mobilevit_s", "regnety_008", "fbnetc_100", "semnasnet_100", "tinynet_a", "lcnet_050",
        "convnext_atto", "resnest14d", "skresnet18", "vovnet39a", "ese_vovnet19b_dw", "repvgg_a0",
        "inception_resnet_v2", "efficientvit_b0", "fastvit_t8", "poolformer_s12", "gcresnet33ts", "resnetv2_50",
        "deit_tiny_patch16_224", "nf_resnet26", "mobilenetv3_large_100", "efficientnet_b0", "resnet18d",
        "densenet121", "xception41", "coat_lite_tiny", "mixer_b16_224", "crossvit_tiny_240", "edgenext_small"]


def models() -> list[str]:
    import torchvision

    names = [n for n in torchvision.models.list_models(module=torchvision.models) if n not in TORCHVISION_TOO_LARGE]
    return [f"torchvision:{m}" for m in names] + [f"timm:{m}" for m in TIMM]


def appender(path: str | Path):
    """A function that appends each row it is given, with where and when it was measured (:func:`machine`, read
    once), as one JSON line to ``path``, and returns the row as written."""
    where = machine()

    def append(row: dict) -> dict:
        row = {**row, **where}
        with Path(path).open("a") as sink:
            sink.write(json.dumps(row) + "\n")
        return row

    return append


def one(spec: str, image_size: int, peers: bool, repeats: int, kernels: str = "auto") -> dict:
    """One model through the pipeline (in this process), its units on ``kernels`` (``auto``: as a plain
    ``opsched optimize`` runs them)."""
    import torch

    from opsched.commands.optimize import explain
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.pipeline import Workload, method_options, run_workload

    row: dict = {"model": spec, "image_size": image_size, **machine()}
    began = time.perf_counter()
    try:
        loaded = load_model(spec, batch=1, image_size=image_size)
        loaded.model.eval()
        graph = capture(loaded.model, loaded.inputs, name=loaded.name)
    except Exception as e:  # noqa: BLE001 - some models take only their own size (ViT's patch grid): retry at it
        row.update(image_size=None, smaller_size_failed=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        loaded = load_model(spec, batch=1)
        loaded.model.eval()
        graph = capture(loaded.model, loaded.inputs, name=loaded.name)
    row.update(units=len(graph), width=graph.width, capture_seconds=round(time.perf_counter() - began, 1))
    methods = {m: (m, method_options(m)) for m in ("sequential", "ios")}
    outcome = run_workload(Workload(loaded.model, tuple(loaded.inputs), graph, methods, repeats=repeats,
                                    cores=torch.get_num_threads(), kernels=kernels,
                                    peers=("eager", "torch_compile", "onnxruntime") if peers else ("eager",),
                                    whole_on_inductor=True))
    ev = outcome.evaluation
    best_plan, best_peer = ev.fastest("schedule"), ev.fastest("peer")
    row.update(input_shape=list(loaded.inputs[0].shape), kernels=kernels,
               kernel_choice=getattr(outcome.cost, "kernel_choice", None),
               measured_ms={k: round(v, 3) for k, v in ev.measured_ms.items()}, errors=ev.errors,
               abs_errors=ev.abs_errors, dropped=ev.dropped, warnings=ev.warnings + outcome.notes, chosen=ev.chosen,
               tie=ev.tie, noise=ev.noise(), verified=all(m in ev.measured_ms for m in methods),
               max_error=max((ev.errors[m] for m in methods if m in ev.errors), default=None),
               best_plan=best_plan, best_peer=best_peer,
               plan_over_peer=ev.ratio(best_plan, best_peer) if best_plan and best_peer else None,
               ios=explain(outcome.schedules["ios"], graph, outcome.cost),
               seconds=round(time.perf_counter() - began, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help="default: every torchvision classifier (but the "
                        "two largest) and 43 timm models")
    parser.add_argument("--image-size", type=int, default=None, help="default: each model's usual size")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--peers", action="store_true", help="also torch.compile and ONNX Runtime")
    parser.add_argument("--kernels", default="auto", choices=["auto", "eager", "inductor", "onnxruntime"],
                        help="the units' kernels (default auto, as opsched optimize; the sweep of 2026-11-26 ran "
                             "eager, the default then)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model")
    parser.add_argument("--out", default="docs/sweep")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.image_size, args.peers, args.repeats, args.kernels)))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_path = out.with_suffix(".jsonl")
    done = {json.loads(line)["model"] for line in rows_path.read_text().splitlines()} if rows_path.exists() else set()
    for spec in args.models or models():
        if spec in done:
            continue
        command = ([sys.executable, __file__, "--one", spec, "--repeats", str(args.repeats), "--kernels", args.kernels]
                   + (["--image-size", str(args.image_size)] if args.image_size else [])
                   + (["--peers"] if args.peers else []))
        began = time.perf_counter()
        try:
            ran = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
            lines = ran.stdout.strip().splitlines()
            if ran.returncode == 0 and lines:
                row = json.loads(lines[-1])
            else:
                error = (ran.stderr.strip().splitlines() or [f"exit status {ran.returncode}"])[-1]
                row = {"model": spec, "failed": error[:300], **machine()}
        except subprocess.TimeoutExpired:
            row = {"model": spec, "failed": f"over {args.timeout} s", **machine()}
        row.setdefault("seconds", round(time.perf_counter() - began, 1))
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(_line(row), flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    write_markdown(out.with_suffix(".md"), markdown(rows, out.with_suffix(".jsonl")))


GENERATED = "<!-- benchmarks/sweep.py writes everything below this line; the text above it is kept -->"


def write_markdown(path: Path, table: str) -> None:
    """Write the summary and table below the marker line of ``path``, keeping what was written above it."""
    text = path.read_text() if path.exists() else ""
    head = text[:text.index(GENERATED)] if GENERATED in text else ""
    path.write_text(head + GENERATED + "\n\n" + table + "\n")


HEADER = ("| model | input | units | verified | max error | eager ms | torch.compile ms | ONNX Runtime ms | "
          "sequential ms | IOS ms | same program | noise | chosen | best plan / fastest peer | s |")


def _line(r: dict) -> str:
    if "failed" in r:
        return f"| {r['model']} | | | FAILED: {r['failed']} | | | | | | | | | | | {r.get('seconds', '')} |"
    ms = r["measured_ms"]

    def cell(name: str) -> str:
        return f"{ms[name]:.1f}" if name in ms else ("dropped" if name in r["dropped"] else "-")

    same = ", ".join(f"{a} = {b}" for a, b in r["noise"]["same_program"].items()) or "-"
    chosen = chosen_cell(r)
    vs = r["plan_over_peer"]
    versus = (f"{vs['ratio']:.2f}x [{vs['low']:.2f}, {vs['high']:.2f}] {r['best_peer']}" if vs else "-")
    return (f"| {r['model']} | {'x'.join(map(str, r['input_shape'][1:]))} | {r['units']} | "
            f"{'yes' if r['verified'] else 'NO'} | {_error(r['max_error'])} | {cell('eager')} | "
            f"{cell('torch_compile')} | {cell('onnxruntime')} | {cell('sequential')} | {cell('ios')} | {same} | "
            f"{100 * r['noise']['same_program_spread']:.1f}% | {chosen} | {versus} | {r['seconds']} |")


def chosen_cell(row: dict) -> str:
    """The configuration a row chose, and the others no configuration beat above the run's noise."""
    tied = [n for n in row.get("tie", []) if n != row["chosen"]]
    return row["chosen"] + (f" (tie: {', '.join(tied)})" if tied else "")


def _error(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def summary(rows: list[dict]) -> dict:
    """What the README quotes from a sweep: how many models capture, verify, have a plan chosen above the
    noise; the same-program spread (median and worst); opsched's best plan against the fastest peer."""
    ok = [r for r in rows if "failed" not in r]
    spreads = sorted(r["noise"]["same_program_spread"] for r in ok)
    ratios = sorted(r["plan_over_peer"]["ratio"] for r in ok if r["plan_over_peer"])
    above = [r for r in ok if r["chosen"] == r["best_plan"] and r["tie"] == [r["chosen"]]]
    return {"models": len(rows), "captured": len(ok), "verified": sum(r["verified"] for r in ok),
            "plan_chosen_above_noise": len(above), "plan_tied_with_fastest": sum(
                r["best_plan"] in r["tie"] and r["chosen"] != r["best_plan"] for r in ok),
            "same_program_spread_median": round(statistics.median(spreads), 4) if spreads else None,
            "same_program_spread_max": round(spreads[-1], 4) if spreads else None,
            "plan_over_fastest_peer_median": round(statistics.median(ratios), 3) if ratios else None,
            "plan_over_fastest_peer_range": [ratios[0], ratios[-1]] if ratios else None}


def markdown(rows: list[dict], record: Path | None = None) -> str:
    s = summary(rows)
    first = next((r for r in rows if "machine" in r), {})
    text = (f"Measured on {first.get('machine', 'this machine')} ({first.get('versions', {})}, {first.get('date', '')}), "
            f"batch 1, each model at its recorded input size, interleaved medians. {s['models']} models: "
            f"{s['captured']} captured and ran, {s['verified']} verified every schedule (each output at its own "
            f"scale); opsched's plan chosen above the run's noise for {s['plan_chosen_above_noise']}, tied with the "
            f"fastest for {s['plan_tied_with_fastest']}. One program timed twice differed by "
            f"{_percent(s['same_program_spread_median'])} at the median and {_percent(s['same_program_spread_max'])} "
            f"at worst. Best plan over the fastest peer (a ratio of medians, above 1 is slower): median "
            f"{s['plan_over_fastest_peer_median']}, range {s['plan_over_fastest_peer_range']}.")
    lines = [text, "", *([f"<!-- source: {record} -->"] if record else []), HEADER, "|" + "---|" * 15]
    lines += [_line(r) for r in rows]
    return "\n".join(lines)


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    main()
