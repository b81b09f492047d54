"""The peers: what a user would run instead of opsched, timed beside every opsched plan.

- ``eager``: the model's own forward in PyTorch eager mode, in inference mode, with 1 and with all intra-op
  threads.
- ``torch_compile``: ``torch.compile`` of the whole model with inductor's freezing on (PyTorch's documented
  setting for inference; our compiled units use it too), run in inference mode. Inductor bakes the OpenMP
  thread count into its CPU kernels, so each thread count is compiled in isolation: dynamo is reset, the
  thread count is set and pinned in inductor's config (``cpp.threads``) while it compiles.
- ``onnxruntime`` (when installed): the model exported to ONNX, run by ONNX Runtime with every graph
  optimisation, sequential execution (its parallel mode does not overlap CPU kernels, see
  docs/benchmarks.md) and 1 and all intra-op threads, its thread pool not spinning between calls (spinning,
  it slows whatever runs next in the process: see docs/runtime.md).
- ``cuda_graph`` (on a CUDA device, where plans are replayed as CUDA graphs too): the whole model captured as
  one CUDA graph by PyTorch's documented recipe (warm-up on a side stream, capture on static inputs, replay after
  copying each call's inputs in): what a GPU user who knows CUDA graphs runs at small batch, where launching
  kernels one by one costs more than running them. Like opsched's graph plans, its outputs are overwritten by
  the next call.

For a model batch (:mod:`opsched.multi`), the ways a user runs several models today:

- ``sequential_models``: each model's forward one after another (the batch module's own forward), with 1
  and all threads;
- ``threads``: each model's forward on a thread of its own, all at once (on CUDA, each thread's kernels on a
  stream of its own), with 1 and all intra-op threads (set in each thread); the pool is made once, except
  that at several intra-op threads it is made before and ended after each call, untimed (its threads'
  OpenMP pools would slow every other configuration while they live);
- ``vmap``: ``torch.func.stack_module_state`` and ``vmap`` over ``functional_call``, when every model has
  the same architecture and they read one input; its stacked outputs are split back into one per model;
- ``onnxruntime_models`` (when installed): each model exported to ONNX once and run in a session of its
  own, with ``onnxruntime``'s settings, one after another, with 1 and all intra-op threads; a model that
  cannot be exported leaves the peer out, with a note naming it;
- ``onnxruntime_concurrent`` (when installed): the same sessions called at the same time, one thread per
  model (ONNX Runtime's ``run`` is thread-safe and releases the GIL), each session on 1 intra-op thread
  and on its share of the cores as opsched's concurrent streams get theirs (:func:`session_threads`).

Each peer is a list of :class:`opsched.evaluation.Candidate` (one per thread count) for
:func:`opsched.evaluation.evaluate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from opsched.evaluation import Candidate

PEERS = ("eager", "torch_compile", "onnxruntime", "cuda_graph", "sequential_models", "threads", "vmap", "onnxruntime_models",
         "onnxruntime_concurrent")


def thread_counts(cores: int) -> list[int]:
    return sorted({1, cores})


def eager(model: Any, inputs: Sequence[Any], cores: int, sync: Callable[[], Any] = lambda: None,
          name: str = "eager") -> list[Candidate]:
    """The model's own forward with 1 and ``cores`` threads; ``sync`` waits for the device."""
    import torch

    def at(threads: int) -> Callable[[], Any]:
        def run() -> Any:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out = model(*inputs)
            sync()
            return out
        return run

    return [Candidate(name, at(t), "peer", t, module=model) for t in thread_counts(cores)]


def torch_compile(model: Any, inputs: Sequence[Any], cores: int,
                  sync: Callable[[], Any] = lambda: None) -> list[Candidate]:
    """``torch.compile(model)`` with freezing, compiled separately for 1 and ``cores`` threads."""
    import torch
    import torch._inductor.config as inductor_config

    from opsched.runtime.kernels import without_cuda_home_warning

    candidates = []
    for threads in thread_counts(cores):
        torch._dynamo.reset()
        torch.set_num_threads(threads)
        with inductor_config.patch(freezing=True, **{"cpp.threads": threads}), without_cuda_home_warning():
            compiled = torch.compile(model)
            with torch.inference_mode():
                compiled(*inputs)  # compiles now, while the thread count is pinned

        def run(compiled=compiled, threads=threads) -> Any:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out = compiled(*inputs)
            sync()
            return out

        candidates.append(Candidate("torch_compile", run, "peer", threads, module=compiled))
    torch.set_num_threads(cores)
    return candidates


