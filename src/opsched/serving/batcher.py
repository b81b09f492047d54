"""Served models: what each takes and gives (its signature, checked on every request), a bounded queue of requests
per model, and a thread that batches the requests of one model, or of a group of models, across time.

The thread takes the oldest request waiting, gathers what else arrives within ``max_delay`` seconds of it (up to
each model's ``max_batch`` samples), and runs each model's requests as one call (the requests' inputs joined along
their first dimension), or, for a group with a fused module (:mod:`opsched.serving.fused`), the requests of every
model present as one call of the fused multi-model graph. Each request gets its own rows of its model's outputs. A
request that does not fit its model's batch opens the next one. When a call raises, each of its requests is run
alone on its model, so that one bad request fails alone.

Calls go to a model itself until its optimized module is ready (plans prepared ahead for the batch sizes the
batcher forms), then to that module: either way the answer is the model's. One lock, shared by every model of a
server, lets one call run at a time: each call takes every intra-op thread, and two at once on the same cores
would only slow both.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from opsched.errors import OpschedError
from opsched.serving.protocol import ProtocolError, datatype_of


class Overloaded(OpschedError):
    """The model's queue is full, or the server is stopping: answered 503 at once."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for the batch dimension where the model batches

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class Request:
    inputs: tuple[torch.Tensor, ...]
    batch: int
    arrived: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)


def input_names(model: torch.nn.Module, count: int) -> list[str]:
    """The forward's parameter names for ``count`` positional inputs (``input_K`` where it has none)."""
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters[:count]]
    return names + [f"input_{k}" for k in range(len(names), count)]


def named_outputs(outputs: Any) -> dict[str, torch.Tensor]:
    """A forward's result by output name: ``output_0``, ... for a tensor or a tuple or list of them, the keys for a
    dict of them."""
    if isinstance(outputs, torch.Tensor):
        return {"output_0": outputs}
    if isinstance(outputs, (tuple, list)) and outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        return {f"output_{k}": o for k, o in enumerate(outputs)}
    if isinstance(outputs, dict) and outputs and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                     for k, v in outputs.items()):
        return dict(outputs)
    raise OpschedError(f"a served model returns a tensor, or a tuple, list or dict of tensors; this one returns "
                       f"{type(outputs).__name__}")


@dataclass(eq=False)
class Signature:
    """What a served model takes and gives: its inputs and outputs (-1 for the batch dimension where it batches),
    whether requests may share a call, and the most samples a call holds. Plain data, sent from where the model runs
    to the front end that checks requests against it."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    batchable: bool
    max_batch: int

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": ["1"], "platform": "pytorch_opsched",
                "inputs": [s.metadata() for s in self.inputs], "outputs": [s.metadata() for s in self.outputs]}

    def check(self, tensors: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], int]:
        """The positional inputs of a request's tensors, and its batch size; ProtocolError where they do not fit."""
        names = [s.name for s in self.inputs]
        if set(tensors) != set(names):
            raise ProtocolError(f"model {self.name!r} takes inputs {', '.join(names)}; the request gives "
                                f"{', '.join(tensors)}")
        batch = None
        for spec in self.inputs:
            tensor = tensors[spec.name]
            if datatype_of(tensor.dtype) != spec.datatype:
                raise ProtocolError(f"input {spec.name!r} of {self.name!r} is {spec.datatype}, not "
                                    f"{datatype_of(tensor.dtype)}")
            shape = tuple(tensor.shape)
            fixed = spec.shape[1:] if self.batchable else spec.shape
            given = shape[1:] if self.batchable else shape
            if len(shape) != len(spec.shape) or given != fixed:
                raise ProtocolError(f"input {spec.name!r} of {self.name!r} has shape {list(spec.shape)}, the request "
                                    f"{list(shape)}")
            if self.batchable:
                if batch is not None and shape[0] != batch:
                    raise ProtocolError(f"the inputs of {self.name!r} differ in their batch sizes")
                batch = shape[0]
        batch = batch if self.batchable else 1
        self.check_batch(batch)
        return tuple(tensors[n] for n in names), batch

    def check_batch(self, batch: int) -> None:
        """ProtocolError unless a call may hold ``batch`` samples."""
        if not 1 <= batch <= self.max_batch:
            raise ProtocolError(f"a request to {self.name!r} holds 1 to {self.max_batch} samples, this one {batch}")

    def signature(self) -> Signature:
        """This signature alone, as plain data (of an endpoint: without its model and queue)."""
        return Signature(**{f.name: getattr(self, f.name) for f in fields(Signature)})

    def take(self, signature: Signature) -> None:
        """From now on, ``signature``'s fields are this one's."""
        for f in fields(Signature):
            setattr(self, f.name, getattr(signature, f.name))


