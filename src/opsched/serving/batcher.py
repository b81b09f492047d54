"""One served model: what it takes and gives (its signature, checked on every request), a bounded queue of requests,
and a thread that batches them across time.

The thread takes the oldest request, gathers what else arrives within ``max_delay`` seconds of it, up to
``max_batch`` samples, runs the group as one call (the requests' inputs joined along their first dimension) and
hands each request its own rows of the outputs. A request that does not fit the batch opens the next one. When a
group's call raises, each of its requests is run alone, so that one bad request fails alone.

Calls go to the model itself until its optimized module is ready (plans prepared ahead for the batch sizes the
batcher forms), then to that module: either way the answer is the model's. One lock, shared by every model of a
server, lets one call run at a time: each call takes every intra-op thread, and two at once on the same cores
would only slow both.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
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


class ModelEndpoint:
    """``model`` served under ``name``: requests checked against the signature of ``example_inputs``, batched
    (when the model's outputs follow its inputs' first dimension) and answered by :meth:`submit`'s futures."""

    def __init__(self, name: str, model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
                 max_batch: int = 8, max_delay: float = 0.002, queue_size: int = 64,
                 lock: threading.Lock | None = None):
        if max_batch < 1 or queue_size < 1 or max_delay < 0:
            raise OpschedError("max_batch and queue_size must be at least 1, max_delay at least 0")
        if not example_inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in example_inputs):
            raise OpschedError(f"model {name!r}: a served model takes tensors of at least one dimension")
        self.name, self.model = name, model.eval()
        self.examples = tuple(example_inputs)
        self.max_delay, self.queue_size = max_delay, queue_size
        self.lock = lock or threading.Lock()
        with torch.inference_mode():
            full = named_outputs(model(*self.examples))
            one = named_outputs(model(*[t[:1] for t in self.examples]))
            two = named_outputs(model(*[torch.cat([t[:1], t[:1]]) for t in self.examples]))
        # batchable: every output's first dimension follows the inputs' (1 -> 2); otherwise one request a call, of
        # the example's shapes
        self.batchable = all(t.dim() >= 1 and t.shape[0] == 1 and two[k].shape[0] == 2 and
                             two[k].shape[1:] == t.shape[1:] for k, t in one.items())
        self.max_batch = max_batch if self.batchable else 1

        def shape(t: torch.Tensor) -> tuple[int, ...]:
            return (-1, *t.shape[1:]) if self.batchable else tuple(t.shape)

        names = input_names(model, len(self.examples))
        self.inputs = [TensorSpec(n, datatype_of(t.dtype), shape(t)) for n, t in zip(names, self.examples)]
        self.outputs = [TensorSpec(k, datatype_of(t.dtype), shape(t)) for k, t in full.items()]
        self.module: Callable[..., Any] = model  # the optimized module, once ready
        self.ready = threading.Event()
        self.note: str | None = None  # why the model itself answers (its preparation failed), if it does
        self.calls = 0
        self._queue: queue.Queue[Request] = queue.Queue(maxsize=queue_size)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"opsched-serve-{name}", daemon=True)
        self._thread.start()

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": ["1"], "platform": "pytorch_opsched",
                "inputs": [s.metadata() for s in self.inputs], "outputs": [s.metadata() for s in self.outputs]}

    def batch_sizes(self) -> list[int]:
        """The sizes the batcher forms most: powers of two up to ``max_batch``, and ``max_batch``."""
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return sizes + [self.max_batch]

    def use(self, module: Callable[..., Any] | None, note: str | None = None) -> None:
        """From now on calls go to ``module`` (None: the model itself, ``note`` saying why); the model is ready."""
        self.module = module if module is not None else self.model
        self.note = note
        self.ready.set()

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
        if batch < 1 or batch > self.max_batch:
            raise ProtocolError(f"a request to {self.name!r} holds 1 to {self.max_batch} samples, this one {batch}")
        return tuple(tensors[n] for n in names), batch

    def submit(self, inputs: tuple[torch.Tensor, ...], batch: int) -> Future:
        """Queue a checked request; its future gets the outputs by name. Raises Overloaded when the queue is full
        or the model is stopping."""
        if self._stopping.is_set():
            raise Overloaded(f"model {self.name!r} is stopping")
        request = Request(inputs, batch)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise Overloaded(f"model {self.name!r} has {self.queue_size} requests waiting; try again") from None
        return request.future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, answer every queued one, and end the thread."""
        self._stopping.set()
        self._thread.join(timeout)

    def _serve(self) -> None:
        carried: Request | None = None
        while True:
            if carried is None:
                try:
                    carried = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stopping.is_set():
                        return
                    continue
            group, total = [carried], carried.batch
            carried = None
            deadline = time.perf_counter() + self.max_delay
            while total < self.max_batch:
                try:
                    request = self._queue.get(timeout=max(deadline - time.perf_counter(), 0.0)) \
                        if deadline > time.perf_counter() else self._queue.get_nowait()
                except queue.Empty:
                    break
                if total + request.batch > self.max_batch:
                    carried = request  # opens the next batch
                    break
                group.append(request)
                total += request.batch
            self._run(group)

    def _run(self, group: list[Request]) -> None:
        group = [r for r in group if r.future.set_running_or_notify_cancel()]
        if not group:
            return
        try:
            inputs = tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(r.inputs for r in group)))
            with self.lock, torch.inference_mode():
                outputs = named_outputs(self.module(*inputs))
                self.calls += 1
        except Exception as error:  # noqa: BLE001 - the model's own failure goes to its requests
            if len(group) > 1:
                for request in group:  # alone, so that only the request that fails gets the error
                    self._run_alone(request)
            else:
                group[0].future.set_exception(error)
            return
        start = 0
        for request in group:
            rows = slice(start, start + request.batch)
            # a copy: a plan may hand out the same output buffers on its next call
            request.future.set_result({k: (v[rows] if self.batchable else v).clone() for k, v in outputs.items()})
            start += request.batch

    def _run_alone(self, request: Request) -> None:
        try:
            with self.lock, torch.inference_mode():
                outputs = named_outputs(self.module(*request.inputs))
                self.calls += 1
        except Exception as error:  # noqa: BLE001
            request.future.set_exception(error)
        else:
            request.future.set_result({k: v.clone() for k, v in outputs.items()})
