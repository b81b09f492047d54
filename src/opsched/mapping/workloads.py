"""Synthetic workloads of DiviML's evaluation: stacks of RandWire modules as unit graphs for the simulated
devices (no PyTorch model is built; the units carry the shapes, FLOPs and bytes the simulator needs).

A module is a random graph (``opsched.models.randwire.random_wiring``: WS(4, 0.75), ER(0.2) or BA(5)) of
separable-convolution units (ReLU -> 3x3 depthwise -> 1x1 pointwise, ``channels`` channels at ``size`` x
``size``), as in RandWire. Its units without inputs read the module's input; ``links`` output units (the
mean of some of the module's sinks, together covering all of them) are the values passed to the next module,
whose input units each read one of them: ``links`` is DiviML's number of channels.

>>> g = randwire_stack(modules=3, nodes=10, generator="er", links=1, seed=0)
>>> len(g), len(g.sinks)
(33, 1)
"""

from __future__ import annotations

import random

from opsched.graph.ir import Graph, Node
from opsched.models.randwire import random_wiring

FLOAT = 4


def randwire_stack(modules: int, nodes: int = 10, generator: str = "er", links: int = 1, seed: int = 0,
                   channels: int = 78, size: int = 28, batch: int = 1) -> Graph:
    rng = random.Random(seed)
    units: list[Node] = []
    previous = ["x"]
    activation = batch * channels * size * size * FLOAT
    for m in range(modules):
        dag = random_wiring(nodes, generator, seed=seed * 1000 + m)
        names = {v: f"m{m}.n{v}" for v in dag.nodes}
        sources = [v for v in sorted(dag.nodes) if dag.in_degree(v) == 0]
        for v in sorted(dag.nodes):
            preds = sorted(dag.predecessors(v))
            if preds:
                args = tuple(names[p] for p in preds)
            else:
                args = (previous[sources.index(v) % len(previous)],)
            units.append(_sepconv(names[v], args, channels, size, batch))
        sinks = [names[v] for v in sorted(dag.nodes) if dag.out_degree(v) == 0]
        count = 1 if m == modules - 1 else max(1, min(links, len(sinks)))
        groups: list[list[str]] = [[] for _ in range(count)]
        for i, s in enumerate(rng.sample(sinks, len(sinks))):
            groups[i % count].append(s)
        previous = []
        for k, group in enumerate(groups):
            name = f"m{m}.out{k}"
            units.append(Node(name, kind="elementwise", args=tuple(sorted(group)), shape=(batch, channels, size, size),
                              dtype="float32", flops=float(len(group) * activation // FLOAT),
                              bytes_read=len(group) * activation, bytes_written=activation, ops=("mean",)))
            previous.append(name)
    return Graph(units, inputs=["x"], name=f"randwire-{generator}{nodes}x{modules}-c{links}")


def _sepconv(name: str, args: tuple[str, ...], channels: int, size: int, batch: int) -> Node:
    pixels = batch * size * size
    params = (9 * channels + channels * channels) * FLOAT
    pre = ("relu",) if len(args) == 1 else ("sigmoid", "mul", "sum", "relu")
    return Node(name, kind="sepconv", args=args, shape=(batch, channels, size, size), dtype="float32",
                flops=2.0 * pixels * channels * (9 + channels), param_bytes=params,
                bytes_read=len(args) * pixels * channels * FLOAT + params, bytes_written=pixels * channels * FLOAT,
                attrs={"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1), "groups": channels,
                       "in_channels": channels, "out_channels": channels, "pre": pre},
                ops=(*pre, "conv2d", "conv2d"))

