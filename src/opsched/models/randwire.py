"""RandWire (Xie et al. 2019, "Exploring Randomly Wired Neural Networks"), small regime, as IOS benchmarks it.

A stage is a random graph from networkx (Watts-Strogatz WS(32, 4, 0.75) by default; Erdos-Renyi ER(0.2)
or Barabasi-Albert BA(5) selectable), seeded, made a DAG by pointing every edge from the lower to the
higher node index. A node sums its inputs with learned positive weights (sigmoid), then runs
ReLU -> separable 3x3 convolution -> batch norm. Nodes without inputs read the stage input with stride 2;
the stage output is the mean of the nodes without outputs.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import nn

GENERATORS = ("ws", "er", "ba")


def random_wiring(nodes: int = 32, generator: str = "ws", seed: int = 0) -> nx.DiGraph:
    """A random undirected graph made a DAG by orienting each edge from lower to higher index.

    >>> dag = random_wiring(32, "ws", seed=1)
    >>> dag.number_of_nodes(), nx.is_directed_acyclic_graph(dag)
    (32, True)
    """
    if generator == "ws":
        g = nx.connected_watts_strogatz_graph(nodes, 4, 0.75, seed=seed)
    elif generator == "er":
        g = nx.erdos_renyi_graph(nodes, 0.2, seed=seed)
    elif generator == "ba":
        g = nx.barabasi_albert_graph(nodes, 5, seed=seed)
    else:
        raise ValueError(f"unknown random graph generator {generator!r}; choose from {', '.join(GENERATORS)}")
    dag = nx.DiGraph()
    dag.add_nodes_from(range(nodes))
    dag.add_edges_from((min(u, v), max(u, v)) for u, v in g.edges)
    return dag


class SepConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.depthwise = nn.Conv2d(in_channels, in_channels, 3, stride, 1, groups=in_channels, bias=False)
        self.pointwise = nn.Conv2d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class WiredNode(nn.Module):
    def __init__(self, inputs: int, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(inputs)) if inputs > 1 else None
        self.conv = SepConv(in_channels, out_channels, stride)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if self.weight is None:
            x = inputs[0]
        else:
            w = torch.sigmoid(self.weight)
            x = inputs[0] * w[0]
            for i in range(1, len(inputs)):
                x = x + inputs[i] * w[i]
        return self.bn(self.conv(torch.relu(x)))


class RandomStage(nn.Module):
    def __init__(self, dag: nx.DiGraph, in_channels: int, out_channels: int):
        super().__init__()
        self.order = list(nx.topological_sort(dag))
        self.preds = {v: sorted(dag.predecessors(v)) for v in self.order}
        self.outputs = [v for v in self.order if dag.out_degree(v) == 0]
        self.nodes = nn.ModuleDict({
            str(v): WiredNode(max(1, len(self.preds[v])), out_channels if self.preds[v] else in_channels,
                              out_channels, 1 if self.preds[v] else 2)
            for v in self.order})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: dict[int, torch.Tensor] = {}
        for v in self.order:
            values[v] = self.nodes[str(v)]([values[p] for p in self.preds[v]] if self.preds[v] else [x])
        y = values[self.outputs[0]]
        for v in self.outputs[1:]:
            y = y + values[v]
        return y / len(self.outputs)


class RandWire(nn.Module):
    def __init__(self, channels: int = 78, nodes: int = 32, generator: str = "ws", seed: int = 0,
                 num_classes: int = 1000):
        super().__init__()
        c = channels
        self.conv1 = nn.Sequential(nn.Conv2d(3, c // 2, 3, 2, 1, bias=False), nn.BatchNorm2d(c // 2))
        self.conv2 = nn.Sequential(nn.ReLU(), SepConv(c // 2, c, 2), nn.BatchNorm2d(c))
        self.stages = nn.Sequential(*[
            RandomStage(random_wiring(nodes, generator, seed + k), c * 2 ** max(k - 1, 0) if k else c, c * 2 ** k)
            for k in range(3)])
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(4 * c, 1280, 1, bias=False), nn.BatchNorm2d(1280),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.conv2(self.conv1(x))))


def randwire(batch: int = 1, image_size: int | None = None, generator: str = "ws", seed: int = 0,
             channels: int = 78, nodes: int = 32, num_classes: int = 1000):
    """RandWire small regime (C=78, three random stages of 32 nodes) at 224x224; returns ``(model, (x,))``."""
    torch.manual_seed(seed)
    size = image_size or 224
    model = RandWire(channels, nodes, generator, seed, num_classes).eval()
    return model, (torch.randn(batch, 3, size, size),)