def cuda_graph(model: Any, inputs: Sequence[Any], api: Any = None) -> Callable[..., Any]:
    """``model`` captured whole as one CUDA graph on the CUDA backend's device interface (``api``, default
    :func:`opsched.runtime.cuda.api.current_api`), for inputs of the shapes, dtypes and devices of ``inputs``.
    The returned callable checks that its arguments are such, copies them into the graph's static inputs,
    replays it and returns the graph's static outputs, which the next call overwrites (as with
    ``torch.cuda.graph``). The tensors the graph keeps are ordinary ones even when made inside the caller's
    inference mode, and nothing is captured under autocast (whose cached weight casts would be recorded by
    address and freed when it ends), as for opsched's own graph plans."""
    import torch

    from opsched.runtime.cuda.api import CudaError, current_api
    from opsched.runtime.cuda.streams import autograd_off, capture_graph

    if torch.is_autocast_enabled("cuda"):
        raise CudaError("a CUDA graph is not captured under autocast (the weights' casts it would record are freed "
                        "when autocast ends)")
    cuda = api or current_api()
    with autograd_off(persistent=True):
        static = [x.detach().clone() for x in inputs]
        graph, outputs = capture_graph(cuda, lambda capturing: model(*static), warmups=3)
    captured_for = [(x.shape, x.dtype, x.device) for x in static]

    def replay(*args: Any) -> Any:
        if [(getattr(a, "shape", None), getattr(a, "dtype", None), getattr(a, "device", None)) for a in args] \
                != captured_for:
            raise CudaError(f"this CUDA graph was captured for inputs {captured_for}; a call must pass tensors of "
                            "the same shapes, dtypes and devices")
        with autograd_off(persistent=True):
            for into, value in zip(static, args):
                into.copy_(value)
        if torch.is_autocast_enabled("cuda"):
            raise CudaError("a CUDA graph is not replayed under autocast: call it outside autocast")
        cuda.replay(graph)
        return outputs

    return replay


def cuda_graph_peer(model: Any, inputs: Sequence[Any], sync: Callable[[], Any]) -> list[Candidate]:
    """The ``cuda_graph`` peer: :func:`cuda_graph` called on the job's inputs."""
    replay = cuda_graph(model, inputs)

    def run() -> Any:
        out = replay(*inputs)
        sync()
        return out

    return [Candidate("cuda_graph", run, "peer", module=replay)]


def onnxruntime(model: Any, inputs: Sequence[Any], cores: int) -> tuple[list[Candidate], str | None]:
    """ONNX Runtime sessions for 1 and ``cores`` intra-op threads, or no candidate and a note saying why."""
    from opsched.runtime.kernels import onnx_session

    exported, note = _onnx_export(model, inputs)
    if exported is None:
        return [], note
    candidates = []
    for threads in thread_counts(cores):
        session = onnx_session(exported, threads)
        feed = _onnx_feed(session, inputs)
        candidates.append(Candidate("onnxruntime", lambda session=session, feed=feed: session.run(None, feed),
                                    "peer", threads, module=_OnnxModule(session)))
    return candidates, None


def onnxruntime_models(batch: Any, inputs: Sequence[Any], cores: int) -> tuple[list[Candidate], str | None]:
    """Each model of ``batch`` exported once and run in an ONNX Runtime session of its own (the settings of
    :func:`onnxruntime`), one after another, with 1 and ``cores`` intra-op threads; or no candidate and a note
    naming the first model that cannot be exported."""
    sessions_at, note = _model_sessions(batch, inputs)
    if sessions_at is None:
        return [], note
    candidates = []
    for threads in thread_counts(cores):
        runs = sessions_at(threads)

        def run(runs=runs) -> Any:
            return tuple(run_model() for run_model in runs)

        candidates.append(Candidate("onnxruntime_models", run, "peer", threads))
    return candidates, None


