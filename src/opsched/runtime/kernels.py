"""How a run step's units execute (``--kernels``): an *operator* maps the units of a run step and the
intra-op threads it gets to a callable.

- ``eager``: the unit's own FX graph, ATen operator by operator; a merge stage runs the merged convolution.
- ``inductor``: the same graph compiled by TorchInductor into C++/OpenMP kernels. The FX graph is handed to
  ``compile_fx`` directly instead of going through ``torch.compile``: dynamo would see every unit as the
  same ``GraphModule.forward`` code object and, after 8 recompiles, silently run the rest eagerly.
  Weights are frozen into the compiled code (``freezing``), which folds batch norms into convolutions.
  Inductor bakes the OpenMP thread count into its kernels when it compiles them, so a unit is compiled
  for the threads of the step that runs it (one compilation per unit and thread count, memoised);
  inductor's on-disk cache makes a second process's compilations quick.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opsched.errors import OpschedError
from opsched.graph.ir import Node
from opsched.runtime.merge import merged_operator

Operator = Callable[[Sequence[Node], int], Callable[..., Any]]

KERNELS = ("eager", "inductor")


def unit_operator(nodes: Sequence[Node], threads: int = 1) -> Callable[..., Any]:
    """Eager: the unit's own operator, or the merged convolution of a merge stage. A unit's GraphModule is
    called through its ``forward``: ``nn.Module.__call__`` adds hook handling that units never use, a few
    microseconds on every unit of every call."""
    if len(nodes) > 1:
        return merged_operator(nodes)
    run = nodes[0].run
    return run.forward if isinstance(run, torch.fx.GraphModule) else run


class InductorOperator:
    """Inductor-compiled units; ``example(name)`` gives a value each unit input can be compiled for.
    ``compile_seconds`` adds up the time spent compiling."""

    def __init__(self, example: Callable[[str], Any]):
        self.example = example
        self.compiled: dict[tuple[tuple[Any, ...], int], Callable[..., Any]] = {}
        self.compile_seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        # by the units' own operators, not their names: a compiled region is named after its last unit
        key = (tuple(n.run for n in nodes), threads)
        with self._lock:
            if key not in self.compiled:
                self.compiled[key] = self._compile(nodes, threads)
        return self.compiled[key]

    def _compile(self, nodes: Sequence[Node], threads: int) -> Callable[..., Any]:
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        base = nodes[0].run if len(nodes) == 1 else merged_operator(nodes)
        if isinstance(base, torch.fx.GraphModule):
            # compile_fx rewrites the graph it is given (its output becomes a tuple): hand it a copy that
            # shares the parameters, so that the unit's own graph, and later compilations, stay as they were.
            gm = torch.fx.GraphModule(base, copy.deepcopy(base.graph))
        else:
            gm = _trace(base, nodes, self.example)
        args = [self.example(a) for a in nodes[0].args]
        began = time.perf_counter()
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with inductor_config.patch(freezing=True), torch.no_grad():
                compiled = compile_fx(gm, args)
        except Exception as e:  # noqa: BLE001 - inductor raises many kinds; one line for the user
            raise OpschedError(f"inductor could not compile unit {nodes[0].name!r}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        finally:
            torch.set_num_threads(saved)
        self.compile_seconds += time.perf_counter() - began
        return compiled


def _trace(fn: Callable[..., Any], nodes: Sequence[Node], example: Callable[[str], Any]) -> torch.fx.GraphModule:
    """An FX graph of a callable (the merged convolution) for inductor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn)(*[example(a) for a in nodes[0].args])


def operator_for(kernels: str, example: Callable[[str], Any] | None) -> Operator:
    """The operator that ``--kernels`` names; ``example`` (values to compile for) is needed by inductor."""
    if kernels == "eager":
        return unit_operator
    if kernels == "inductor":
        return InductorOperator(example)
    raise OpschedError(f"unknown kernels {kernels!r}; choose from {', '.join(KERNELS)}")
