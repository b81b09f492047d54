"""IOS's Table 1 for our graphs: the largest block of each network (cut only at cut units), its size and
width, and the states and transitions the IOS search visits on it at r=3, s=8 (measured on this machine;
the counts do not depend on the cost model).

    python benchmarks/largest_block.py [--models inception_v3 squeezenet randwire] [--max-units 40]
                                       [--out docs/largest_block.jsonl]

Each network's row, with the machine, versions, date and commit, is appended to --out (docs/benchmarks.md's
table).

Blocks larger than --max-units are reported without searching them (NASNet-A's 48-unit block takes hours).
"""

import argparse
import time

from sweep import appender

from opsched.cost.simulate import SimulatedGPU
from opsched.graph.blocks import split_blocks
from opsched.graph.capture import capture
from opsched.models import load_model
from opsched.schedulers.ios import StageCost, search_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["inception_v3", "randwire", "nasnet", "squeezenet"])
    parser.add_argument("--max-units", type=int, default=40)
    parser.add_argument("--out", default="docs/largest_block.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    append = appender(args.out)
    print("| network | n | width | states | transitions | seconds |\n|---|---|---|---|---|---|")
    for name in args.models:
        m = load_model(name, batch=1)
        graph = capture(m.model, m.inputs)
        block = max(split_blocks(graph, 0, at_cuts=True), key=lambda b: len(b.units))
        width = graph.width_of(block.mask)
        row = {"network": name, "units": len(block.units), "width": width, "r": 3, "s": 8}
        if len(block.units) > args.max_units:
            row["searched"] = False
            print(f"| {name} | {len(block.units)} | {width} | not searched | | |", flush=True)
        else:
            stage_cost = StageCost(graph, SimulatedGPU(graph, "v100"), True, True)
            started = time.perf_counter()
            best, _, transitions = search_block(graph, block.mask, 3, 8, stage_cost)
            row.update(searched=True, states=len(best) - 1, transitions=transitions,
                       seconds=round(time.perf_counter() - started, 3))
            print(f"| {name} | {len(block.units)} | {width} | {row['states']} | {transitions} | {row['seconds']:.2f} |",
                  flush=True)
        append(row)


if __name__ == "__main__":
    main()
