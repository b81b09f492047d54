import contextlib
import importlib.util
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


@contextlib.contextmanager
def local_ray(nodes, cpus):
    """A local Ray declaring ``nodes``, connected in this process; skips the test where Ray is not installed or
    cannot start. Not pytest.importorskip("ray"): the engine imports Ray itself, so that the Ray it starts
    stays on loopback."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'opsched[ray]')")
    from opsched.runtime.ray import ClusterError, RayUnavailable, ray_cluster

    session = contextlib.ExitStack()
    try:
        where = session.enter_context(ray_cluster(nodes, cpus=cpus))
    except (ClusterError, RayUnavailable) as e:
        pytest.skip(f"a local Ray cannot start here: {e}")
    with session:
        yield where
