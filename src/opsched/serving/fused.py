"""Requests for several models served as one call: the fused multi-model graph (``opsched.optimize_batch``, HiveMind's
fusion and schedule) of the models that have requests in a batch, each model reading its own requests' inputs.

The fused module of all the models is prepared at startup. That of another set of models is made once the set has
met in ``SEEN_BEFORE_FUSING`` batches, in the background, one build at a time, at most ``MAX_FUSED`` sets in all
(random traffic over many models makes sets that seldom recur: they run apart); until then those models' requests
run as one call per model. In a fused call every model's batch is padded to the smallest of the sizes prepared ahead
(powers of two up to ``max_batch``, and ``max_batch``) that holds the largest one present (with copies of its
first sample, whose outputs are dropped; the models were checked to answer each sample on its own), so that a
fused module meets only signatures it has plans for: each is a
:class:`~opsched.runtime.guarded.GuardedModule` whose plans for those sizes are made when it is. Every plan was verified model by model against
the models' own forwards, and timed against running them one after another: where fusion does not pay above the
noise, the plan is the models one after another. When a fused call raises, each model's requests run again on
their own model, so that a request that fails, fails alone.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opsched.errors import first_line
from opsched.serving.batcher import ModelEndpoint, Request

SEEN_BEFORE_FUSING = 3
MAX_FUSED = 8


class FusedGroup:
    """The fused modules of subsets of ``endpoints`` (made with ``opsched.optimize_batch(**options)`` on copies of
    the models); :meth:`run` is what a :class:`~opsched.serving.batcher.Batcher` calls with several models'
    requests."""

    def __init__(self, endpoints: Sequence[ModelEndpoint], options: dict[str, Any] | None = None,
                 say: Callable[[str], Any] = lambda text: None):
        self.endpoints = [e for e in endpoints if e.batchable]
        self.max_batch = max((e.max_batch for e in self.endpoints), default=1)
        self.sizes = sorted({b for e in self.endpoints for b in e.batch_sizes()})  # those a fused call pads to
        self.options = {"max_plans": self.max_batch + 1, **(options or {})}
        self.say = say
        self.seen: dict[tuple[str, ...], int] = {}
        self.stopping = False
        self.modules: dict[tuple[str, ...], Any] = {}  # by the sorted names of the models fused
        self.building: set[tuple[str, ...]] = set()
        self.apart: set[tuple[str, ...]] = set()  # sets whose fusion failed: they run apart
        self.calls = 0
        self._lock = threading.Lock()
        self._builds: list[threading.Thread] = []
        self._one_build = threading.Lock()

    def prepare(self, names: Sequence[str], batch: int = 1) -> None:
        """Make the fused module of the models ``names`` now, at ``batch`` samples each."""
        key = tuple(sorted(names))
        with self._lock:
            if key in self.modules or key in self.apart:
                return
            self.building.add(key)
        self._build(key, batch)

    def run(self, batches: dict[ModelEndpoint, list[Request]]) -> None:
        """Every model's requests of one batch: one call of the fused module of the models present where it exists
        (each request answered with its own rows), each model apart where it does not."""
        fusable = {e: r for e, r in batches.items() if e in self.endpoints}
        key = tuple(sorted(e.name for e in fusable))
        module = self.modules.get(key) if len(key) > 1 else None
        if module is None and len(key) > 1:
            with self._lock:
                self.seen[key] = self.seen.get(key, 0) + 1
                wanted = self.seen[key] >= SEEN_BEFORE_FUSING and len(self.modules) + len(self.building) < MAX_FUSED
            if wanted:
                self._build_later(key, 1)
        if module is None:
            for endpoint, requests in batches.items():
                endpoint.run(requests)
            return
        for endpoint, requests in batches.items():
            if endpoint not in fusable:
                endpoint.run(requests)
        ordered = sorted(fusable, key=lambda e: e.name)
        groups = [[r for r in fusable[e] if r.future.set_running_or_notify_cancel()] for e in ordered]
        present = [(e, g) for e, g in zip(ordered, groups) if g]
        if len(present) < len(ordered):  # cancelled meanwhile: what is left runs apart
            for endpoint, requests in present:
                endpoint.retry(requests, endpoint.call(requests))
            return
        needed = max(sum(r.batch for r in g) for _, g in present)
        rows = next((b for b in self.sizes if b >= needed), needed)  # a size prepared ahead
        try:
            inputs = tuple(t for e, g in present for t in e.joined(g, rows))
            with ordered[0].lock, torch.inference_mode():
                outputs = module(*inputs)
                self.calls += 1
            for (endpoint, requests), out in zip(present, outputs, strict=True):
                endpoint.answer(requests, out)
        except Exception:  # noqa: BLE001 - each model's requests again on their own, to fail alone
            for endpoint, requests in present:
                endpoint.retry(requests, endpoint.call(requests))

    def close(self, timeout: float = 60.0) -> None:
        """Make no more fused modules; wait (up to ``timeout`` seconds each) for the builds under way; end the fused
        modules' worker threads."""
        with self._lock:
            self.stopping = True
        for thread in list(self._builds):
            thread.join(timeout)
        for module in list(self.modules.values()):
            if hasattr(module, "close"):
                module.close()

    def _build_later(self, key: tuple[str, ...], batch: int) -> None:
        with self._lock:
            if key in self.modules or key in self.building or key in self.apart or self.stopping:
                return
            self.building.add(key)
        thread = threading.Thread(target=self._build, args=(key, batch), name="opsched-serve-fuse", daemon=True)
        self._builds.append(thread)
        thread.start()

    def _build(self, key: tuple[str, ...], batch: int) -> None:
        import opsched

        chosen = sorted((e for e in self.endpoints if e.name in key), key=lambda e: e.name)  # as run() orders them
        with self._one_build:
            if self.stopping:
                return
            self.say(f"fusing {', '.join(key)} ...")
            try:
                inputs = [tuple(torch.cat([t[:1]] * batch) for t in e.examples) for e in chosen]
                result = opsched.optimize_batch([copy.deepcopy(e.model) for e in chosen], inputs, separate_inputs=True,
                                                **self.options)
                module = result.module
                for size in self.sizes[1:]:  # every size a batch is padded to: made and verified now, not in a call
                    module.prepare(*(t for e in chosen for t in e.joined([Request(tuple(x[:1] for x in e.examples), 1)], size)))
                self.say(f"fused {', '.join(key)}: {result.chosen} chosen")
            except Exception as e:  # noqa: BLE001 - those models keep running apart
                module = None
                self.say(f"{', '.join(key)} run apart: {first_line(e)}")
        with self._lock:
            self.building.discard(key)
            if module is not None and self.stopping:  # made as the server stopped: never used
                module.close()
            elif module is not None:
                self.modules[key] = module
            else:
                self.apart.add(key)
