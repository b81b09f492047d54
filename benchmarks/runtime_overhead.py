"""Overhead of the CPU executor: per unit, on a graph of 1,000 trivial units, and per call.

Per unit: every unit adds 1.0 to a one-element tensor, so nearly all the time is the executor's own:
fetching inputs, calling the unit, storing and releasing values, and (with several streams) events.
Compared with calling the same 1,000 functions in a plain Python loop, interleaved, medians.

Per call: what a call costs before any unit runs, which decides how small a model can be before running
its branches on several streams stops paying. One trivial unit per stream and a unit joining them, against
the same functions called in a plain loop; and a three-unit model (two 64x64 linear branches and their sum,
batch 1) run eagerly, on one stream and on two.

    python benchmarks/runtime_overhead.py [--units 1000] [--streams 1 2 4] [--repeats 15]
        [--out docs/runtime_overhead.jsonl]

Prints both tables and appends one JSON line per row (with the machine, versions, date, commit) to ``--out``.
"""

import argparse
import json
from pathlib import Path

import torch
from sweep import machine

from opsched.cost.table import TableCost
from opsched.graph.ir import Graph, Node
from opsched.runtime.cpu import CPUExecutor
from opsched.runtime.kernels import unit_operator
from opsched.runtime.program import compile_program
from opsched.schedule import from_streams
from opsched.timing import interleaved_medians


def add_one(x):
    return x + 1.0


def chains(units: int, streams: int) -> tuple[Graph, list[list[int]]]:
    """``streams`` independent chains sharing the input, ``units`` units in all, every 10th unit of each
    chain also reading the previous chain's unit (so that events cross streams)."""
    nodes, order = [], [[] for _ in range(streams)]
    for i in range(units):
        k, step = i % streams, i // streams
        args = ("x",) if step == 0 else (f"u{i - streams}",)
        if streams > 1 and step % 10 == 5 and k > 0:
            args = args + (f"u{i - 1}",)
        nodes.append(Node(f"u{i}", args=args, latency=1.0, run=add_one if len(args) == 1 else torch.add))
        order[k].append(i)
    return Graph(nodes, inputs=["x"]), order


def fan(streams: int) -> Graph:
    """One trivial unit per stream on the input, and one unit adding them up."""
    nodes = [Node(f"u{k}", args=("x",), latency=1.0, run=add_one) for k in range(streams)]
    nodes.append(Node("join", args=tuple(n.name for n in nodes), latency=1.0, run=lambda *xs: sum(xs)))
    return Graph(nodes, inputs=["x"])


def per_call(args: argparse.Namespace, x: torch.Tensor) -> list[dict]:
    """Print what a call costs (and return it as rows): the fan graphs on as many streams as units, and the
    three-unit model."""
    calls = 200

    def loop(fn):
        def run():
            for _ in range(calls):
                fn()
        return run

    runners, labels, executors = [], [], []
    for streams in args.streams:
        graph = fan(streams)
        fns = [n.run for n in graph.nodes]
        runners.append(loop(lambda fns=fns: fns[-1](*[f(x) for f in fns[:-1]])))
        labels.append(f"{streams} trivial unit(s) and a join, plain Python")
        schedule = from_streams(graph, TableCost(graph), "fan", [[k, streams] if k == 0 else [k]
                                                                 for k in range(streams)])
        executors.append(CPUExecutor(compile_program(schedule, graph, cores=1), unit_operator))
        runners.append(loop(lambda e=executors[-1]: e(x)))
        labels.append(f"  the same on {streams} stream(s)")
    branch_a, branch_b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    features = torch.randn(1, 64)
    model = Graph([Node("a", args=("x",), latency=1.0, run=branch_a), Node("b", args=("x",), latency=1.0, run=branch_b),
                   Node("sum", args=("a", "b"), latency=1.0, run=torch.add)], inputs=["x"])

    def eager():
        with torch.inference_mode():
            return branch_a(features) + branch_b(features)

    runners.append(loop(eager))
    labels.append("two linear branches and a sum, eager")
    for name, order in (("one stream", [[0, 1, 2]]), ("two streams", [[0, 2], [1]])):
        schedule = from_streams(model, TableCost(model), name, order)
        executors.append(CPUExecutor(compile_program(schedule, model, cores=1), unit_operator))
        runners.append(loop(lambda e=executors[-1]: e(features)))
        labels.append(f"  the same on {name}")
    medians = interleaved_medians(runners, args.repeats, warmup=2)
    print(f"per call, 1 intra-op thread, {calls} calls a run, median of {args.repeats} interleaved runs (measured)")
    for label, ms in zip(labels, medians):
        print(f"  {label:<48} {ms * 1000.0 / calls:7.1f} us/call")
    for executor in executors:
        executor.close()
    return [{"part": "per call", "program": label.strip(), "us_per_call": round(ms * 1000.0 / calls, 2),
             "calls": calls, "repeats": args.repeats, "threads": 1} for label, ms in zip(labels, medians)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="docs/runtime_overhead.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.zeros(1)
    runners, labels = [], []
    graph, _ = chains(args.units, 1)
    fns = [n.run for n in graph.nodes]

    def plain_loop():
        y = x
        for fn in fns:
            y = fn(y)
        return y

    runners.append(plain_loop)
    labels.append("plain Python loop")
    executors = []
    for streams in args.streams:
        graph, order = chains(args.units, streams)
        schedule = from_streams(graph, TableCost(graph), "chains", order)
        executor = CPUExecutor(compile_program(schedule, graph, cores=1), unit_operator)
        executors.append(executor)
        runners.append(lambda executor=executor: executor(x))
        labels.append(f"executor, {streams} stream(s), {compile_program(schedule, graph).events} events")
    medians = interleaved_medians(runners, args.repeats, warmup=2)
    base = medians[0]
    print(f"{args.units} trivial units, 1 intra-op thread, median of {args.repeats} interleaved runs (measured)")
    for label, ms in zip(labels, medians):
        extra = (ms - base) * 1000.0 / args.units
        print(f"  {label:<42} {ms:8.2f} ms  {ms * 1000.0 / args.units:6.1f} us/unit"
              + (f"  (+{extra:.1f} us/unit over the loop)" if label != labels[0] else ""))
    for executor in executors:
        executor.close()
    rows = [{"part": "per unit", "program": label, "units": args.units, "ms": round(ms, 3),
             "us_per_unit": round(ms * 1000.0 / args.units, 3),
             "over_loop_us_per_unit": round((ms - base) * 1000.0 / args.units, 3), "repeats": args.repeats,
             "threads": 1} for label, ms in zip(labels, medians)]
    rows += per_call(args, x)
    where = machine()
    with Path(args.out).open("a") as f:
        f.writelines(json.dumps({**row, **where}) + "\n" for row in rows)


if __name__ == "__main__":
    main()
