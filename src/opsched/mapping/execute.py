"""Running a mapped plan for real: which plans can run here and the devices they need.

A mapped plan is a stream-form Schedule whose stream d runs on its ``devices`` section's device d. A plan on
CPU devices only runs on the CPU backend: each device a worker thread with its device's intra-op threads,
values passing between them in shared memory (a transfer between two CPU devices is free). A plan with
``cuda:N`` devices runs on the several-device executor (:mod:`opsched.runtime.cuda.devices`): each CUDA device a stream of
that GPU holding its units' weights, each CPU device a worker thread, every value crossing devices copied
with the events that order it; it takes the inputs on the host and returns the outputs there, as the model it
stands for does. A plan on a simulated device, one that splits the batch across devices, or one naming a CUDA
device this machine does not have, cannot run, and says so in one line.

>>> from opsched.schedule import DevicesSection, Schedule, OpTiming
>>> platform = {"name": "two", "devices": [{"name": "c0", "kind": "cpu"}, {"name": "c1", "kind": "cpu"}]}
>>> s = Schedule("heft", "g", "f", [OpTiming("a", 0, 0, 1), OpTiming("b", 1, 0, 1)], 1.0,
...              devices=DevicesSection(platform))
>>> check_runnable(s)
{'c0': 1, 'c1': 1}
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from opsched.graph.ir import Graph
from opsched.mapping import MappingError
from opsched.schedule import Schedule


def cuda_devices(schedule: Schedule) -> list[tuple[str, str]]:
    """The CUDA devices a mapped plan puts units on: (name, ``cuda:N``)."""
    devices = schedule.devices.devices
    used = sorted({op.stream for op in schedule.ops})
    return [(devices[d].name, devices[d].kind) for d in used if devices[d].cuda_index is not None]


def check_cuda_devices(devices: Sequence[tuple[str, str]], what: str) -> None:
    """Raise :class:`MappingError` (one line) unless this machine has every CUDA device of ``devices`` (name,
    ``cuda:N``), which ``what`` uses."""
    from opsched.runtime import cuda

    named = ", ".join(f"{name} ({kind})" for name, kind in devices)
    if not cuda.available():
        raise MappingError(f"{what} CUDA device(s) {named}; PyTorch sees no CUDA device here")
    count = cuda.current_api().device_count()
    missing = [(name, kind) for name, kind in devices if int(kind[5:]) >= count]
    if missing:
        raise MappingError(f"{what} {missing[0][0]} ({missing[0][1]}); PyTorch sees {count} CUDA device(s) here")


def check_runnable(schedule: Schedule) -> dict[str, int]:
    """Units per device of a mapped plan that can run here; raises :class:`MappingError` (one line) when it
    cannot: a simulated device, a batch split across devices, or a CUDA device this machine does not have."""
    devices = schedule.devices.devices
    counts = {d.name: 0 for d in devices}
    for op in schedule.ops:
        counts[devices[op.stream].name] += 1
    simulated = [d.name for d in devices if counts[d.name] and d.simulated]
    if simulated:
        raise MappingError(f"the plan maps units onto simulated device(s) {', '.join(simulated)}: it can be shown "
                           "(opsched show) but not run")
    if schedule.devices.split_batch:
        raise MappingError("the plan splits the batch across devices, which runs only in simulation; map with "
                           "--objective latency (or a batch that is not split) to run it")
    cuda = cuda_devices(schedule)
    if cuda:
        check_cuda_devices(cuda, "the plan maps units onto")
    return counts


@contextlib.contextmanager
def on_cuda_device(graph: Graph, inputs: Sequence[torch.Tensor], device: int) -> Iterator[tuple[Graph, list]]:
    """``graph`` with its units' weights, and ``inputs``, copied to CUDA device ``device``, inside which a stream
    of that device is current: what runs, is timed or synchronised in the block does so on that GPU."""
    from opsched.runtime import cuda

    api = cuda.current_api()
    with api.use_stream(api.new_stream(device)):
        nodes = [dataclasses.replace(n, run=api.place(n.run, device)) if isinstance(n.run, torch.nn.Module) else n
                 for n in graph.nodes]
        yield (Graph(nodes, graph.inputs, graph.outputs, graph.name, graph.out_spec),
               [api.to(x, device) for x in inputs])
