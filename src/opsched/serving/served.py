"""The models one process serves: an endpoint per model (its signature and bounded queue), the batchers that run
their requests (one over all of them with a fused group, else one per model), and their plans prepared in a
background thread. ``opsched serve`` holds one in its own process (``--engine local``); with ``--engine ray`` each
Ray Serve replica holds one (:mod:`opsched.serving.ray_engine`).

At startup every model's plans are prepared in the background, one model at a time, for the batch sizes its
batcher forms (:meth:`~opsched.serving.batcher.ModelEndpoint.batch_sizes`), by ``opsched.optimize`` on a copy of
the model, searched for one sample and made for the other sizes from that schedule (or read from a saved plan
with ``opsched.load``); ``ready`` is set once they all are, and until then each model answers its requests itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opsched.errors import first_line
from opsched.exiting import start_background
from opsched.models.sharing import sharing_copy
from opsched.serving.memory import kernels_that_fit, release_freed_memory


class ServedModels:
    """``models`` (name -> ``(model, example_inputs)``) served in this process: ``endpoints`` by name, the fused
    ``group`` (or None), ``ready`` once every plan is prepared, and :meth:`close`. The options are
    :func:`opsched.serving.serve`'s; a name in ``plans`` has its plan file loaded (and checked against its model)
    here, before anything is served."""

    def __init__(self, models: Mapping[str, tuple[Any, Sequence[Any]]], *, max_delay_ms: float = 2.0,
                 max_batch: int = 8, queue_size: int = 64, optimize: bool = True, fuse: bool = True,
                 fuse_max_batch: int = 2, optimize_options: Mapping[str, Any] | None = None,
                 plans: Mapping[str, str | Path] | None = None, say: Callable[[str], Any] = lambda text: None):
        import opsched
        from opsched.serving.batcher import Batcher, ModelEndpoint
        from opsched.serving.fused import FusedGroup

        lock = threading.Lock()  # one call at a time: each takes every intra-op thread of the process
        self.endpoints = {name: ModelEndpoint(name, model, tuple(inputs), max_batch=max_batch, queue_size=queue_size,
                                              lock=lock) for name, (model, inputs) in models.items()}
        for endpoint in self.endpoints.values():
            if endpoint.note:
                say(f"{endpoint.name}: {endpoint.note}")
        loaded = {}
        for name, path in (plans or {}).items():
            say(f"{name}: loading {path} ...")
            loaded[name] = opsched.load(path, sharing_copy(self.endpoints[name].model),
                                        max_plans=self.endpoints[name].max_batch + 1)
        # each block on the kernels that measured faster unless asked (opsched serve's --kernels default, as
        # optimize's): 1.04-1.92x the answers a second of eager kernels under load (docs/serving.md)
        options = {"kernels": "auto", **(optimize_options or {})}
        self.group = None
        endpoints = list(self.endpoints.values())
        if optimize and fuse and sum(e.batchable for e in endpoints) > 1:
            self.group = FusedGroup(endpoints, options, say, max_rows=fuse_max_batch)
            self.batchers = [Batcher(endpoints, max_delay_ms / 1000, fused=self.group)]
        else:
            self.batchers = [Batcher([e], max_delay_ms / 1000) for e in endpoints]
        self.ready, self._stopped = threading.Event(), threading.Event()
        # stopped (self._stopped) at its next measurement or compilation: a server stopped while it prepared took
        # 24-33 s to exit, waiting for a search to end
        self._preparing = start_background(_prepare, (self.endpoints, self.group, optimize, options, loaded,
                                                      self.ready, self._stopped, say), "opsched-serve-prepare",
                                           stop=self._stopped)

    def close(self) -> None:
        """Stop preparing, answer every accepted request, close the modules; once (a Ray Serve replica is closed
        when it stops, and maybe again when it is collected)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._preparing.join(30)  # a preparation under way ends before the process does (a plan made later is closed)
        for batcher in self.batchers:
            batcher.close()
        for module in [e.module for e in self.endpoints.values()] + ([self.group] if self.group else []):
            if hasattr(module, "close"):
                module.close()


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
        release_freed_memory()
        say(f"{name}: ready")
    if group is not None and not stopped.is_set():
        group.prepare()
        release_freed_memory()
    ready.set()
    say("ready")


def _optimized(endpoint: Any, sizes: list[int], options: dict, say: Callable[[str], Any]) -> Any:
    """``endpoint``'s optimized module, with a plan for each of ``sizes``. The batch dimension is declared dynamic:
    the plan for one sample is searched, and every other size's plan is that schedule captured at the size,
    compiled, verified and timed beside the model (no costs measured, no search; see
    :mod:`opsched.runtime.dynamic`). Searched size by size, 16 small CNNs at four sizes each were not ready within
    15 minutes on 2 cores. A model that torch.export finds fixes its batch size gets a search per size."""
    import opsched
    from opsched.errors import CaptureError

    inputs = endpoint.example_batch(1) if endpoint.batchable else endpoint.examples
    options, note = kernels_that_fit(options, [endpoint.model], endpoint.name)
    if note:
        say(note)
    # a plan for every batch size the batcher forms is kept: fewer would be dropped and made again, over and over
    options = {"max_plans": endpoint.max_batch + 1, **options, "batch_sizes": [b for b in sizes if b != 1]}
    if len(sizes) > 1:
        from torch.export import Dim

        batch = Dim("batch", min=1, max=endpoint.max_batch)
        try:
            return opsched.optimize(sharing_copy(endpoint.model), inputs,
                                    dynamic_shapes=tuple({0: batch} for _ in inputs), **options).module
        except CaptureError as e:
            say(f"{endpoint.name}: a search for each batch size ({first_line(e)})")
    return opsched.optimize(sharing_copy(endpoint.model), inputs, **options).module

