"""A Gantt chart (PNG) of a timeline: one row per stream, one bar per unit, coloured by the unit's kind and
named where the bar is wide enough; the units of a merge stage are one hatched bar."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from opsched.graph.ir import Graph
from opsched.schedule import OpTiming, Schedule

_COLOURS = {"conv": "tab:blue", "sepconv": "tab:cyan", "linear": "tab:purple", "pool": "tab:green",
            "cat": "tab:gray", "elementwise": "tab:orange", "merge": "tab:red", "op": "tab:olive"}


def merged_units(plan: Schedule) -> list[list[str]]:
    """The units of each merge stage of ``plan`` (none for a stream schedule)."""
    return [[u for g in st.groups for u in g] for st in plan.stages or () if st.strategy == "merge"]


def write_gantt(path: str | Path, ops: Sequence[OpTiming], graph: Graph | None, title: str,
                time_unit: str = "ms", merges: Iterable[Sequence[str]] = ()) -> None:
    """Draw ``ops`` to ``path``; ``title`` must say whether the times are predicted, simulated or measured.
    ``graph`` gives the units' kinds (without it every unit is an ``op``); ``merges`` lists the units run
    as one merged operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    streams = 1 + max((o.stream for o in ops), default=0)
    end = max((o.finish for o in ops), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.5 * streams))
    merge_of = {u: k for k, units in enumerate(merges) for u in units}
    by_name = {o.name: o for o in ops}
    bars = [(o, _kind(o.name, graph), _short(o.name)) for o in ops if o.name not in merge_of]
    for units in merges:
        bars.append((by_name[units[0]], "merge", f"merge of {len(units)}"))
    for o, kind, label in bars:
        width = max(o.finish - o.start, end * 1e-4)
        ax.broken_barh([(o.start, width)], (o.stream - 0.4, 0.8), facecolors=_COLOURS.get(kind, "tab:olive"),
                       edgecolors="white", linewidth=0.3, hatch="//" if kind == "merge" else None)
        if width > end * 0.0045 * len(label):  # a name only where it can be read
            ax.text(o.start + width / 2, o.stream, label, ha="center", va="center", fontsize=6, clip_on=True,
                    color="white")
    ax.set_yticks(range(streams), [f"stream {k}" for k in range(streams)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    ax.set_title(title, fontsize=10)
    kinds = sorted({kind for _, kind, _ in bars})
    ax.legend(handles=[Patch(facecolor=_COLOURS.get(k, "tab:olive"), hatch="//" if k == "merge" else None, label=k)
                       for k in kinds], loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(name: str) -> str:
    """The last two parts of a unit's dotted module path (``branch3x3.conv``), enough to find it."""
    return ".".join(name.split(".")[-2:])


def _kind(name: str, graph: Graph | None) -> str:
    return graph.nodes[graph.index[name]].kind if graph is not None and name in graph.index else "op"
