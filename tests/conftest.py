import random

import pytest

from opsched.graph.ir import Graph, Node


def random_dag(n: int, p: float, seed: int, latency: bool = True) -> Graph:
    """A random DAG on units v0..v{n-1} (edges from lower to higher index, in a shuffled listing order)."""
    rng = random.Random(seed)
    nodes = [Node(f"v{i}", args=tuple(f"v{j}" for j in range(i) if rng.random() < p),
                  latency=float(rng.randint(1, 9)) if latency else None) for i in range(n)]
    rng.shuffle(nodes)
    return Graph(nodes, name=f"random-{n}-{seed}")


@pytest.fixture
def make_dag():
    return random_dag


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Measurements in tests go to a fresh cache, never the user's."""
    monkeypatch.setenv("OPSCHED_CACHE_DIR", str(tmp_path / "cache"))