def onnxruntime_concurrent(batch: Any, inputs: Sequence[Any], cores: int) -> tuple[list[Candidate], str | None]:
    """The sessions of :func:`onnxruntime_models`, all called at the same time from a thread pool, one thread
    per model, each session on 1 intra-op thread and on :func:`session_threads` of ``cores``; or no candidate
    and a note naming the first model that cannot be exported.

    One thread per model, not per core, because that is what a user writes (``pool.map`` over the sessions):
    a session's ``run`` holds its thread for the whole model, so fewer threads than models would run some
    models one after another, and the cores are shared out through each session's intra-op threads instead.
    The pool is made once, its threads started, and lives as long as ``batch``, with no ``prepare`` and
    ``settle`` around each call: unlike the ``threads`` peer's, its threads run only ONNX Runtime, which keeps
    no OpenMP pool in them (the PyPI wheel links no OpenMP library) and whose intra-op threads do not spin
    (:func:`opsched.runtime.kernels.onnx_session`). Measured here: with two SqueezeNets' pool and sessions idle
    after 40 calls, the process used 0.1 ms of CPU in a second."""
    import weakref

    sessions_at, note = _model_sessions(batch, inputs)
    if sessions_at is None:
        return [], note
    pool = _started_pool(len(batch.models))
    weakref.finalize(batch, pool.shutdown, wait=False)
    candidates = []
    for threads in sorted({1, session_threads(cores, len(batch.models))}):
        runs = sessions_at(threads)

        def run(runs=runs) -> Any:
            futures = [pool.submit(run_model) for run_model in runs]
            return tuple(f.result() for f in futures)

        candidates.append(Candidate("onnxruntime_concurrent", run, "peer", threads))
    return candidates, None


