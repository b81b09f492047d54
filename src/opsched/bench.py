"""``opsched bench``: the papers' comparisons as named presets, run on our models and this machine.

A run is a list of *cases* (model, batch, cost model); each case yields one row per method: predicted
latency, measured latency when the cost model is measured here, speedup over sequential, search time,
DP states and transitions, and the lower bound, with where, when and with what it was measured
(:func:`opsched.provenance.machine`). Rows go to ``DIR/results.csv`` as they are made, so an
interrupted run resumes where it stopped (rows already in the file are skipped); ``DIR/results.md`` and
the plots are rewritten from the whole file at the end. Simulated rows say so in their ``cost`` and
``simulated`` columns, and in every table and plot.

The peers (measured, in the same interleaved timing as opsched's schedules, through the one runner,
:func:`opsched.pipeline.run_workload`; see :mod:`opsched.peers`): PyTorch eager with 1 and all threads, ONNX
Runtime (sequential execution, 1 and all intra-op threads; skipped with a note when it is not installed),
and with ``--torch-compile`` torch.compile of the whole model (freezing on, each thread count compiled in
isolation).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.cost.devices import is_simulated
from opsched.errors import OpschedError

# method name -> (scheduler, options): IOS's variants as in its Fig. 6
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "sequential": ("sequential", {}),
    "greedy": ("greedy", {}),
    "ios-merge": ("ios", {"concurrent": False}),
    "ios-parallel": ("ios", {"merge": False}),
    "ios": ("ios", {}),
    "lios": ("lios", {"streams": 8}),
    "nimble": ("nimble", {}),
}

ZOO = ["inception_v3", "randwire", "nasnet", "squeezenet"]
COLUMNS = ["preset", "model", "batch", "cost", "simulated", "method", "variant", "units", "predicted_ms",
           "sequential_predicted_ms", "predicted_speedup", "measured_ms", "measured_speedup", "search_seconds",
           "states", "transitions", "lower_bound_ms", "max_abs_error", "note", "machine", "versions", "date", "commit"]


@dataclass
class Case:
    preset: str
    model: str
    batch: int
    cost: str                      # "measured" or "sim:NAME"
    methods: list[str]
    variants: list[dict[str, Any]] = field(default_factory=lambda: [{}])  # extra scheduler options
    image_size: int | None = None
    baselines: bool = False        # time eager (and torch.compile) beside the schedules


def preset_cases(name: str, models: list[str] | None = None, costs: list[str] | None = None,
                 batches: list[int] | None = None, methods: list[str] | None = None) -> list[Case]:
    """The cases of a preset, narrowed or widened by the command line's lists."""
    all_methods = list(METHODS)
    if name == "quick":
        chosen = costs or ["sim:v100", "measured"]
        cases = [Case("quick", m, b, c, methods or all_methods) for c in chosen if c != "measured"
                 for m in (models or ZOO) for b in (batches or [1])]
        if "measured" in chosen:
            cases += [Case("quick", m, b, "measured", methods or ["sequential", "greedy", "ios", "lios"],
                           baselines=True) for m in (models or ["squeezenet", "inception_v3"])
                      for b in (batches or [1])]
    elif name == "schedules":  # IOS Fig. 6 / 7
        cases = [Case(name, m, b, c, methods or all_methods, baselines=c == "measured")
                 for m in (models or ZOO) for c in (costs or ["sim:v100", "measured"]) for b in (batches or [1])]
    elif name == "pruning":  # IOS Fig. 9
        variants = [{"max_group_size": r, "max_groups": s} for r in (1, 2, 3) for s in (3, 8)]
        cases = [Case(name, m, b, c, methods or ["ios"], variants) for m in (models or ["inception_v3", "randwire"])
                 for c in (costs or ["sim:v100"]) for b in (batches or [1])]
    elif name == "specialisation":  # IOS Table 3: each setting's IOS schedule also costed on the others
        if costs and any(not is_simulated(c) for c in costs):
            raise OpschedError("the specialisation preset compares simulated devices; give sim:NAME costs")
        cases = [Case(name, m, b, c, ["sequential", "ios"]) for m in (models or ["inception_v3"])
                 for c in (costs or ["sim:v100", "sim:k80"]) for b in (batches or [1, 32, 128])]
    elif name == "search-cost":  # LIOS Table V, IOS Table 1
        cases = [Case(name, m, b, c, methods or ["ios", "lios"]) for m in (models or ZOO)
                 for c in (costs or ["sim:v100"]) for b in (batches or [1])]
    else:
        raise OpschedError(f"unknown preset {name!r}; choose from quick, schedules, pruning, specialisation, "
                           "search-cost")
    for c in cases:
        unknown = [m for m in c.methods if m not in METHODS]
        if unknown:
            raise OpschedError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    return cases


