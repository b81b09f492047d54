"""Plans and DAG JSON documents edited or drawn at random, and what opsched must do with them (refuse in one line
or accept and run correctly)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from opsched.graph.ir import Graph
from opsched.schedule import ScheduleError, from_dict, validate


def simulate_program(plan: Any, graph: Graph) -> None:
    """Execute the StreamProgram of ``plan`` symbolically: raise AssertionError if a unit runs before one
    of its inputs or the streams deadlock. Independent of the validator: what it accepts must pass this."""
    from opsched.runtime.program import Record, Run, Wait, compile_program

    program = compile_program(plan, graph, cores=2)
    done: set[int] = set()
    recorded: set[int] = set()
    position = [0] * len(program.streams)
    ran = 0
    while any(p < len(s) for p, s in zip(position, program.streams)):
        progressed = False
        for k, steps in enumerate(program.streams):
            while position[k] < len(steps):
                step = steps[position[k]]
                if isinstance(step, Wait):
                    if step.event not in recorded:
                        break
                elif isinstance(step, Record):
                    recorded.add(step.event)
                elif isinstance(step, Run):
                    for u in step.units:
                        for a in graph.nodes[u].args:
                            if a in graph.index and graph.index[a] not in done and graph.index[a] not in step.units:
                                raise AssertionError(f"unit {graph.nodes[u].name} runs before its input {a}")
                    done.update(step.units)
                    ran += len(step.units)
                position[k] += 1
                progressed = True
        if not progressed:
            raise AssertionError("the program deadlocks")
    assert ran == len(graph) and done == set(range(len(graph))), "a unit runs twice or never"


MUTATIONS = ("drop_op", "duplicate_op", "rename_op", "swap_stages", "merge_stage", "move_unit", "stream",
             "time", "format", "truncate", "drop_key", "retype", "threads")


def mutate(doc: dict[str, Any], rng: random.Random, kind: str) -> str:
    """Edit a plan's JSON by hand as a user might (or break it); return the text to load."""
    doc = json.loads(json.dumps(doc))
    ops, stages = doc["ops"], doc.get("stages")
    if kind == "drop_op" and ops:
        ops.pop(rng.randrange(len(ops)))
    elif kind == "duplicate_op" and ops:
        ops.append(dict(rng.choice(ops)))
    elif kind == "rename_op" and ops:
        rng.choice(ops)["name"] = rng.choice(["nope", ops[0]["name"], ""])
    elif kind == "swap_stages" and stages and len(stages) > 1:
        i, j = rng.sample(range(len(stages)), 2)
        stages[i], stages[j] = stages[j], stages[i]
    elif kind == "merge_stage" and stages:
        rng.choice(stages)["strategy"] = rng.choice(["merge", "bogus", "concurrent"])
    elif kind == "move_unit" and stages:
        src, dst = rng.choice(stages), rng.choice(stages)
        group = rng.choice(src["groups"])
        unit = group.pop(rng.randrange(len(group)))
        src.pop("threads", None)
        dst.pop("threads", None)
        rng.choice(dst["groups"]).append(unit)
        if not group and rng.random() < 0.5:  # otherwise the empty group stays, for the validator to refuse
            src["groups"].remove(group)
    elif kind == "stream" and ops:
        rng.choice(ops)["stream"] = rng.choice([-1, 0, 1, 2, 7, 10**12, "1", 1.5])
    elif kind == "time" and ops:
        op = rng.choice(ops)
        op[rng.choice(["start", "finish"])] = rng.choice([0.0, -5.0, 1e308, float("nan"), float("inf"), 1e9, "x"])
    elif kind == "format":
        doc["format"] = rng.choice(["opsched.schedule/2", "opsched.schedule/0", None, 1])
    elif kind == "drop_key":
        doc.pop(rng.choice(["ops", "graph", "method", "predicted_latency", "stages", "format"]), None)
    elif kind == "retype":
        key = rng.choice(["ops", "stages", "graph", "options", "stats", "batch"])
        doc[key] = rng.choice([None, 3, "text", [], {}, [[1]], {"a": 1}])
    elif kind == "threads" and stages:
        stage = rng.choice(stages)
        stage["threads"] = rng.choice([[[0]], [[1, 2, 3, 4]], [[-1] * len(g) for g in stage["groups"]],
                                       [[2] * len(g) for g in stage["groups"]], "x"])
    text = json.dumps(doc, indent=1)
    if kind == "truncate":
        text = text[:rng.randrange(len(text))]
    return text