class ModelEndpoint(Signature):
    """``model`` served under ``name``: requests checked against the signature of ``example_inputs``, queued by
    :meth:`submit` (at most ``queue_size``), batched (when each sample's outputs follow from its own inputs alone)
    by the :class:`Batcher` serving it, and answered through :meth:`submit`'s futures."""

    def __init__(self, name: str, model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
                 max_batch: int = 8, queue_size: int = 64, lock: threading.Lock | None = None):
        if max_batch < 1 or queue_size < 1:
            raise OpschedError("max_batch and queue_size must be at least 1")
        if not example_inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in example_inputs):
            raise OpschedError(f"model {name!r}: a served model takes tensors of at least one dimension")
        self.model = model.eval()
        self.examples = tuple(example_inputs)
        self.queue_size = queue_size
        self.lock = lock or threading.Lock()
        batchable, why = batch_independent(model, self.examples)
        self.note: str | None = None if batchable else f"one request a call: {why}"
        with torch.inference_mode():
            full = named_outputs(model(*self.examples))

        def shape(t: torch.Tensor) -> tuple[int, ...]:
            return (-1, *t.shape[1:]) if batchable else tuple(t.shape)

        names = input_names(model, len(self.examples))
        super().__init__(name, [TensorSpec(n, datatype_of(t.dtype), shape(t)) for n, t in zip(names, self.examples)],
                         [TensorSpec(k, datatype_of(t.dtype), shape(t)) for k, t in full.items()], batchable,
                         max_batch if batchable else 1)
        self.module: Callable[..., Any] = model  # the optimized module, once ready
        self.sizes: list[int] | None = None  # the batch sizes it has plans for
        self.ready = threading.Event()
        self.calls = 0
        self.pending: deque[Request] = deque()  # guarded by the batcher's condition
        self.batcher: Batcher | None = None

    def batch_sizes(self) -> list[int]:
        """The sizes the batcher forms most: powers of two up to ``max_batch``, and ``max_batch``."""
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return sizes + [self.max_batch]

    def use(self, module: Callable[..., Any] | None, note: str | None = None) -> None:
        """From now on calls go to ``module`` (None: the model itself, ``note`` saying why), which has a plan for
        each of :meth:`batch_sizes`: the batches formed from then on hold one of those sizes where they can (see
        :meth:`take`). The model is ready."""
        self.module = module if module is not None else self.model
        self.sizes = self.batch_sizes() if module is not None and self.batchable else None
        self.note = note or self.note
        self.ready.set()

    async def infer(self, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
        """A checked request's outputs by name, once its batch has run (see :meth:`submit`)."""
        return await asyncio.wrap_future(self.submit(inputs, batch))

    def submit(self, inputs: tuple[torch.Tensor, ...], batch: int) -> Future:
        """Queue a checked request; its future gets the outputs by name. Raises Overloaded when the queue is full
        or the server is stopping."""
        batcher = self.batcher
        if batcher is None:
            raise OpschedError(f"model {self.name!r} has no batcher")
        self.check_batch(batch)  # a request its batcher would never take would block the model's queue
        request = Request(inputs, batch)
        with batcher.arrived:
            if batcher.stopping:
                raise Overloaded(f"model {self.name!r} is stopping")
            if len(self.pending) >= self.queue_size:
                raise Overloaded(f"model {self.name!r} has {self.queue_size} requests waiting; try again")
            self.pending.append(request)
            batcher.arrived.notify()
        return request.future

    def samples_waiting(self) -> int:
        return sum(r.batch for r in self.pending)

    def take(self) -> list[Request]:
        """The oldest waiting requests that fit in one batch (under the batcher's condition). Where the module has
        plans for some sizes only, the batch is cut back, newest request first, to the largest of those sizes it
        can hold (a lone request keeps its own size): every call then runs a plan made and verified ahead, never
        one made while serving. The requests left open the next batch."""
        taken, total = [], 0
        while self.pending and total + self.pending[0].batch <= self.max_batch:
            request = self.pending.popleft()
            taken.append(request)
            total += request.batch
        while self.sizes and len(taken) > 1 and total not in self.sizes:
            request = taken.pop()
            self.pending.appendleft(request)
            total -= request.batch
        return taken

    def example_batch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The example's first sample, ``rows`` times: the inputs plans are prepared on, and what a model with no
        request reads in a fused call."""
        return self.joined([Request(tuple(t[:1] for t in self.examples), 1)], rows)

    def joined(self, requests: list[Request], rows: int | None = None) -> tuple[torch.Tensor, ...]:
        """The requests' inputs as one call's: joined along their first dimension, and padded to ``rows`` with
        copies of the first sample (whose outputs :meth:`answer` drops) where asked."""
        joined = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(r.inputs for r in requests))]
        extra = (rows or 0) - sum(r.batch for r in requests)
        if extra > 0:
            joined = [torch.cat([t, t[:1].expand(extra, *t.shape[1:])]) for t in joined]
        return tuple(joined)

    def answer(self, requests: list[Request], outputs: Any) -> None:
        """Each request its own rows of ``outputs`` (the model's outputs for the joined inputs), copied: a plan may
        hand out the same output buffers on its next call. Every answer is made before any is given, and outputs
        with too few rows are an error, not short answers."""
        outputs = named_outputs(outputs)
        total = sum(r.batch for r in requests)
        if self.batchable and any(v.dim() == 0 or v.shape[0] < total for v in outputs.values()):
            raise OpschedError(f"model {self.name!r} gave fewer rows than the {total} samples it was given")
        if self.batchable:  # one copy of each output and one split, not two torch calls a request and output
            sizes = [r.batch for r in requests]
            parts = {k: v[:total].clone().split(sizes) for k, v in outputs.items()}
            answers = [{k: parts[k][n] for k in outputs} for n in range(len(requests))]
        else:
            answers = [{k: v.clone() for k, v in outputs.items()} for _ in requests]
        for request, answer in zip(requests, answers, strict=True):
            if not request.future.done():
                request.future.set_result(answer)

    def fail(self, requests: list[Request], error: BaseException) -> None:
        """``error`` for every request not yet answered."""
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)

    def run(self, requests: list[Request]) -> None:
        """The requests as one call of the model's module; on a failure each again alone, to fail alone."""
        requests = [r for r in requests if r.future.set_running_or_notify_cancel()]
        if requests:
            self.retry(requests, self.call(requests))

    def retry(self, requests: list[Request], error: Exception | None) -> None:
        """After a call of several requests that raised ``error`` (None: it did not), each request not yet
        answered alone."""
        requests = [r for r in requests if not r.future.done()]
        if error is None or not requests:
            return
        if len(requests) == 1:
            self.fail(requests, error)
            return
        for request in requests:
            self.retry([request], self.call([request]))

    def call(self, requests: list[Request]) -> Exception | None:
        """The requests (running) as one call of the model's module, each answered; the error if it raised."""
        try:
            inputs = self.joined(requests)
            with self.lock, torch.inference_mode():
                outputs = self.module(*inputs)
                self.calls += 1
            self.answer(requests, outputs)
        except Exception as error:  # noqa: BLE001 - the model's own failure goes to its requests
            return error
        return None


class Batcher:
    """The thread that serves ``endpoints``: it waits for a request, gathers for ``max_delay`` seconds after the
    oldest one, takes a batch of each model and runs them (through ``fused`` when several models of a fused group
    are present). :meth:`close` refuses new requests and returns once every accepted one is answered."""

    def __init__(self, endpoints: Sequence[ModelEndpoint], max_delay: float = 0.002, fused: Any = None):
        if max_delay < 0:
            raise OpschedError("max_delay must be at least 0")
        self.endpoints, self.max_delay, self.fused = list(endpoints), max_delay, fused
        self.arrived = threading.Condition()
        self.stopping = False
        for endpoint in self.endpoints:
            endpoint.batcher = self
        names = "+".join(e.name for e in self.endpoints)
        self._thread = threading.Thread(target=self._serve, name=f"opsched-serve-{names}", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        with self.arrived:
            self.stopping = True
            self.arrived.notify()
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            with self.arrived:
                while not any(e.pending for e in self.endpoints):
                    if self.stopping:
                        return
                    self.arrived.wait(0.05)
                deadline = min(e.pending[0].arrived for e in self.endpoints if e.pending) + self.max_delay
                while not all(e.samples_waiting() >= e.max_batch for e in self.endpoints if e.pending):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        break
                    self.arrived.wait(remaining)
                batches = {e: e.take() for e in self.endpoints if e.pending}
            try:
                if self.fused is not None and len(batches) > 1:
                    self.fused.run(batches)
                else:
                    for endpoint, requests in batches.items():
                        endpoint.run(requests)
            except BaseException as error:  # noqa: BLE001 - never leave a request unanswered, nor the thread dead
                for endpoint, requests in batches.items():
                    endpoint.fail(requests, error)


def batch_independent(model: torch.nn.Module, examples: tuple[torch.Tensor, ...]) -> tuple[bool, str]:
    """Whether requests may share a call of ``model``, as far as one check can tell: each output's first dimension
    follows the inputs', and the rows of a batch of two different samples are each sample's outputs alone (within
    float noise). A model that normalises over its batch, or returns one figure for it, fails it; weaker coupling
    between samples than float noise would not show. The second sample is the example's second, or one made from
    its first that differs from it (see :func:`other_sample`); where none can be made, nothing is batched."""
    from opsched.compare import compare_outputs

    first = tuple(t[:1] for t in examples)
    second = tuple(t[1:2] if t.shape[0] > 1 and not torch.equal(t[1:2], t[:1]) else other_sample(t[:1])
                   for t in examples)
    if any(b is None for b in second):
        return False, "no second sample that differs from the example could be made to check it"
    try:
        with torch.inference_mode():
            alone = [named_outputs(model(*first)), named_outputs(model(*second))]
            together = named_outputs(model(*(torch.cat([a, b]) for a, b in zip(first, second))))
    except Exception as e:  # noqa: BLE001 - a model that takes no batch of two
        return False, f"the model fails on a batch of two ({type(e).__name__})"
    for name, out in together.items():
        if out.dim() == 0 or out.shape[0] != 2 or alone[0][name].shape[0:1] != (1,):
            return False, f"output {name!r} does not follow the batch"
        for k in range(2):
            verdict = compare_outputs(out[k:k + 1], alone[k][name])
            if not verdict.ok:
                return False, f"output {name!r} of a sample depends on the others in its batch ({verdict.why})"
    return True, ""


def other_sample(sample: torch.Tensor) -> torch.Tensor | None:
    """A sample of the same shape and dtype that differs from ``sample`` and stays within what it holds (for
    integers, token ids: its values reversed or rolled, else each lowered or raised by one within its range);
    None where none can be made."""
    if sample.numel() == 0:
        return None
    if sample.dtype == torch.bool:
        return ~sample
    if sample.is_floating_point() or sample.is_complex():
        return sample * 0.5 + 0.25
    for candidate in (sample.flip(-1), sample.roll(1, -1), sample.reshape(-1).roll(1).reshape(sample.shape)):
        if not torch.equal(candidate, sample):
            return candidate
    low = int(sample.min())
    return sample - 1 if low > 0 else sample + 1
