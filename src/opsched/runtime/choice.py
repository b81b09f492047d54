"""Which kernel runs each unit of a plan: the one operator-choice function, :func:`choose_kernels`.

A plan's choice is a plain table, unit name to kernel, made once and recorded in the plan (``unit_kernels``):
the cost model measures each unit with the kernel this table names, and every executor (CPU threads, CUDA
streams and graphs, several devices, Ray actors, the torch.compile backend) runs it with that same kernel,
through :class:`~opsched.runtime.kernels.ChosenKernels`. Nothing downstream decides again, so a unit can no
longer be measured with one kernel and run with another.

Kernels (``UNIT_KERNELS``):

- ``eager``: the unit's own FX graph, ATen operator by operator;
- ``packed``: the same, its 2-D convolutions run by oneDNN with their weights reordered once
  (:mod:`opsched.runtime.packed`); the CPU's default where the whole graph allows it;
- ``inductor``: compiled by TorchInductor (``--kernels inductor``);
- ``onnxruntime``: an ONNX Runtime session (``--kernels onnxruntime``); a unit ONNX cannot take falls back to
  ``eager`` when it is first compiled, and the table says so from then on.

``--kernels auto`` (``opsched optimize``'s default) chooses unit by unit from what each kernel measured
(:mod:`opsched.runtime.auto`); without measurements (a simulated device, a mapping, several models) it is the
default below.

A packed unit leaves its values ``channels_last``, which only units rewritten for it read right: so units are
packed only where every unit of the graph runs on the CPU. With CUDA devices in the plan (a GPU, or a mapping
onto CPU and GPU devices) every unit is ``eager``, on both kinds of device, and is measured so.

>>> import torch
>>> from opsched.graph.capture import capture
>>> g = capture(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()), (torch.randn(1, 3, 8, 8),))
>>> choose_kernels(g)
{'0': 'packed'}
>>> choose_kernels(g, device="cuda"), choose_kernels(g, "inductor")
({'0': 'eager'}, {'0': 'inductor'})
"""

from __future__ import annotations

from typing import Any

from opsched.errors import OpschedError
from opsched.schedule import RUN_KERNELS as ASKED  # what --kernels asks for: a plan-format name list
from opsched.schedule import ScheduleError, unit_kernels

PLACES = ("cpu", "cuda", "cpu+cuda")  # where a plan's units run: the CPU, one GPU, or devices of both kinds


def choose_kernels(graph: Any, asked: str = "eager", device: str = "cpu", shipped: bool = False) -> dict[str, str]:
    """The kernel of each unit of ``graph`` (a :class:`~opsched.graph.ir.Graph`), by name, for a plan that
    runs on ``device`` (``cpu``, ``cuda``, or ``cpu+cuda`` for a mapping with devices of both kinds) with the
    ``asked`` kernels (``--kernels``). ``shipped``: the units travel pickled to another process (Ray actors),
    which loses the example values capture recorded; a unit that needs them is not packed."""
    from opsched.runtime.packed import packs, packs_graph

    if asked not in ASKED:  # (whether this installation can run them: opsched.runtime.kernels.check_kernels)
        raise OpschedError(f"unknown kernels {asked!r}; choose from {', '.join(ASKED)}")
    if device not in PLACES:
        raise OpschedError(f"unknown place {device!r} for kernels; choose from {', '.join(PLACES)}")
    if asked not in ("eager", "auto"):
        return {n.name: asked for n in graph.nodes}
    packing = device == "cpu" and packs_graph(graph, examples=not shipped)
    return {n.name: "packed" if packing and packs(n.run) else "eager" for n in graph.nodes}


def check_choice(choice: Any, graph: Any, source: str = "the plan", device: str = "cpu") -> dict[str, str]:
    """``choice`` (a plan's ``unit_kernels``) as a table for ``graph`` run on ``device`` (see :data:`PLACES`):
    a kernel this opsched knows for every unit, and no other name; ``packed`` only where
    :func:`choose_kernels` could have chosen it (a unit it can rewrite, in a graph that packs, on the CPU), since
    a packed unit's ``channels_last`` values would reach units not rewritten to read them. Raises
    :class:`~opsched.schedule.ScheduleError` (one line) otherwise."""
    from opsched.runtime.packed import packs, packs_graph

    choice = unit_kernels(choice, source)
    names = [n.name for n in graph.nodes]
    missing = [n for n in names if n not in choice]
    extra = [n for n in choice if n not in set(names)]
    if missing or extra:
        raise ScheduleError(f"{source}'s unit_kernels " + (f"name no kernel for unit {missing[0]!r}" if missing
                                                         else f"name unit {extra[0]!r}, which the graph lacks"))
    packed = [n for n in graph.nodes if choice[n.name] == "packed"]
    if packed:
        cannot = next((n.name for n in packed if not packs(n.run)), None)
        why = (f"unit {cannot!r} has nothing the rewrite handles" if cannot is not None
               else f"its units run on {device}" if device != "cpu"
               else None if packs_graph(graph) else "the graph holds a unit that cannot read channels_last values")
        if why:
            raise ScheduleError(f"{source} runs unit {packed[0].name!r} with reordered convolutions (packed), which "
                                f"cannot run here: {why}")
    return {n: choice[n] for n in names}


def place_of(devices: Any) -> str:
    """The place (see :data:`PLACES`) of a plan whose units run on ``devices``: ``cpu``/``cuda``, or the
    kinds of a mapped plan's devices (``cpu``, ``cuda:N``)."""
    if isinstance(devices, str):
        return "cuda" if devices.startswith("cuda") else "cpu"
    kinds = {"cuda" if str(kind).startswith("cuda") else "cpu" for kind in devices}
    return "cpu+cuda" if len(kinds) > 1 else kinds.pop() if kinds else "cpu"