def check_plan_text(text: str, graph: Graph, run: Callable[[Any], None] | None = None) -> str:
    """Load an edited plan: it is refused with a ScheduleError, or accepted and then correct (simulated
    and, with ``run``, executed). Returns "refused" or "accepted"; anything else raises."""
    from opsched.jsonfile import parse_json

    try:
        plan = from_dict(parse_json(text, "plan.json", ScheduleError), "plan.json")
        validate(plan, graph)
    except ScheduleError as e:
        assert "\n" not in str(e), f"a refusal of more than one line: {e}"
        return "refused"
    simulate_program(plan, graph)
    if run is not None:
        run(plan)
    return "accepted"


@st.composite
def dag_documents(draw: st.DrawFn) -> Any:
    """DAG JSON documents: mostly well formed, with one random defect in some, or any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                             max_size=4),
                                 max_leaves=12))
    n = draw(st.integers(0, 12))
    names = [f"v{i}" for i in range(n)]
    nodes: list[Any] = [{"name": name, "latency": draw(st.floats(0, 100))} for name in names]
    edges: list[Any] = [[names[i], names[j]] for i in range(n) for j in range(i + 1, n) if draw(st.booleans())]
    defect = draw(st.sampled_from(["none", "none", "none", "latency", "duplicate", "unknown_edge", "cycle",
                                   "self_loop", "edge_shape", "node_type", "missing_name", "kind", "extra"]))
    if defect == "latency" and nodes:
        draw(st.sampled_from(nodes))["latency"] = draw(st.sampled_from([-1, "fast", None, float("nan"), [], 1e400]))
    elif defect == "duplicate" and nodes:
        nodes.append(dict(draw(st.sampled_from(nodes))))
    elif defect == "unknown_edge" and nodes:
        edges.append([names[0], "ghost"])
    elif defect == "cycle" and len(edges) > 0:
        a, b = draw(st.sampled_from(edges))
        edges.append([b, a])
    elif defect == "self_loop" and nodes:
        edges.append([names[0], names[0]])
    elif defect == "edge_shape":
        edges.append(draw(st.sampled_from([["v0"], "v0->v1", ["v0", "v1", "v2"], [1, 2], None])))
    elif defect == "node_type":
        nodes.append(draw(st.sampled_from(["v9", 3, None, ["v9"]])))
    elif defect == "missing_name" and nodes:
        del draw(st.sampled_from(nodes))["name"]
    elif defect == "kind" and nodes:
        draw(st.sampled_from(nodes))["kind"] = draw(st.sampled_from([3, None, "conv", ""]))
    elif defect == "extra" and nodes:
        draw(st.sampled_from(nodes))["flops"] = draw(st.sampled_from(["many", -3, 1e30]))
    return {"nodes": nodes, "edges": edges}


def check_dag_document(doc: Any, method: str, directory: Path) -> str:
    """Run ``opsched schedule`` on the document: exit 0 with a JSON result, or exit 2 with one line on
    stderr; never a traceback. Returns "scheduled" or "refused"."""
    from opsched.cli import main

    path = directory / "dag.json"
    text = json.dumps(doc) if not isinstance(doc, str) else doc
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["schedule", str(path), "--method", method, "--json"] +
                    (["--time-limit", "2"] if method == "exact" else []))
    if code == 0:
        result = json.loads(out.getvalue())
        assert math.isfinite(result["predicted_latency"]), result
        return "scheduled"
    assert code == 2 and err.getvalue().count("\n") == 1 and err.getvalue().startswith("opsched: error: "), \
        (code, err.getvalue())
    return "refused"
