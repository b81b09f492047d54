"""All CUDA-only code of opsched, in three parts: :mod:`~opsched.runtime.cuda.api` (the :class:`CudaApi` seam every
CUDA call goes through, and :func:`use_api`, which installs a stand-in), :mod:`~opsched.runtime.cuda.streams` (a
StreamProgram on one GPU's streams and events, or one CUDA graph) and :mod:`~opsched.runtime.cuda.devices` (a
program whose streams run on several devices, for mapped plans)."""

from opsched.runtime.cuda.api import CudaApi, CudaError, TorchCuda, available, current_api, tensor_device, use_api
from opsched.runtime.cuda.devices import DevicesExecutor
from opsched.runtime.cuda.streams import CUDAExecutor, StreamPerTask, hold_for, time_cuda

__all__ = ["CUDAExecutor", "CudaApi", "CudaError", "DevicesExecutor", "StreamPerTask", "TorchCuda", "available",
           "current_api", "hold_for", "tensor_device", "time_cuda", "use_api"]
