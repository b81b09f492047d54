"""A Gantt chart (PNG) of a timeline: one row per stream, one bar per unit, coloured by the unit's kind."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from opsched.graph.ir import Graph
from opsched.schedule import OpTiming

_COLOURS = {"conv": "tab:blue", "sepconv": "tab:cyan", "linear": "tab:purple", "pool": "tab:green",
            "cat": "tab:gray", "elementwise": "tab:orange", "op": "tab:olive"}


def write_gantt(path: str | Path, ops: Sequence[OpTiming], graph: Graph | None, title: str,
                time_unit: str = "ms") -> None:
    """Draw ``ops`` to ``path``; ``title`` must say whether the times are predicted, simulated or measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    streams = 1 + max((o.stream for o in ops), default=0)
    end = max((o.finish for o in ops), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * streams))
    kinds = set()
    for o in ops:
        kind = graph.nodes[graph.index[o.name]].kind if graph is not None and o.name in graph.index else "op"
        kinds.add(kind)
        ax.broken_barh([(o.start, max(o.finish - o.start, end * 1e-4))], (o.stream - 0.4, 0.8),
                       facecolors=_COLOURS.get(kind, "tab:olive"), edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(streams), [f"stream {k}" for k in range(streams)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=_COLOURS.get(k, "tab:olive"), label=k) for k in sorted(kinds)],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if streams < 3 else -0.15), fontsize=7,
              ncols=len(kinds), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
