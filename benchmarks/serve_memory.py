"""The memory a server's preparation takes, on this machine (measured): the models of a ``serve_load``
workload held as ``opsched serve`` holds them (every model's plans at each batch size its batcher forms, and the
fused group's), in this process, until ready.

Per run: seconds to ready, the process's resident memory before the models were made, once they were made, at
ready, and its peak (``VmHWM``), and the tensor memory the server holds at ready, by kind (parameters, plain
tensors, oneDNN's reordered weights; counted once per storage). Every row goes to ``--out`` as a JSON line with
the machine, versions, date and commit.

    python benchmarks/serve_memory.py --workload resnet18x16 --out docs/serve_memory.jsonl
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from pathlib import Path

import torch
from serve_load import workload
from sweep import appender


def _status_mb(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return round(int(line.split()[1]) / 1024, 1)


def tensor_mb() -> dict[str, float]:
    """The memory of the live tensors of this process, by kind, each storage once (oneDNN's reordered weights,
    which have no storage PyTorch can read, by their sizes; the fake tensors of graphs' shapes left out)."""
    from torch._subclasses.fake_tensor import FakeTensor

    storages: dict[tuple, tuple[str, int]] = {}
    with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated names warns)
        warnings.simplefilter("ignore", FutureWarning)
        live = [v for v in gc.get_objects() if isinstance(v, torch.Tensor)]
    for value in live:
        if isinstance(value, FakeTensor) or value.device.type != "cpu":
            continue
        if value.is_mkldnn:
            storages[("mkldnn", id(value))] = ("onednn_reordered", value.numel() * value.element_size())
            continue
        storage = value.untyped_storage()
        kind = "parameters" if isinstance(value, torch.nn.Parameter) else "tensors"
        if storages.get(storage.data_ptr(), ("tensors",))[0] != "parameters":
            storages[storage.data_ptr()] = (kind, storage.nbytes())
    totals: dict[str, float] = {}
    for kind, size in storages.values():
        totals[kind] = totals.get(kind, 0) + size
    return {kind: round(size / 2 ** 20, 1) for kind, size in sorted(totals.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet18x16", choices=["cnn16", "resnet18x16", "mixed"])
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--out", default="docs/serve_memory.jsonl")
    parser.add_argument("--note", default="", help="said in the row (what was measured)")
    args = parser.parse_args()
    from opsched.serving.served import ServedModels

    torch.set_num_threads(2)
    row = {"workload": args.workload, "max_batch": args.max_batch, "note": args.note,
           "rss_start_mb": _status_mb("VmRSS")}
    models = workload(args.workload)
    gc.collect()
    row["rss_models_mb"] = _status_mb("VmRSS")
    began = time.perf_counter()
    served = ServedModels(models, max_batch=args.max_batch, say=lambda line: print(f"  {line}", flush=True))
    while not served.ready.wait(5):
        print(f"  {time.perf_counter() - began:.0f} s, resident {_status_mb('VmRSS')} MB", flush=True)
    row["ready_s"] = round(time.perf_counter() - began, 1)
    gc.collect()
    row.update(rss_ready_mb=_status_mb("VmRSS"), rss_peak_mb=_status_mb("VmHWM"), tensors_mb=tensor_mb())
    served.close()
    print(appender(args.out)(row))


if __name__ == "__main__":
    main()
