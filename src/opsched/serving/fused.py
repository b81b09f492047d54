"""Requests for several models served as one call: the fused multi-model graph (``opsched.optimize_batch``, HiveMind's
fusion and schedule) of the served models, each model reading its own requests' inputs.

The fused module of all the models is made at startup, with a plan for each batch size a call is padded to (the
models' batch sizes up to ``max_rows``, 2 by default; the first searched, the others that schedule made again at
their size, see :meth:`opsched.jobs.BatchBuilder.resize`): every plan verified model by model against the models'
own forwards, and timed against running the models one after another. No fused module is made while serving (a build
would take the cores from the calls). The models of a batch whose samples fit the largest prepared size run as one
fused call when they would take longer one by one than the fused call of all of them, by those timings
(``len(present) * sequential / models > fused``); a model with no request in the batch then reads a copy of its
example, whose outputs are dropped, and every model's batch is padded to the smallest prepared size that holds the
largest present (the models were checked to answer each sample on its own). A model with more samples runs apart, on
its own plans for its batch (before, one such model sent all the others apart too), and so does every model when
the fused call would not pay. When a fused call raises, each model's
requests run again on their own model, so that a request that fails, fails alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.errors import first_line
from opsched.models.sharing import sharing_copy
from opsched.serving.batcher import ModelEndpoint, Request
from opsched.serving.memory import kernels_that_fit


class FusedGroup:
    """The fused module of ``endpoints`` (made with ``opsched.optimize_batch(**options)`` on copies of the models,
    by :meth:`prepare`); :meth:`run` is what a :class:`~opsched.serving.batcher.Batcher` calls with several models'
    requests."""

    def __init__(self, endpoints: Sequence[ModelEndpoint], options: dict[str, Any] | None = None,
                 say: Callable[[str], Any] = lambda text: None, max_rows: int = 2):
        self.endpoints = sorted((e for e in endpoints if e.batchable), key=lambda e: e.name)
        # the sizes a fused call pads to: a batch holding more samples of a model runs each model apart
        self.sizes = sorted({b for e in self.endpoints for b in e.batch_sizes() if b <= max_rows}) or [1]
        # peers: the models one after another only, what a fused call must beat. A peer with no module of its own
        # (threads, vmap) chosen would leave the fused module running the models one after another, and fusion
        # judged by that peer's time (four small networks: "threads" chosen at 31 ms for all, where what ran took 41)
        self.options = {"max_plans": len(self.sizes) + 1, **(options or {}), "peers": ("sequential_models",)}
        self.say = say
        self.module: Any = None  # the fused module, once made
        self.fused_ms = self.apart_ms = 0.0  # a fused call of all, and one model's call, as they were timed
        self.calls = 0
        self.stopping = False

    def prepare(self) -> None:
        """Make the fused module of all the models, with its plans for every size a call is padded to."""
        import opsched

        if self.stopping or len(self.endpoints) < 2:
            return
        names = ", ".join(e.name for e in self.endpoints)
        self.say(f"fusing {names} ...")
        try:
            inputs = [tuple(t[:1] for t in e.examples) for e in self.endpoints]
            # every input's first dimension is the rows a call is padded to: the plans for more rows are made from
            # the first plan's schedule (no search; each verified and timed: BatchBuilder.resize)
            rows = tuple({0: (1, max(self.sizes))} for _ in pytree.tree_leaves(inputs))
            options, note = kernels_that_fit(self.options, [e.model for e in self.endpoints], f"fusing {names}")
            if note:
                self.say(note)
            result = opsched.optimize_batch([sharing_copy(e.model) for e in self.endpoints], inputs,
                                            separate_inputs=True, dynamic_dims=rows, **options)
            module = result.module
            if result.chosen == "sequential_models":  # nothing beat the models one after another: no fused call pays
                if hasattr(module, "close"):
                    module.close()
                self.say(f"{names} run apart: no fused plan beat the models one after another")
                return
            for size in self.sizes[1:]:  # every size a call is padded to: made and verified now, not in a call
                module.prepare(*self._padded({}, size))
            # over the rounds both were timed in: the evaluation's race may have stopped timing one of them early
            self.fused_ms, apart = result.outcome.evaluation.shared_medians(result.chosen, "sequential_models")
        except Exception as e:  # noqa: BLE001 - the models run apart
            self.say(f"{names} run apart: {first_line(e)}")
            return
        self.apart_ms = apart / len(self.endpoints)
        if self.stopping:  # made as the server stopped: never used
            module.close()
            return
        self.module = module
        self.say(f"fused {names}: {result.chosen} chosen, {self.fused_ms:.2f} ms for all against "
                 f"{self.apart_ms:.2f} ms a model apart")

    def worth_it(self, present: int) -> bool:
        """Whether ``present`` models' requests, each model's fitting the largest prepared size, are better served
        by one fused call of all the models."""
        return self.module is not None and present > 1 and present * self.apart_ms > self.fused_ms

    def run(self, batches: dict[ModelEndpoint, list[Request]]) -> None:
        """Every model's requests of one batch: one fused call of the models whose samples fit the largest prepared
        size where :meth:`worth_it` (each request answered with its own rows); the other models, or all where
        fusing does not pay, each apart."""
        fusable = {e: r for e, r in batches.items()
                   if e in self.endpoints and sum(q.batch for q in r) <= self.sizes[-1]}
        if not self.worth_it(len(fusable)):
            fusable = {}
        for endpoint, requests in batches.items():
            if endpoint not in fusable:
                endpoint.run(requests)
        running = {e: [r for r in g if r.future.set_running_or_notify_cancel()] for e, g in fusable.items()}
        running = {e: g for e, g in running.items() if g}
        if not running:
            return
        needed = max(sum(r.batch for r in g) for g in running.values())
        rows = next(b for b in self.sizes if b >= needed)  # a size prepared ahead (fusable saw to it)
        try:
            with self.endpoints[0].lock, torch.inference_mode():
                outputs = self.module(*self._padded(running, rows))
                self.calls += 1
            for endpoint, out in zip(self.endpoints, outputs, strict=True):
                if endpoint in running:
                    endpoint.answer(running[endpoint], out)
        except Exception:  # noqa: BLE001 - each model's requests again on their own, to fail alone
            for endpoint, requests in running.items():
                endpoint.retry(requests, endpoint.call(requests))

    def _padded(self, running: dict[ModelEndpoint, list[Request]], rows: int) -> tuple:
        """Every model's inputs of a fused call of ``rows`` samples each: its requests' (padded), or a copy of its
        example's first sample."""
        return tuple(t for e in self.endpoints
                     for t in (e.joined(running[e], rows) if running.get(e) else e.example_batch(rows)))

    def close(self) -> None:
        """Make no fused module from now on; end the fused module's worker threads."""
        self.stopping = True
        if self.module is not None and hasattr(self.module, "close"):
            self.module.close()