def session_threads(cores: int, sessions: int) -> int:
    """The intra-op threads each of ``sessions`` sessions running at the same time gets: ``cores`` split
    evenly, at least one each, the split opsched gives its own streams that run at the same time
    (:mod:`opsched.runtime.program`, :mod:`opsched.cost.measure`), so that neither side has more cores.

    >>> session_threads(16, 3), session_threads(2, 2), session_threads(2, 4)
    (5, 1, 1)
    """
    return max(1, cores // sessions)


def _model_sessions(batch: Any, inputs: Sequence[Any]) -> tuple[Callable[[int], list[Callable[[], Any]]] | None,
                                                                 str | None]:
    """Each model of ``batch`` exported to ONNX once, and what opens its sessions: given an intra-op thread
    count, one call per model, running that model's session (:func:`opsched.runtime.kernels.onnx_session`) on
    its share of ``inputs``. Or None and a note naming the first model that cannot be exported. Each ONNX
    Runtime peer exports the models itself: under a second a model for torchvision's CNNs, and an export kept
    between peers would outlive a change of the weights."""
    from opsched.runtime.kernels import onnx_session

    per_model = batch.split(inputs)
    exported = []
    for k, (model, args) in enumerate(zip(batch.models, per_model)):
        onnx, note = _onnx_export(model, args)
        if onnx is None:
            return None, f"model {k}: {note}"
        exported.append(onnx)

    def sessions_at(threads: int) -> list[Callable[[], Any]]:
        sessions = [onnx_session(onnx, threads) for onnx in exported]
        return [functools.partial(session.run, None, _onnx_feed(session, args))
                for session, args in zip(sessions, per_model)]

    return sessions_at, None


def _onnx_export(model: Any, inputs: Sequence[Any]) -> tuple[bytes | None, str | None]:
    """``model`` on ``inputs`` as ONNX, or None and why not."""
    try:
        import onnxruntime  # noqa: F401 - only whether it is installed
    except ImportError:
        return None, "onnxruntime is not installed (pip install 'opsched[onnx]')"
    from opsched.runtime.kernels import onnx_bytes

    try:
        return onnx_bytes(model, inputs), None
    except Exception as e:  # noqa: BLE001 - any export failure only leaves this peer out
        return None, f"the ONNX export failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _onnx_feed(session: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    return {i.name: x.detach().cpu().numpy() for i, x in zip(session.get_inputs(), inputs)}


class _OnnxModule:
    """An ONNX Runtime session called as the model is: tensors in, tensors out."""

    def __init__(self, session: Any):
        self.session = session

    def __call__(self, *inputs: Any) -> Any:
        import torch

        out = [torch.from_numpy(y) for y in self.session.run(None, _onnx_feed(self.session, inputs))]
        return out[0] if len(out) == 1 else tuple(out)


def threads(batch: Any, inputs: Sequence[Any], cores: int, sync: Callable[[], Any] = lambda: None) -> list[Candidate]:
    """Each model of ``batch`` (a :class:`opsched.multi.ModelBatch`) on its own thread, all at once (on CUDA,
    each on its own stream; ``sync`` waits for the device)."""
    import contextlib
    import weakref

    import torch

    pools: dict[int, Any] = {}  # a thread pool per thread count
    weakref.finalize(batch, lambda: [pool.shutdown(wait=False) for pool in pools.values()])
    streams = None
    if batch.device == "cuda":  # each thread's kernels on a stream of its own, as a GPU user would run them
        from opsched.runtime.cuda import StreamPerTask

        streams = StreamPerTask(len(batch.models))

    def one(k: int, model: Any, args: tuple, count: int) -> Any:
        _use_threads(count)
        with torch.inference_mode(), streams.on(k) if streams else contextlib.nullcontext():
            return model(*args)

    def at(count: int) -> Callable[[], Any]:
        def run() -> Any:
            _use_threads(count)
            if count not in pools:
                pools[count] = _started_pool(len(batch.models), _with_openmp_pool(count))
            if streams:
                streams.fork()
            futures = [pools[count].submit(one, k, m, a, count)
                       for k, (m, a) in enumerate(zip(batch.models, batch.split(inputs)))]
            out = tuple(f.result() for f in futures)
            sync()
            return out
        return run

    # Threads that ran several OpenMP threads keep OpenMP pools that slow every parallel region in the process
    # while they live, the other candidates' too (see opsched.runtime.cpu). So at several threads the pool
    # lives only around its own calls: made and warmed (its OpenMP pools made) before each, ended after it
    # and its threads waited for, all untimed; each timed call finds a pool as a long-lived one would be.
    def make(count: int) -> Callable[[], Any]:
        def prepare() -> None:
            if count not in pools:
                pools[count] = _started_pool(len(batch.models), _with_openmp_pool(count))
        return prepare

    def end(count: int) -> Callable[[], Any]:
        def settle() -> None:
            from opsched.runtime.cpu import end_pool

            pool = pools.pop(count, None)
            if pool is not None:
                end_pool(pool)
        return settle

    return [Candidate("threads", at(t), "peer", t, prepare=make(t) if t > 1 else None,
                      settle=end(t) if t > 1 else None) for t in thread_counts(cores)]


def _use_threads(count: int) -> None:
    """The calling thread's intra-op threads (the OpenMP setting is per thread), set only when it changes:
    setting it clears oneDNN's primitive cache."""
    import torch

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def _started_pool(size: int, start: Callable[[], Any] = lambda: None) -> Any:
    """A thread pool whose ``size`` threads all run, each having called ``start`` (a pool starts its threads
    one task at a time)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(size, thread_name_prefix="opsched-peer")
    everyone = threading.Barrier(size)

    def started() -> None:
        start()
        everyone.wait()

    for future in [pool.submit(started) for _ in range(size)]:
        future.result()
    return pool


def _with_openmp_pool(count: int) -> Callable[[], None]:
    """What starts a thread at ``count`` intra-op threads with its OpenMP pool made (OpenMP makes a thread's
    pool at its first parallel region)."""
    import torch

    def start() -> None:
        _use_threads(count)
        torch.ones(1 << 16).exp_()  # above ATen's grain: a parallel region on ``count`` threads

    return start


def vmap(batch: Any, inputs: Sequence[Any], cores: int, sync: Callable[[], Any] = lambda: None) -> list[Candidate]:
    """``torch.func.vmap`` over the stacked models of ``batch``; none when their architectures differ."""
    import copy

    import torch
    import torch.utils._pytree as pytree

    if not batch.same_architecture:
        return []
    params, buffers = torch.func.stack_module_state(list(batch.models))
    base = copy.deepcopy(batch.models[0]).to("meta")

    def one(p: Any, b: Any, *args: Any) -> Any:
        return torch.func.functional_call(base, (p, b), args)

    stacked = torch.func.vmap(one, in_dims=(0, 0, *[None] * len(batch.per_model[0])))

    def at(count: int) -> Callable[[], Any]:
        def run() -> Any:
            torch.set_num_threads(count)
            # without the warning vmap prints for each operator it has no batching rule for (it then loops)
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
            with torch.inference_mode():
                out = stacked(params, buffers, *batch.split(inputs)[0])  # preprocessed, if the batch is
            sync()
            return tuple(pytree.tree_map(lambda t, k=k: t[k], out) for k in range(len(batch.models)))
        return run

    return [Candidate("vmap", at(t), "peer", t) for t in thread_counts(cores)]
