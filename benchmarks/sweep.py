"""Every classification model we can load, through the whole pipeline as a user would run it: capture, the
measured cost model, sequential and IOS schedules, execution, verification against eager, and the
interleaved timing of every candidate beside the peers; the configuration opsched chooses and how it
compares with eager. Every figure is measured on this machine.

Each model runs in its own process (a crash, a hang or a memory blow-up costs that model only, and is a
row of the table); rows are appended to OUT.jsonl as they finish, so an interrupted sweep resumes.

    python benchmarks/sweep.py [--models NAME ...] [--image-size 128] [--peers] [--timeout 900] [--out docs/sweep]

Writes OUT.jsonl and OUT.md (the table).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TORCHVISION = ["alexnet", "vgg11", "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "densenet121",
               "googlenet", "inception_v3", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
               "shufflenet_v2_x1_0", "squeezenet1_0", "squeezenet1_1", "mnasnet0_5", "mnasnet1_0",
               "efficientnet_b0", "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf", "regnet_y_800mf",
               "convnext_tiny", "swin_t", "vit_b_16", "maxvit_t"]
TIMM = ["resnet26d", "dla34", "dpn68", "hrnet_w18_small", "inception_v4", "legacy_xception", "mixnet_s",
        "tf_efficientnet_b0", "ghostnet_100", "res2net50_26w_4s", "selecsls42b", "rexnet_100", "cspresnet50",
        "levit_128", "mobilevit_s", "regnety_008", "fbnetc_100", "semnasnet_100", "tinynet_a", "lcnet_050",
        "convnext_atto", "resnest14d", "skresnet18", "vovnet39a", "ese_vovnet19b_dw", "repvgg_a0",
        "inception_resnet_v2", "efficientvit_b0", "fastvit_t8", "poolformer_s12", "gcresnet33ts", "resnetv2_50",
        "deit_tiny_patch16_224"]
MODELS = [f"torchvision:{m}" for m in TORCHVISION] + [f"timm:{m}" for m in TIMM]


def one(spec: str, image_size: int, peers: bool, repeats: int) -> dict:
    """One model through the pipeline (in this process)."""
    import torch

    from opsched.commands.optimize import explain
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.pipeline import Workload, method_options, run_workload

    row: dict = {"model": spec, "image_size": image_size}
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
                                    cores=torch.get_num_threads(),
                                    peers=("eager", "torch_compile", "onnxruntime") if peers else ("eager",)))
    ev = outcome.evaluation
    row.update(measured_ms={k: round(v, 3) for k, v in ev.measured_ms.items()}, errors=ev.errors,
               dropped=ev.dropped, warnings=ev.warnings + outcome.notes, chosen=ev.chosen,
               verified=all(m in ev.measured_ms for m in methods),
               max_abs_error=max((ev.errors[m] for m in methods if m in ev.errors), default=None),
               ios=explain(outcome.schedules["ios"], graph, outcome.cost),
               seconds=round(time.perf_counter() - began, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--peers", action="store_true", help="also torch.compile and ONNX Runtime")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model")
    parser.add_argument("--out", default="docs/sweep")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.image_size, args.peers, args.repeats)))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_path = out.with_suffix(".jsonl")
    done = {json.loads(line)["model"] for line in rows_path.read_text().splitlines()} if rows_path.exists() else set()
    for spec in args.models:
        if spec in done:
            continue
        command = [sys.executable, __file__, "--one", spec, "--image-size", str(args.image_size),
                   "--repeats", str(args.repeats)] + (["--peers"] if args.peers else [])
        began = time.perf_counter()
        try:
            ran = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
            lines = ran.stdout.strip().splitlines()
            if ran.returncode == 0 and lines:
                row = json.loads(lines[-1])
            else:
                error = (ran.stderr.strip().splitlines() or [f"exit status {ran.returncode}"])[-1]
                row = {"model": spec, "failed": error[:300]}
        except subprocess.TimeoutExpired:
            row = {"model": spec, "failed": f"over {args.timeout} s"}
        row.setdefault("seconds", round(time.perf_counter() - began, 1))
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(_line(row), flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    out.with_suffix(".md").write_text(markdown(rows, args.image_size) + "\n")


HEADER = ("| model | units | width | verified | max abs error | eager ms | torch.compile ms | ONNX Runtime ms | "
          "sequential ms | IOS ms | chosen | chosen vs eager | s |")


def _line(r: dict) -> str:
    if "failed" in r:
        return f"| {r['model']} | - | - | FAILED: {r['failed']} | | | | | | | | | {r.get('seconds', '')} |"
    size = " (own input size)" if "smaller_size_failed" in r else ""
    ms = r["measured_ms"]

    def cell(name: str) -> str:
        return f"{ms[name]:.1f}" if name in ms else ("dropped" if name in r["dropped"] else "-")

    chosen = r["chosen"]
    return (f"| {r['model']}{size} | {r['units']} | {r['width']} | {'yes' if r['verified'] else 'NO'} | "
            f"{_error(r['max_abs_error'])} | {cell('eager')} | {cell('torch_compile')} | {cell('onnxruntime')} | "
            f"{cell('sequential')} | {cell('ios')} | {chosen} | {ms['eager'] / ms[chosen]:.2f}x | {r['seconds']} |")


def _error(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def markdown(rows: list[dict], image_size: int) -> str:
    ok = [r for r in rows if "failed" not in r]
    verified = [r for r in ok if r["verified"]]
    summary = (f"Measured on this machine (2 cores, no GPU), batch 1, {image_size}x{image_size} inputs, interleaved "
               f"medians. {len(rows)} models: {len(ok)} ran, {len(verified)} verified every schedule.")
    lines = [summary, "", HEADER, "|" + "---|" * 13]
    lines += [_line(r) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
