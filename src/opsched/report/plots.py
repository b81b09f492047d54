"""The benchmark's charts (matplotlib PNGs): throughput normalised to sequential per model (IOS Fig. 6/7),
search time on a log scale (LIOS Table V), latency against batch size (IOS Fig. 11). Titles and legends
say which figures are simulated and which measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opsched.cost.devices import is_simulated


def write_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Draw what the rows allow; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for cost in dict.fromkeys(r["cost"] for r in rows if r.get("predicted_ms") not in (None, "")):
        path = out / f"throughput-{cost.replace(':', '-')}.png"
        if _throughput(rows, cost, path):
            written.append(path)
    path = out / "search-time.png"
    if _search_time(rows, path):
        written.append(path)
    path = out / "latency-vs-batch.png"
    if _latency_vs_batch(rows, path):
        written.append(path)
    return written


def _save(fig: Any, path: Path) -> bool:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _label(cost: str, measured: bool) -> str:
    if is_simulated(cost):
        return f"SIMULATED on {cost[4:]}"
    return "measured on this CPU" if measured else "predicted by the measured cost model"


def _throughput(rows, cost: str, path: Path) -> bool:
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if r["cost"] == cost and r["preset"] in ("quick", "schedules") and str(r["batch"]) == "1"
              and not r["variant"].startswith("threads")]
    measured = any(r.get("measured_ms") not in (None, "") for r in chosen)
    models = list(dict.fromkeys(r["model"] for r in chosen))
    methods = list(dict.fromkeys(r["method"] for r in chosen))
    if not models or not methods:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models)), 3.6))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = []
        for model in models:
            row = next((r for r in chosen if r["model"] == model and r["method"] == method), None)
            key = "measured_speedup" if measured else "predicted_speedup"
            values.append(float(row[key]) if row and row.get(key) not in (None, "") else 0.0)
        ax.bar([m + i * width for m in range(len(models))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(models))], models)
    ax.set_ylabel("throughput / sequential")
    ax.set_title(f"Batch 1, {_label(cost, measured)}", fontsize=10)
    ax.legend(fontsize=7, ncols=len(methods), loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    return _save(fig, path)


def _search_time(rows, path: Path) -> bool:
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if r["method"] in ("ios", "lios") and r.get("search_seconds") not in (None, "")
              and not r["variant"]]
    if not chosen:
        return False
    models = list(dict.fromkeys(r["model"] for r in chosen))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models)), 3.6))
    for i, method in enumerate(("ios", "lios")):
        values = [min((float(r["search_seconds"]) for r in chosen if r["model"] == m and r["method"] == method),
                      default=0.0) for m in models]
        ax.bar([m + i * 0.4 for m in range(len(models))], values, 0.4, label=method)
    ax.set_yscale("log")
    ax.set_xticks([m + 0.2 for m in range(len(models))], models)
    ax.set_ylabel("search seconds (measured, log scale)")
    ax.set_title("Scheduling time, batch 1", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _latency_vs_batch(rows, path: Path) -> bool:
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if r["preset"] == "specialisation"]
    if not chosen:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (cost, method) in dict.fromkeys((r["cost"], r["method"]) for r in chosen):
        points = sorted((int(r["batch"]), float(r["predicted_ms"])) for r in chosen
                        if r["cost"] == cost and r["method"] == method)
        ax.plot([b for b, _ in points], [ms for _, ms in points], marker="o",
                label=f"{method}, {_label(cost, False)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency ms")
    ax.set_title("Inception V3 latency against batch size", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)
