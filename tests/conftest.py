import contextlib
import gc
import importlib.util
import random

import pytest

from opsched.graph.ir import Graph, Node


def pytest_terminal_summary(terminalreporter):
    """Which versions the suite ran on, at the end of every run (``-q`` too): opsched runs on the pinned CPU
    versions here and on a GPU machine's own (Python 3.12, a CUDA build of PyTorch 2.11; see docs/gpu.md)."""
    import platform

    import torch

    from opsched.runtime import cuda

    device = cuda.current_api().describe().split("|")[1] if cuda.available() else "none"
    terminalreporter.write_line(f"opsched suite: Python {platform.python_version()}, PyTorch {torch.__version__}, "
                                f"CUDA device: {device}")


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


@pytest.fixture
def clock(monkeypatch):
    """A clock only the runners move (:class:`support.fake_clock.FakeClock`), read by opsched's timing: timing logic
    tested without the machine's noise."""
    from support.fake_clock import FakeClock

    import opsched.timing

    made = FakeClock()
    monkeypatch.setattr(opsched.timing, "time", made)
    return made


@pytest.fixture(scope="session")
def zoo_captured():
    """``get(spec, batch, image_size)``: a zoo model loaded and captured once for the whole session, as
    ``(loaded, graph)`` (capturing NASNet-A takes about 10 s here; test_zoo and test_runtime both use it). Tests
    must not change either."""
    from opsched.graph.capture import capture
    from opsched.models import load_model

    cache: dict[tuple, tuple] = {}

    def get(spec: str, batch: int, image_size: int | None) -> tuple:
        key = (spec, batch, image_size)
        if key not in cache:
            loaded = load_model(spec, batch=batch, image_size=image_size)
            cache[key] = (loaded, capture(loaded.model, loaded.inputs, name=spec))
        return cache[key]

    return get


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


def pytest_collection_finish(session):
    """Move every object alive once the tests are collected (PyTorch's and the other libraries' modules: some
    350,000) out of the garbage collector's reach: each full collection then skips them, and the CUDA stand-in
    runs one per check (0.1 s each, a quarter of its tests' time)."""
    gc.freeze()
