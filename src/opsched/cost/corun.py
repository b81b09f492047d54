"""How much slower a CPU device's units run while other CPU devices of the same machine compute: the cost of
co-running devices, which a unit measured alone does not show (they share the memory bandwidth and the
caches, and on a machine whose cores are hyper-threads, the cores themselves).

A mapping onto several CPU devices of one machine keeps them busy together for most of a run: its units'
costs are their costs alone times this factor (see :func:`opsched.jobs.map`). Measured as the graph's units
run in order on ``threads`` threads, alone and while ``others`` threads run them too, in interleaved rounds.

>>> import torch
>>> from opsched.graph.capture import capture
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
>>> x = torch.randn(8, 64)
>>> co_running_factor(capture(model, (x,)), (x,), threads=1, repeats=3) >= 1.0
True
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from opsched.graph.interpret import run_graph
from opsched.graph.ir import Graph
from opsched.runtime.cpu import wait_until_gone


def co_running_factor(graph: Graph, inputs: Sequence[Any], threads: int, others: int = 1,
                      repeats: int = 15) -> float:
    """The median time of the graph's units in order on ``threads`` intra-op threads while ``others`` threads
    (each on ``threads`` threads) run them too, over their median time alone; at least 1."""
    busy = threading.Event()       # the other devices compute while it is set
    stop = threading.Event()
    running = [threading.Lock() for _ in range(others)]  # held by another device for each of its runs

    def other_device(lock: threading.Lock) -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            while not stop.is_set():
                if not busy.wait(0.01):
                    continue
                with lock:
                    if busy.is_set():  # not cleared since: an alone sample waits for this run, none starts after
                        run_graph(graph, *inputs)

    # read before the other devices start: a thread's count, until it sets its own, follows the last one set in
    # any thread (see opsched.runtime.cpu), and theirs would be taken for the caller's
    caller_threads = torch.get_num_threads()
    workers = [threading.Thread(target=other_device, args=(lock,), daemon=True) for lock in running]
    for w in workers:
        w.start()
    torch.set_num_threads(threads)
    alone: list[float] = []
    together: list[float] = []
    try:
        with torch.inference_mode():
            run_graph(graph, *inputs)
            for _ in range(repeats):
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
                    run_graph(graph, *inputs)
                    samples.append(time.perf_counter() - began)
    finally:
        stop.set()
        busy.set()
        for w in workers:
            w.join()
        wait_until_gone([w.native_id for w in workers])  # and their OpenMP pools with them (see runtime.cpu)
        torch.set_num_threads(caller_threads)
    return max(1.0, statistics.median(together) / statistics.median(alone))
