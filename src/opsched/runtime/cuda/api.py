"""The device interface: everything opsched asks of CUDA goes through one small object, a :class:`CudaApi`
(streams, events, ``record_stream``, synchronisation, event timing, graph capture and replay).
:class:`TorchCuda` implements it on ``torch.cuda`` and is the default; :func:`use_api` installs another one, such
as the test suite's stand-in, which runs the same calls on CPU or ``meta`` tensors and raises wherever a program
breaks CUDA's rules, so that the CUDA code runs in CI on a machine without a GPU."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from opsched.errors import OpschedError

HOLD_CALIBRATIONS = 5  # spins timed to learn the GPU clock a hold counts in


class CudaError(OpschedError, RuntimeError):
    """CUDA asked for where there is none, or used in a way the CUDA backend does not support."""


class CudaApi(Protocol):
    """The device interface: everything the CUDA backend asks of CUDA. Streams, events and graphs are
    opaque objects handed back to the same interface. Every call is asynchronous on the device except
    :meth:`synchronize`."""

    device: torch.device
    """Where this interface's tensors live (``cuda``; the stand-in's are on ``cpu`` or ``meta``)."""

    def available(self) -> bool: ...

    def device_count(self) -> int: ...

    def describe(self) -> str:
        """What makes timings comparable: the GPU, its compute capability, CUDA and PyTorch versions."""

    def current_stream(self) -> Any: ...

    def new_stream(self, device: int | None = None) -> Any:
        """A stream of CUDA device ``device`` (default: the current device)."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context in which ``stream`` is the current stream (kernels launch on it)."""

    def new_event(self, timing: bool = False) -> Any:
        """An event; only ``timing`` events can be passed to :meth:`elapsed_ms`."""

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after the work ``event`` was recorded behind."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` when it is freed is done."""

    def place(self, module: torch.nn.Module, device: int) -> torch.nn.Module:
        """A copy of ``module`` with its weights on CUDA device ``device``, allocated on that device's current
        stream and there when this returns; ``module`` itself stays where it is."""

    def to(self, tensor: torch.Tensor, device: int | None) -> torch.Tensor:
        """``tensor`` copied to CUDA device ``device`` (the host for None) with ``non_blocking``: queued on the
        current stream of the target device, or of the source's device for a copy to the host, whose result
        may be read only after synchronising with an event recorded after the copy."""

    def synchronize(self) -> None:
        """The host waits for everything queued on the current device."""

    def synchronize_event(self, event: Any) -> None:
        """The host waits for the work ``event`` was recorded behind."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded, completed timing events."""

    def new_graph(self) -> Any: ...

    def capture(self, graph: Any) -> contextlib.AbstractContextManager:
        """A context whose work is captured into ``graph``; inside it the current stream is the capture
        stream."""

    def replay(self, graph: Any) -> None: ...

    def hold(self, ms: float) -> None:
        """Keep the current stream busy on the device for about ``ms`` milliseconds (a kernel that spins), so
        that the work the host queues meanwhile starts after it and then runs back to back, as a replayed CUDA
        graph runs: timed from behind a hold, work shows its device time without its launches."""


class TorchCuda:
    """:class:`CudaApi` on ``torch.cuda`` (or on ``api``, any object with torch.cuda's names)."""

    device = torch.device("cuda")

    def __init__(self, api: Any = None):
        self.api = api if api is not None else torch.cuda
        self._cycles_per_ms: float | None = None  # the spin kernel's clock, measured at the first hold

    def available(self) -> bool:
        return self.api.is_available()

    def device_count(self) -> int:
        return self.api.device_count()

    def describe(self) -> str:
        index = self.api.current_device()
        major, minor = self.api.get_device_capability(index)
        return (f"cuda|{self.api.get_device_name(index)}|sm_{major}{minor}|cuda {torch.version.cuda}|"
                f"torch {torch.__version__}")

    def current_stream(self) -> Any:
        return self.api.current_stream()

    def new_stream(self, device: int | None = None) -> Any:
        return self.api.Stream(device=device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.api.stream(stream)

    def new_event(self, timing: bool = False) -> Any:
        return self.api.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def place(self, module: torch.nn.Module, device: int) -> torch.nn.Module:
        return copy.deepcopy(module).to(torch.device("cuda", device))

    def to(self, tensor: torch.Tensor, device: int | None) -> torch.Tensor:
        return tensor.to(torch.device("cpu") if device is None else torch.device("cuda", device), non_blocking=True)

    def synchronize(self) -> None:
        self.api.synchronize()

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def new_graph(self) -> Any:
        return self.api.CUDAGraph()

    def capture(self, graph: Any) -> contextlib.AbstractContextManager:
        # Plans are captured in the background build thread while the caller's thread keeps calling the model:
        # CUDA's default ("global") capture mode fails an unsafe call such as cudaMalloc made by *any* thread during
        # the capture; "thread_local" checks only the capturing thread, as PyTorch's own cudagraph trees capture.
        return self.api.graph(graph, capture_error_mode="thread_local")

    def replay(self, graph: Any) -> None:
        graph.replay()

    def hold(self, ms: float) -> None:
        if self._cycles_per_ms is None:
            # torch.cuda._sleep spins for a count of GPU clock cycles: how many make a millisecond, timed on a few
            # spins, the most kept: a spin timed while the clocks were low would make every later hold too short
            cycles, rates = 1_000_000, []
            self.api._sleep(cycles)  # the first launch of the kernel loads it: not timed
            for _ in range(HOLD_CALIBRATIONS):
                began, ended = self.new_event(timing=True), self.new_event(timing=True)
                began.record()
                self.api._sleep(cycles)
                ended.record()
                ended.synchronize()
                rates.append(cycles / max(began.elapsed_time(ended), 1e-3))
            self._cycles_per_ms = max(rates)
        self.api._sleep(max(1, int(ms * self._cycles_per_ms)))


_installed: list[CudaApi] = []
_torch_cuda = TorchCuda()


def current_api() -> CudaApi:
    """The device interface in use: the one :func:`use_api` installed last, else ``torch.cuda``."""
    return _installed[-1] if _installed else _torch_cuda


@contextlib.contextmanager
def use_api(api: CudaApi) -> Iterator[CudaApi]:
    """Run the CUDA backend (executors made inside, :func:`time_cuda`, the measured cost model) on ``api``.

    >>> class NoGPU(TorchCuda):
    ...     def available(self): return False
    >>> with use_api(NoGPU()):
    ...     available()
    False
    """
    _installed.append(api)
    try:
        yield api
    finally:
        _installed.remove(api)


def available() -> bool:
    return current_api().available()


def tensor_device(device: str) -> Any:
    """Where the tensors of a run on opsched's ``device`` (``cpu`` or ``cuda``) live: for ``cuda``, the device of
    the interface in use (the GPU, or the stand-in's CPU), so that a command's models and inputs go where its
    CUDA backend runs.

    >>> tensor_device("cpu")
    'cpu'
    """
    return current_api().device if device == "cuda" else device
