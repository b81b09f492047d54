"""The end-to-end job of ``opsched optimize``, as plain functions over the pipeline's stages:
capture -> Graph -> cost model -> scheduler -> Schedule -> compile -> run, verify and measure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opsched.cost.base import CostModel
from opsched.errors import OpschedError
from opsched.graph.blocks import DEFAULT_MAX_SIZE
from opsched.graph.ir import Graph
from opsched.schedule import Schedule
from opsched.schedulers import make_schedule

MAX_REFINEMENTS = 8


def method_options(method: str, streams: int | None = None, max_group_size: int = 3, max_groups: int = 8,
                   split: bool = True, max_block_size: int = DEFAULT_MAX_SIZE, time_limit: float = 30.0) -> dict[str, Any]:
    """The options each scheduler takes, from the command line's flags."""
    options = {"sequential": {}, "greedy": {"max_streams": streams or 0}, "lios": {"streams": streams or 8},
               "nimble": {"streams": streams or 0},
               "ios": {"max_group_size": max_group_size, "max_groups": max_groups, "split": split,
                       "max_block_size": max_block_size},
               "exact": {"streams": streams or 8, "time_limit": time_limit}}
    if method not in options:
        raise OpschedError(f"unknown method {method!r}; choose from {', '.join(options)}")
    return dict(options[method])


def search(graph: Graph, cost: CostModel, method: str, **options: Any) -> Schedule:
    """Schedule ``graph`` with ``method``. With a measured cost model, a staged schedule is refined: the
    winner is run whole and its stages measured in place, then the search runs again with those figures,
    until it returns the schedule it just measured (at most ``MAX_REFINEMENTS`` rounds). Re-measuring the
    winner as a whole each round keeps the search from settling on stages whose one measurement happened
    to come out low on a noisy machine; when it converges, the predicted latency is that of a real run."""
    from opsched.cost.measure import MeasuredCost, stages_of

    schedule = make_schedule(method, graph, cost, **options)
    if not isinstance(cost, MeasuredCost) or schedule.stages is None:
        return schedule
    searched = schedule.stats["search_seconds"]
    rounds = 0
    converged = False
    while rounds < MAX_REFINEMENTS and not converged:
        stages = stages_of(schedule, graph)
        cost.measure_schedule(stages, refresh=True, threads=[st.threads for st in schedule.stages])
        rounds += 1
        schedule = make_schedule(method, graph, cost, **options)
        searched += schedule.stats["search_seconds"]
        converged = stages_of(schedule, graph) == stages
    schedule.stats["search_seconds"] = searched
    schedule.stats["refinements"] = rounds
    schedule.stats["converged"] = converged
    return schedule


def eager_runners(model: Any, inputs: Sequence[Any], cores: int,
                  sync: Callable[[], Any] = lambda: None) -> dict[str, Callable[[], Any]]:
    """The model's own forward in eager mode with 1 and with ``cores`` intra-op threads; ``sync`` waits
    for the device (``torch.cuda.synchronize`` on a GPU)."""
    import torch

    def at(threads: int) -> Callable[[], Any]:
        def run() -> Any:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out = model(*inputs)
            sync()
            return out
        return run

    return {f"eager@{t}": at(t) for t in sorted({1, cores})}


def module_runner(module: Callable[..., Any], inputs: Sequence[Any], cores: int,
                  sync: Callable[[], Any] = lambda: None) -> Callable[[], Any]:
    """A runner of an opsched module (which applies its own per-stream threads) from a caller holding
    ``cores`` threads, as the timing loops use it beside eager's runners."""
    import torch

    def run() -> Any:
        torch.set_num_threads(cores)
        out = module(*inputs)
        sync()
        return out

    return run


def torch_compile_runners(model: Any, inputs: Sequence[Any], cores: int,
                          sync: Callable[[], Any] = lambda: None) -> dict[str, Callable[[], Any]]:
    """torch.compile of the whole model, run in inference mode like eager, compiled once per thread count
    (1 and ``cores``): inductor bakes the thread count into its kernels."""
    import torch

    runners = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        torch._dynamo.reset()
        compiled = torch.compile(model)
        with torch.inference_mode():
            compiled(*inputs)

        def run(compiled=compiled, threads=threads) -> Any:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                out = compiled(*inputs)
            sync()
            return out

        runners[f"torch_compile@{threads}"] = run
    torch.set_num_threads(cores)
    return runners


def measure(runners: dict[str, Callable[[], Any]], repeats: int = 15,
            progress: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median milliseconds of each runner, interleaved (see :mod:`opsched.timing`)."""
    from opsched.timing import interleaved_medians

    names = list(runners)
    medians = interleaved_medians([runners[n] for n in names], repeats, warmup=2, after_each=progress)
    return dict(zip(names, medians))


def best_of(measured: dict[str, float], prefix: str) -> tuple[float | None, int | None]:
    """The fastest ``prefix@threads`` figure and its thread count."""
    found = [(ms, int(name.split("@")[1])) for name, ms in measured.items() if name.startswith(prefix + "@")]
    if not found:
        return None, None
    return min(found)
