"""How much slower each CPU device's units run while the other CPU devices of the same machine run theirs: the
cost of co-running devices, which a unit measured alone does not show (they share the memory bandwidth and the
caches, the interpreter's lock between kernels, and on a machine whose cores are hyper-threads, the cores).

A mapping onto several CPU devices of one machine keeps them busy together for most of a run: each device's
units cost their time alone times its factor (see :func:`opsched.jobs.map`). Measured for the mapping itself:
each device's units run in order on its threads, alone and while every other device runs its own units, in
interleaved rounds, on the kernels the plan runs them on (default: the CPU's choice, see
:mod:`opsched.runtime.choice`); a unit reads the values the graph computes for it once beforehand.

>>> import torch
>>> from opsched.graph.capture import capture
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
>>> x = torch.randn(8, 64)
>>> graph = capture(model, (x,))  # two units: the first linear layer with its ReLU, the second
>>> factors = co_running_factors(graph, (x,), [([0], 1), ([1], 1)], repeats=3)
>>> len(factors) == 2 and min(factors) >= 1.0
True
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from opsched.exiting import stop_point
from opsched.graph.interpret import all_values
from opsched.graph.ir import Graph
from opsched.runtime.cpu import wait_until_gone
from opsched.runtime.kernels import ChosenKernels, kernels_for


def co_running_factors(graph: Graph, inputs: Sequence[Any], devices: Sequence[tuple[Sequence[int], int]],
                       repeats: int = 15, kernels: ChosenKernels | None = None) -> list[float]:
    """For each device, given as (its units in run order, its intra-op threads): the median time of its units
    while every other device runs its own, over their median time alone; at least 1."""
    values = all_values(graph, inputs)
    kernels = kernels or kernels_for(graph)
    calls = {u: kernels([graph.nodes[u]], threads) for units, threads in devices for u in units}

    def run(units: Sequence[int]) -> None:
        with torch.inference_mode():  # as the executors run units
            for u in units:
                calls[u](*(values[a] for a in graph.nodes[u].args))

    # read before any other thread sets its own: a thread's count, until it sets its own, follows the last one
    # set in any thread (see opsched.runtime.cpu), and theirs would be taken for the caller's
    caller_threads = torch.get_num_threads()
    try:
        return [_factor(run, units, threads, [d for j, d in enumerate(devices) if j != k], repeats)
                for k, (units, threads) in enumerate(devices)]
    finally:
        torch.set_num_threads(caller_threads)


def _factor(run: Any, units: Sequence[int], threads: int, others: Sequence[tuple[Sequence[int], int]],
            repeats: int) -> float:
    busy = threading.Event()       # the other devices compute while it is set
    stop = threading.Event()
    running = [threading.Lock() for _ in others]  # held by another device for each of its runs

    def other_device(lock: threading.Lock, its_units: Sequence[int], its_threads: int) -> None:
        torch.set_num_threads(its_threads)
        with torch.inference_mode():
            while not stop.is_set():
                if not busy.wait(0.01):
                    continue
                with lock:
                    if busy.is_set():  # not cleared since: an alone sample waits for this run, none starts after
                        run(its_units)

    workers = [threading.Thread(target=other_device, args=(lock, u, t), daemon=True)
               for lock, (u, t) in zip(running, others)]
    for w in workers:
        w.start()
    torch.set_num_threads(threads)
    alone: list[float] = []
    together: list[float] = []
    try:
        with torch.inference_mode():
            run(units)
            for _ in range(repeats):
                stop_point()  # a background build asked to stop (the interpreter exiting, its server stopping)
                for samples, others_busy in ((alone, False), (together, True)):
                    if others_busy:
                        busy.set()
                        time.sleep(0.001)  # the other devices under way
                    else:
                        busy.clear()
                        for lock in running:  # their runs in progress finished
                            with lock:
                                pass
                    began = time.perf_counter()
                    run(units)
                    samples.append(time.perf_counter() - began)
    finally:
        stop.set()
        busy.set()
        for w in workers:
            w.join()
        wait_until_gone([w.native_id for w in workers])  # and their OpenMP pools with them (see runtime.cpu)
    return max(1.0, statistics.median(together) / statistics.median(alone))