def run(cases: list[Case], out: Path, repeats: int = 9, torch_compile: bool = False,
        progress: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    """Run every case not yet in ``out/results.csv``; return all rows of the file."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.csv"
    done = {_key(r) for r in read_rows(path)}
    for case in cases:
        keys = {(case.preset, case.model, str(case.batch), case.cost, m, _variant(v))
                for m in case.methods for v in case.variants}
        if keys <= done:
            continue
        if progress:
            progress(f"{case.preset}: {case.model} batch {case.batch} on {case.cost}")
        rows = _run_case(case, repeats, torch_compile)
        _append(path, [r for r in rows if _key(r) not in done])
        done.update(_key(r) for r in rows)
    crossed = [c for c in cases if c.preset == "specialisation"]
    if len(crossed) > 1 and any(("specialisation", c.model, str(c.batch), c.cost, "ios", _made_for(o))
                                not in done for c in crossed for o in crossed
                                if o is not c and o.model == c.model):
        if progress:
            progress("specialisation: each IOS schedule costed on the other settings")
        rows = _cross_rows(crossed)
        _append(path, [r for r in rows if _key(r) not in done])
    return read_rows(path)


def _made_for(case: Case) -> str:
    return f"made_for={case.cost}/batch={case.batch}"


def _cross_rows(cases: list[Case]) -> list[dict[str, Any]]:
    """IOS Table 3: the IOS schedule made for each setting (device, batch), costed on every other setting
    of the same model, where its stages carry over by unit name."""
    from opsched.cost.simulate import SimulatedGPU
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.pipeline import search
    from opsched.schedule import from_stages

    settings = []
    for case in cases:
        loaded = load_model(case.model, batch=case.batch, image_size=case.image_size)
        graph = capture(loaded.model.eval(), loaded.inputs, name=loaded.name)
        cost = SimulatedGPU(graph, case.cost)
        settings.append((case, graph, cost, search(graph, cost, "ios")))
    rows = []
    for case, graph, cost, own in settings:
        for other, _, _, schedule in settings:
            if other is case or other.model != case.model:
                continue
            stages = [(st.strategy, [[graph.index[u] for u in g] for g in st.groups]) for st in schedule.stages]
            moved = from_stages(graph, cost, "ios", stages)
            rows.append({"preset": "specialisation", "model": case.model, "batch": case.batch, "cost": case.cost,
                         "simulated": True, "method": "ios", "variant": _made_for(other), "units": len(graph),
                         "predicted_ms": moved.predicted_latency, "sequential_predicted_ms": "",
                         "predicted_speedup": own.predicted_latency / moved.predicted_latency,
                         "note": "predicted_speedup here: the setting's own IOS schedule over this one"})
    return rows


def _run_case(case: Case, repeats: int, torch_compile: bool) -> list[dict[str, Any]]:
    from opsched.graph.capture import capture
    from opsched.models import load_model
    from opsched.pipeline import Workload, run_workload

    loaded = load_model(case.model, batch=case.batch, image_size=case.image_size)
    loaded.model.eval()
    graph = capture(loaded.model, loaded.inputs, name=loaded.name)
    simulated = is_simulated(case.cost)
    methods = {}
    for method in case.methods:
        scheduler, options = METHODS[method]
        for variant in case.variants:
            methods[_label(method, variant)] = (scheduler, {**options, **(variant if scheduler == "ios" else {})})
    sequential = _label("sequential", {})
    methods.setdefault(sequential, ("sequential", {}))  # speedups are over sequential: make (and time) it
    peers = ("eager", "onnxruntime") + (("torch_compile",) if torch_compile else ()) if case.baselines else ("eager",)
    outcome = run_workload(Workload(loaded.model, tuple(loaded.inputs), graph, methods, cost=case.cost, peers=peers,
                                    repeats=repeats))
    base = outcome.schedules[sequential]
    rows, labels = [], []
    for method in case.methods:
        for variant in case.variants:
            labels.append(_label(method, variant))
            schedule = outcome.schedules[labels[-1]]
            rows.append({"preset": case.preset, "model": case.model, "batch": case.batch, "cost": case.cost,
                         "simulated": simulated, "method": method, "variant": _variant(variant),
                         "units": len(graph), "predicted_ms": schedule.predicted_latency,
                         "sequential_predicted_ms": base.predicted_latency,
                         "predicted_speedup": base.predicted_latency / schedule.predicted_latency,
                         "search_seconds": schedule.stats.get("search_seconds"),
                         "states": schedule.stats.get("states"), "transitions": schedule.stats.get("transitions"),
                         "lower_bound_ms": schedule.bounds.get("lower_bound"), "note": ""})
    ev = outcome.evaluation
    if ev is None:
        return rows
    seq_ms = ev.measured_ms.get(sequential)
    for r, label in zip(rows, labels):
        if label in ev.measured_ms:
            r.update(measured_ms=ev.measured_ms[label], max_abs_error=ev.abs_errors[label],
                     measured_speedup=seq_ms / ev.measured_ms[label] if seq_ms else "")
        else:
            r["note"] = f"dropped: {ev.dropped.get(label, 'not measured')}"
    notes = {"eager": "peer, best of 1 and all threads",
             "onnxruntime": "peer, ORT_SEQUENTIAL, all graph optimisations, best of 1 and all intra-op threads",
             "torch_compile": "peer, freezing on, compiled for each thread count in isolation, best of 1 and all"}
    for peer in peers:
        row = {"preset": case.preset, "model": case.model, "batch": case.batch, "cost": case.cost,
               "simulated": False, "method": peer, "units": len(graph)}
        if peer in ev.measured_ms:
            ms = ev.measured_ms[peer]
            rows.append({**row, "variant": f"threads={ev.threads[peer]}", "measured_ms": ms,
                         "measured_speedup": seq_ms / ms if seq_ms else "", "note": notes[peer]})
        else:
            why = ev.dropped.get(peer) or next((n for n in outcome.notes if n.startswith(peer)), "not measured")
            rows.append({**row, "variant": "", "note": f"skipped: {why}"})
    return rows


def _label(method: str, variant: dict[str, Any]) -> str:
    return f"{method} {_variant(variant)}".strip()


def _variant(options: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(options.items()))


def _key(row: dict[str, Any]) -> tuple:
    return tuple(str(row.get(k) or "") for k in ("preset", "model", "batch", "cost", "method", "variant"))


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _append(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    from opsched.provenance import machine

    where = machine()
    where["versions"] = json.dumps(where["versions"], sort_keys=True)
    columns = COLUMNS
    if path.exists():
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:  # written by an earlier opsched: its rows, and any column it had, under today's
            columns = COLUMNS + [c for c in header if c not in COLUMNS]
            earlier = read_rows(path)
            partial = path.with_suffix(".csv.partial")
            with partial.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows({k: r.get(k) or "" for k in columns} for r in earlier)
            os.replace(partial, path)  # whole or not at all: the rows a resumed run skips are never lost
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k, where.get(k, "")) for k in columns})


def markdown(rows: list[dict[str, Any]]) -> str:
    """A readable table per preset; simulated figures say so."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        header = ("| model | batch | cost | method | variant | predicted ms | vs sequential | measured ms | "
                  "measured vs sequential | search s | states | transitions | lower bound |")
        lines += [f"## {preset}", "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["preset"] != preset:
                continue
            cost = r["cost"] + (" (SIMULATED)" if str(r["simulated"]) == "True" else "")
            lines.append("| " + " | ".join([r["model"], str(r["batch"]), cost, r["method"], r["variant"] or "-",
                                            _fmt(r.get("predicted_ms")),
                                            _fmt(r.get("predicted_speedup"), "x (own / this)"
                                                 if r["variant"].startswith("made_for=") else "x"),
                                            _fmt(r.get("measured_ms")), _fmt(r.get("measured_speedup"), "x"),
                                            _fmt(r.get("search_seconds"), digits=3), str(r.get("states") or "-"),
                                            str(r.get("transitions") or "-"), _fmt(r.get("lower_bound_ms"))]) + " |")
        lines.append("")
    return "\n".join(lines)


def _fmt(value: Any, suffix: str = "", digits: int = 2) -> str:
    if value in (None, ""):
        return "-"
    return f"{float(value):.{digits}f}{suffix}"
