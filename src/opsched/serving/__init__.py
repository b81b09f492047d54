"""``opsched serve``: models behind the Open Inference Protocol (KServe v2, Triton's HTTP protocol), requests batched
across time, each model answered by its optimized module.

>>> import torch
>>> from opsched.serving import serve
>>> net = torch.nn.Linear(4, 2)
>>> with serve({"net": (net, (torch.randn(1, 4),))}, port=0, block=False, optimize=False) as serving:
...     serving.wait_ready(30)
True

At startup every model's plans are prepared in the background, one model at a time, for the batch sizes its
batcher forms (:meth:`~opsched.serving.batcher.ModelEndpoint.batch_sizes`), by ``opsched.optimize`` on a copy of
the model, searched for one sample and made for the other sizes from that schedule (or read from a saved plan
with ``opsched.load``); the server is ready once they all are, and until then
each model answers its requests itself. Progress goes to stderr, a line per model.

Needs the ``serve`` extra (``pip install 'opsched[serve]'``: Starlette and uvicorn).
"""

from __future__ import annotations

import copy
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from opsched.errors import OpschedError, first_line


def _say(text: str) -> None:
    # one write per line: print writes the text and its newline apart, and the preparing thread's lines and the
    # server's were seen run together
    sys.stderr.write(f"opsched serve: {text}\n")
    sys.stderr.flush()


