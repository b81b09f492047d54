"""``opsched serve``: models behind the Open Inference Protocol (KServe v2, Triton's HTTP protocol), requests batched
across time, each model answered by its optimized module.

>>> import torch
>>> from opsched.serving import serve
>>> net = torch.nn.Linear(4, 2)
>>> with serve({"net": (net, (torch.randn(1, 4),))}, port=0, block=False, optimize=False) as serving:
...     serving.wait_ready(30)
True

Each model's plans are prepared at startup in the background (:mod:`opsched.serving.served`); the server is ready
once they all are, and until then each model answers its requests itself. Progress goes to stderr, a line per
model. The models run in a process of their own behind the front end (:mod:`opsched.serving.process_engine`),
with ``engine="local"`` in the front end's process, with ``engine="ray"`` in Ray Serve deployments
(:mod:`opsched.serving.ray_engine`).

Needs the ``serve`` extra (``pip install 'opsched[serve]'``: Starlette and uvicorn), and for ``engine="ray"`` Ray
Serve (``pip install 'opsched[serve,ray]'``).
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from opsched.errors import OpschedError


def _say(text: str) -> None:
    # one write per line: print writes the text and its newline apart, and the preparing thread's lines and the
    # server's were seen run together
    sys.stderr.write(f"opsched serve: {text}\n")
    sys.stderr.flush()


class Serving:
    """A server running in a thread of this process (``serve(..., block=False)``): its ``url``, readiness,
    ``endpoints`` by name, ``fused`` (the :class:`~opsched.serving.fused.FusedGroup`, if any, with the local
    engine) and :meth:`stop`; a context manager that stops it on leaving."""

    def __init__(self, server: Any, sock: socket.socket, served: Any):
        self.server, self.endpoints, self.ready, self.fused = server, served.endpoints, served.ready, served.group
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.port = port
        self.thread = threading.Thread(target=_run, args=(server, sock, served), name="opsched-serve-http",
                                       daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every model's plans (and the fused modules prepared ahead) are ready; whether they were
        within ``timeout`` seconds."""
        return self.ready.wait(timeout)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, answer what was accepted, end the models' threads (and, with the Ray engine, its
        deployments)."""
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
          plans: Mapping[str, str | Path] | None = None, engine: str | None = None, replicas: int = 1,
          address: str | None = None, block: bool = True, say: Callable[[str], Any] = _say) -> Serving | None:
    """Serve ``models`` (name -> ``(model, example_inputs)``) on ``host:port`` (0: a free port). Each model batches
    up to ``max_batch`` samples that arrive within ``max_delay_ms`` of the first; ``queue_size`` requests wait at
    most (then 503). ``optimize``: prepare its plans with ``opsched.optimize(**optimize_options)``, ``kernels="auto"``
    unless given (or, for a name in ``plans``, ``opsched.load`` of that plan file); otherwise each model answers
    itself. ``fuse`` (with
    ``optimize``, for two models or more): requests for several models in one batch run as one call of their fused
    graph (:mod:`opsched.serving.fused`), all the models' fused module prepared ahead for batches of up to
    ``fuse_max_batch`` samples of each model (larger ones run each model apart). ``engine``: ``process`` runs the
    models in a process of their own on this machine (:mod:`opsched.serving.process_engine`: the front end and the
    models then each have a core and an interpreter lock); ``local`` in this process; ``ray`` in Ray Serve
    deployments (one per group of models batched together, each with
    ``replicas`` replicas) on a local Ray started for the server, or on the cluster at ``address``
    (:mod:`opsched.serving.ray_engine`). None (the default): with ``block`` (the command line), ``process``, or
    ``local`` (said once) where the models cannot be sent to another process; without it, ``local``: the caller
    keeps its model objects and may change their weights, which the local engine's plans notice and the models'
    own process, holding a copy, would not. ``block``: serve
    until SIGTERM or Ctrl-C (returns None once every
    accepted request was answered); else return a :class:`Serving` running in a thread."""
    try:
        import uvicorn
    except ImportError:
        raise OpschedError("opsched serve needs uvicorn and Starlette: pip install 'opsched[serve]'") from None
    from opsched.serving.app import application

    if not models:
        raise OpschedError("give at least one model to serve")
    if engine is None and not block:  # the caller's objects stay in its hands: served where their changes show
        engine = "local"
    if engine not in (None, "local", "process", "ray"):
        raise OpschedError(f"engine is local, process or ray, not {engine!r}")
    if replicas < 1:
        raise OpschedError("replicas must be at least 1")
    if engine != "ray" and (replicas != 1 or address is not None):
        raise OpschedError("replicas and address go with engine='ray'")
    unknown = set(plans or {}) - set(models)
    if unknown:
        raise OpschedError(f"plans for models not served: {', '.join(sorted(unknown))}")
    options = {"max_delay_ms": max_delay_ms, "max_batch": max_batch, "queue_size": queue_size, "optimize": optimize,
               "fuse": fuse, "fuse_max_batch": fuse_max_batch, "optimize_options": dict(optimize_options or {}),
               "plans": {name: str(Path(path).resolve()) for name, path in (plans or {}).items()}}
    sock = _bind(host, port)
    try:
        if engine == "ray":
            from opsched.serving.ray_engine import RayModels

            served: Any = RayModels(models, options, replicas=replicas, address=address, say=say)
        else:
            served = _served_here(models, options, engine, say)
    except BaseException:
        sock.close()
        raise
    app = application(served.endpoints, served.ready, max_body=int(max_body_mb * (1 << 20)),
                      on_startup=getattr(served, "start", None), on_shutdown=served.close)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    if not block:
        return Serving(server, sock, served)
    host_, port_ = sock.getsockname()[:2]
    say(f"serving {', '.join(served.endpoints)} on http://{host_}:{port_} (Open Inference Protocol, /v2)"
        + (" through Ray Serve" if engine == "ray" else ""))
    _run(server, sock, served)
    return None


def _run(server: Any, sock: socket.socket, served: Any) -> None:
    """uvicorn serving on ``sock`` until it stops; ``served`` closed after, also where uvicorn's shutdown did not
    close it (a failed startup, a second Ctrl-C)."""
    try:
        server.run(sockets=[sock])
    finally:
        served.close()


def _served_here(models: Mapping[str, tuple[Any, Sequence[Any]]], options: dict[str, Any], engine: str | None,
                 say: Callable[[str], Any]) -> Any:
    """The models served on this machine: in a process of their own (``engine`` process, or None where they can be
    sent there), else in this process."""
    from opsched.serving.served import ServedModels

    if engine != "local":
        from opsched.serving.process_engine import CannotSend, ProcessModels

        try:
            return ProcessModels(models, options, say=say)
        except CannotSend as e:
            if engine == "process":
                raise
            say(f"{e}; they run in this process (--engine local)")
    return ServedModels(models, **options, say=say)


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
