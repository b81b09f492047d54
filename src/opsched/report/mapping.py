"""A mapped plan drawn as a Gantt chart (PNG): one row per device, one bar per job (a unit, or the pieces
of the batch it runs there), and each transfer as an arrow from the producing device's row to the reading
device's row over the time it takes. The title says whether the times are simulated."""

from __future__ import annotations

import sys
from pathlib import Path

from opsched.schedule import Schedule


def write_mapping_gantt(path: str | Path, plan: Schedule) -> None:
    """Draw ``plan`` (a plan from ``opsched map``: it has a ``devices`` section) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    section = plan.devices
    devices = [d.name for d in section.devices]
    row = {name: k for k, name in enumerate(devices)}
    placements, moves = section.placements(plan.ops, plan.batch), section.transfers
    end = max([p["finish"] for p in placements] + [t.finish for t in moves] + [1e-9])
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.7 * len(devices)))
    colours = plt.get_cmap("tab20")
    for k, p in enumerate(placements):
        y = row[p["device"]]
        width = max(p["finish"] - p["start"], end * 1e-4)
        ax.broken_barh([(p["start"], width)], (y - 0.35, 0.7), facecolors=colours(k % 20), edgecolors="white",
                       linewidth=0.3)
        label = p["name"].split(".")[-1]
        if width > end * 0.005 * len(label):
            ax.text(p["start"] + width / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    for t in moves:
        a, b = row[t.from_device], row[t.to_device]
        ax.annotate("", xy=(t.finish, b + (0.4 if b < a else -0.4) * -1),
                    xytext=(t.start, a + (0.4 if b > a else -0.4)),
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.6, "alpha": 0.6})
    ax.set_yticks(range(len(devices)), devices)
    ax.invert_yaxis()
    ax.set_xlim(0, min(end * 1.01, sys.float_info.max))  # a hand-edited 1e308 would make the limit infinite
    ax.set_xlabel(section.time_unit or "time")
    simulated = "SIMULATED" if plan.simulated else "predicted from measured costs"
    predicted = section.objective_value(plan.predicted_latency, plan.batch)
    ax.set_title(f"{plan.graph_name}: {plan.method} on {section.platform['name']} ({simulated}), "
                 f"{section.objective} {predicted:.4g}; {len(moves)} transfers (arrows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