class Serving:
    """A server running in a thread of this process (``serve(..., block=False)``): its ``url``, readiness,
    ``endpoints`` by name, ``fused`` (the :class:`~opsched.serving.fused.FusedGroup`, if any) and :meth:`stop`; a
    context manager that stops it on leaving."""

    def __init__(self, server: Any, sock: socket.socket, endpoints: dict, ready: threading.Event, fused: Any = None):
        self.server, self.endpoints, self.ready, self.fused = server, endpoints, ready, fused
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.port = port
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="opsched-serve-http",
                                       daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every model's plans (and the fused modules prepared ahead) are ready; whether they were
        within ``timeout`` seconds."""
        return self.ready.wait(timeout)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, answer what was accepted, end the models' threads."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(models: Mapping[str, tuple[Any, Sequence[Any]]], *, host: str = "127.0.0.1", port: int = 8000,
          max_delay_ms: float = 2.0, max_batch: int = 8, queue_size: int = 64, max_body_mb: float = 64.0,
          optimize: bool = True, fuse: bool = True, fuse_max_batch: int = 2,
          optimize_options: Mapping[str, Any] | None = None,
          plans: Mapping[str, str | Path] | None = None, block: bool = True,
          say: Callable[[str], Any] = _say) -> Serving | None:
    """Serve ``models`` (name -> ``(model, example_inputs)``) on ``host:port`` (0: a free port). Each model batches
    up to ``max_batch`` samples that arrive within ``max_delay_ms`` of the first; ``queue_size`` requests wait at
    most (then 503). ``optimize``: prepare its plans with ``opsched.optimize(**optimize_options)`` (or, for a name
    in ``plans``, ``opsched.load`` of that plan file); otherwise each model answers itself. ``fuse`` (with
    ``optimize``, for two models or more): requests for several models in one batch run as one call of their fused
    graph (:mod:`opsched.serving.fused`), all the models' fused module prepared ahead for batches of up to
    ``fuse_max_batch`` samples of each model (larger ones run each model apart). ``block``: serve until
    SIGTERM or Ctrl-C (returns None once every accepted request was answered); else return a :class:`Serving`
    running in a thread."""
    try:
        import uvicorn
    except ImportError:
        raise OpschedError("opsched serve needs uvicorn and Starlette: pip install 'opsched[serve]'") from None
    from opsched.serving.app import application
    from opsched.serving.batcher import Batcher, ModelEndpoint
    from opsched.serving.fused import FusedGroup

    if not models:
        raise OpschedError("give at least one model to serve")
    unknown = set(plans or {}) - set(models)
    if unknown:
        raise OpschedError(f"plans for models not served: {', '.join(sorted(unknown))}")
    sock = _bind(host, port)
    lock = threading.Lock()
    try:
        endpoints = {name: ModelEndpoint(name, model, tuple(inputs), max_batch=max_batch, queue_size=queue_size,
                                         lock=lock) for name, (model, inputs) in models.items()}
    except BaseException:
        sock.close()
        raise
    for endpoint in endpoints.values():
        if endpoint.note:
            say(f"{endpoint.name}: {endpoint.note}")
    loaded = {}
    try:  # a plan file is read and checked against its model now: one that does not fit is refused, not served
        import opsched

        for name, path in (plans or {}).items():
            say(f"{name}: loading {path} ...")
            loaded[name] = opsched.load(path, copy.deepcopy(endpoints[name].model),
                                        max_plans=endpoints[name].max_batch + 1)
    except BaseException:
        sock.close()
        raise
    # eager kernels unless asked: what opsched serve's --kernels defaults to, and what serving was measured with
    options = {"kernels": "eager", **(optimize_options or {})}
    group = None
    if optimize and fuse and sum(e.batchable for e in endpoints.values()) > 1:
        group = FusedGroup(list(endpoints.values()), options, say, max_rows=fuse_max_batch)
        batchers = [Batcher(list(endpoints.values()), max_delay_ms / 1000, fused=group)]
    else:
        batchers = [Batcher([e], max_delay_ms / 1000) for e in endpoints.values()]
    ready, stopped = threading.Event(), threading.Event()

    def shut_down() -> None:
        stopped.set()
        preparing.join(30)  # a preparation under way ends before the process does (a plan made later is closed)
        for batcher in batchers:
            batcher.close()
        for module in [e.module for e in endpoints.values()] + ([group] if group else []):
            if hasattr(module, "close"):
                module.close()

    preparing = threading.Thread(target=_prepare, args=(endpoints, group, optimize, options, loaded, ready, stopped,
                                                        say), name="opsched-serve-prepare", daemon=True)
    preparing.start()
    app = application(endpoints, ready, max_body=int(max_body_mb * (1 << 20)), on_shutdown=shut_down)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    if not block:
        return Serving(server, sock, endpoints, ready, group)
    host_, port_ = sock.getsockname()[:2]
    say(f"serving {', '.join(endpoints)} on http://{host_}:{port_} (Open Inference Protocol, /v2)")
    server.run(sockets=[sock])
    return None


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so that a port in use is one clear error."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise OpschedError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _prepare(endpoints: dict, group: Any, optimize: bool, options: dict, loaded: dict, ready: threading.Event,
             stopped: threading.Event, say: Callable[[str], Any]) -> None:
    """Each model's optimized module, one model at a time (a model whose preparation fails answers itself; a model
    in ``loaded`` has its plan file's module, given the batch sizes it lacks), then the fused module of all the
    models of ``group`` at one sample each (what a quiet server's batches hold); nothing more once ``stopped``."""
    for name, endpoint in endpoints.items():
        if stopped.is_set():
            return
        if not optimize and name not in loaded:
            endpoint.use(None)
            continue
        sizes = endpoint.batch_sizes() if endpoint.batchable else []
        say(f"{name}: preparing plans" + (f" for batch sizes {', '.join(map(str, sizes))}" if sizes else "") + " ...")
        try:
            if name in loaded:
                module = loaded[name]
                for b in sizes:
                    module.prepare(*endpoint.example_batch(b))
            else:
                module = _optimized(endpoint, sizes, options, say)
        except Exception as e:  # noqa: BLE001 - the model still answers, itself
            endpoint.use(None, first_line(e))
            say(f"{name}: ready; the model answers itself: {first_line(e)}")
            continue
        if stopped.is_set():  # the server stopped meanwhile: the module is never used
            if hasattr(module, "close"):
                module.close()
            return
        endpoint.use(module)
        say(f"{name}: ready")
    if group is not None and not stopped.is_set():
        group.prepare()
    ready.set()
    say("ready")


def _optimized(endpoint: Any, sizes: list[int], options: dict, say: Callable[[str], Any] = _say) -> Any:
    """``endpoint``'s optimized module, with a plan for each of ``sizes``. The batch dimension is declared dynamic:
    the plan for one sample is searched, and every other size's plan is that schedule captured at the size,
    compiled, verified and timed beside the model (no costs measured, no search; see
    :mod:`opsched.runtime.dynamic`). Searched size by size, 16 small CNNs at four sizes each were not ready within
    15 minutes on 2 cores. A model that torch.export finds fixes its batch size gets a search per size."""
    import opsched
    from opsched.errors import CaptureError

    inputs = endpoint.example_batch(1) if endpoint.batchable else endpoint.examples
    # a plan for every batch size the batcher forms is kept: fewer would be dropped and made again, over and over
    options = {"max_plans": endpoint.max_batch + 1, **options, "batch_sizes": [b for b in sizes if b != 1]}
    if len(sizes) > 1:
        from torch.export import Dim

        batch = Dim("batch", min=1, max=endpoint.max_batch)
        try:
            return opsched.optimize(copy.deepcopy(endpoint.model), inputs,
                                    dynamic_shapes=tuple({0: batch} for _ in inputs), **options).module
        except CaptureError as e:
            say(f"{endpoint.name}: a search for each batch size ({first_line(e)})")
    return opsched.optimize(copy.deepcopy(endpoint.model), inputs, **options).module
