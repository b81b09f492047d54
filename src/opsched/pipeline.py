"""The one runner: every command and benchmark goes from model to measured, verified result through
these functions, over the pipeline's stages:
capture -> Graph -> cost model -> scheduler -> Schedule -> compile -> run, verify and measure.

- :func:`cost_model`: the cost model a ``--cost`` names (measured here, or a simulated GPU) and the operator
  the units run with (``--kernels``);
- :func:`search`: one scheduler, refined by measurement where the costs are measured;
- :func:`evaluate`: candidates (opsched's modules and the peers a user would run instead, see
  :mod:`opsched.peers`) verified against the reference outputs, the ones that fail dropped with the reason,
  the rest timed interleaved, unsteady timings re-measured, and the fastest verified one chosen;
- :func:`run_job`: all of it for one model: cost, search every method, compile, evaluate with the peers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opsched.cost.base import CostModel
from opsched.errors import OpschedError
from opsched.graph.blocks import DEFAULT_MAX_SIZE
from opsched.graph.ir import Graph
from opsched.schedule import Schedule
from opsched.schedulers import make_schedule

MAX_REFINEMENTS = 8


def method_options(method: str, streams: int | None = None, max_group_size: int = 3, max_groups: int = 8,
                   split: bool = True, max_block_size: int = DEFAULT_MAX_SIZE, time_limit: float = 30.0,
                   default_streams: int = 8) -> dict[str, Any]:
    """The options each scheduler takes, from the command line's flags. ``default_streams`` is the number of
    streams LIOS and exact get when ``streams`` is not given: 8 for a GPU (LIOS's setting), the core count for
    a CPU, where more streams than cores only take turns."""
    options = {"sequential": {}, "greedy": {"max_streams": streams or 0},
               "lios": {"streams": streams or default_streams}, "nimble": {"streams": streams or 0},
               "ios": {"max_group_size": max_group_size, "max_groups": max_groups, "split": split,
                       "max_block_size": max_block_size},
               "exact": {"streams": streams or default_streams, "time_limit": time_limit},
               "hivemind": {"streams": streams or 0}}
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
    if not isinstance(cost, MeasuredCost):
        return schedule
    if schedule.stages is None:
        return _measured_stream_schedule(schedule, graph, cost)
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


def _measured_stream_schedule(schedule: Schedule, graph: Graph, cost: Any) -> Schedule:
    """A stream schedule's prediction replaced by its run measured in place (its timeline, scaled to it):
    built from units timed alone, it would promise what streams sharing the cores cannot deliver (LIOS on
    Inception V3 was predicted at 110 ms and measured at 164 ms), and beside the staged schedules, whose
    stages are measured, it would not be comparable."""
    from opsched.runtime.program import compile_program
    from opsched.schedule import OpTiming

    measured = cost.measure_program(compile_program(schedule, graph, cost.cores))
    end = max((o.finish for o in schedule.ops), default=0.0)
    scale = measured / end if end > 0 else 1.0
    schedule.stats["predicted_from_units"] = schedule.predicted_latency
    schedule.stats["refinements"] = 1
    schedule.ops = [OpTiming(o.name, o.stream, o.start * scale, o.finish * scale) for o in schedule.ops]
    schedule.predicted_latency = measured
    return schedule


def with_regions(schedule: Schedule, graph: Graph, cost: CostModel) -> Schedule:
    """A staged schedule run with compiled regions: each run of its one-group stages joined into one stage and,
    where the cost model prices regions, predicted as the region it runs as (the lower bounds with it)."""
    from opsched.cost.measure import stages_of
    from opsched.schedule import from_stages, joined_runs
    from opsched.schedulers.bounds import lower_bounds

    # (a cost model that prices no regions prices each joined run as its units, one after another)
    plan = from_stages(graph, cost, schedule.method, joined_runs(stages_of(schedule, graph)),
                       stats=dict(schedule.stats), options={**schedule.options, "regions": True})
    plan.device, plan.batch, plan.bounds = schedule.device, schedule.batch, lower_bounds(graph, cost)
    return plan


def cost_model(graph: Graph, inputs: Sequence[Any], spec: str = "measured", *, device: str = "cpu",
               kernels: str = "eager", cores: int | None = None, cache: bool = True,
               progress: Callable[[str, int], Any] | None = None) -> tuple[CostModel, Any]:
    """The cost model ``spec`` names (``measured`` on ``device``, or ``sim:NAME``) and the operator the units
    run with (None for a simulated device, where nothing runs)."""
    if spec.startswith("sim:"):
        from opsched.cost.simulate import SimulatedGPU

        return SimulatedGPU(graph, spec), None
    if spec != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {spec!r}")
    from opsched.cost.measure import MeasuredCost
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import operator_for

    values = all_values(graph, inputs)
    operator = operator_for(kernels, values.__getitem__)
    cost = MeasuredCost(graph, inputs, cores=cores, device=device, kernels=kernels, operator=operator,
                        cache=None if cache else False, progress=progress, values=values)
    return cost, operator


@dataclass
class Candidate:
    """One configuration to verify and time: ``run()`` calls it once on the job's inputs and returns its
    outputs (after waiting for the device). ``kind`` is ``schedule`` (an opsched plan) or ``peer`` (what the
    user would run instead); a peer timed at several thread counts is one candidate per count, under one
    ``name``, and the best count is kept. ``expected_ms`` is a prediction: a median far above it is
    re-measured. ``source`` is the code a compiler generated for it, where one did. ``prepare()`` and
    ``settle()``, when given, are called before and after each call, untimed: what the configuration needs
    ready and must not leave behind, because it would slow the others (the ``threads`` peer's pool, whose
    threads' OpenMP pools slow every parallel region in the process while they live)."""

    name: str
    run: Callable[[], Any]
    kind: str = "schedule"
    threads: int | None = None
    expected_ms: float | None = None
    source: str = ""
    prepare: Callable[[], Any] | None = None
    settle: Callable[[], Any] | None = None

    @property
    def label(self) -> str:
        return self.name if self.threads is None else f"{self.name}@{self.threads}"


@dataclass
class Evaluation:
    """What :func:`evaluate` found: per candidate name the median milliseconds at its best thread count and
    that count, the largest output error, the candidates dropped (name -> why), the fastest verified
    name (``chosen``) and warnings (unsteady timings, dropped candidates)."""

    measured_ms: dict[str, float] = field(default_factory=dict)
    threads: dict[str, int | None] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    chosen: str | None = None
    warnings: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)

    def fastest(self, kind: str) -> str | None:
        """The fastest verified candidate of ``kind`` (``schedule`` or ``peer``)."""
        names = [n for n in self.measured_ms if self.kinds[n] == kind]
        return min(names, key=self.measured_ms.__getitem__) if names else None


UNSTEADY_SPREAD = 2.0     # a median more than this times the fastest sample is re-measured
UNEXPECTED_FACTOR = 3.0   # a median more than this times the prediction is re-measured
MAX_RETIMINGS = 2


def evaluate(candidates: Sequence[Candidate], reference: Any, tolerance: float = 1e-3, repeats: int = 15,
             progress: Callable[[], Any] | None = None) -> Evaluation:
    """Verify every candidate against ``reference`` (the outputs the model itself gives, any structure of
    tensors), drop those that raise or differ by more than ``tolerance`` (saying why), time the rest
    interleaved (medians of ``repeats`` rounds) and choose the fastest.

    Before timing, glibc's allocator thresholds are fixed for the process (:func:`opsched.timing.steady_allocator`),
    so that no configuration pays page faults for what another allocated before it.

    A timing that cannot be trusted is measured again, every candidate with it so that they stay comparable:
    one whose median is more than twice its own fastest sample (something else held the cores for most of
    the run), or more than three times its prediction. If it stays so, the result says the machine was too
    busy for that figure instead of reporting it as a finding.

    >>> import torch
    >>> x = torch.ones(3)
    >>> ev = evaluate([Candidate("double", lambda: x * 2), Candidate("wrong", lambda: x * 3, "peer")],
    ...               reference=x * 2, repeats=3)
    >>> ev.chosen, sorted(ev.measured_ms), ev.dropped["wrong"]
    ('double', ['double'], 'outputs differ from the reference by up to 1 (tolerance 0.001)')
    """
    from opsched.runtime.module import output_error
    from opsched.timing import interleaved_samples, steady_allocator, unsteady

    steady_allocator()
    result = Evaluation()
    verified = []
    for c in candidates:
        try:
            if c.prepare is not None:
                c.prepare()
            error, _ = output_error(c.run(), reference)
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported and left out, never fatal
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result.dropped.setdefault(c.name, f"failed: {type(e).__name__}: {first}")
            continue
        finally:
            if c.settle is not None:  # dropped or not, what its call left behind must not slow the others
                c.settle()
        if not error <= tolerance:
            result.dropped.setdefault(c.name, f"outputs differ from the reference by up to {error:.3g} "
                                              f"(tolerance {tolerance:g})")
            continue
        verified.append(c)
        result.errors[c.name] = max(error, result.errors.get(c.name, 0.0))
    for name, why in result.dropped.items():
        if name not in result.errors:
            result.warnings.append(f"{name} dropped: {why}")
    if not verified:
        return result
    around = [(c.prepare, c.settle) for c in verified]
    samples = interleaved_samples([c.run for c in verified], repeats, warmup=2, after_each=progress, around=around)
    for _ in range(MAX_RETIMINGS):
        if not _suspect(verified, samples):
            break
        samples = interleaved_samples([c.run for c in verified], repeats, warmup=1, after_each=progress,
                                      around=around)
    for c, s in zip(verified, samples):
        if unsteady(s, UNSTEADY_SPREAD):
            result.warnings.append(f"{c.label}: timings stayed unsteady over {1 + MAX_RETIMINGS} measurements "
                                   "(the machine is busy); its figure is not reliable")
        elif c.expected_ms and statistics.median(s) > UNEXPECTED_FACTOR * c.expected_ms:
            result.warnings.append(f"{c.label}: measured {statistics.median(s) / c.expected_ms:.1f}x its "
                                   "prediction in every measurement")
    for c, s in zip(verified, samples):
        ms = statistics.median(s)
        if c.name not in result.measured_ms or ms < result.measured_ms[c.name]:
            result.measured_ms[c.name] = ms
            result.threads[c.name] = c.threads
            result.kinds[c.name] = c.kind
    result.chosen = min(result.measured_ms, key=result.measured_ms.__getitem__)
    return result


def _suspect(candidates: Sequence[Candidate], samples: Sequence[Sequence[float]]) -> bool:
    from opsched.timing import unsteady

    return any(unsteady(s, UNSTEADY_SPREAD) or (c.expected_ms and statistics.median(s) >
                                                UNEXPECTED_FACTOR * c.expected_ms)
               for c, s in zip(candidates, samples))


def module_runner(module: Callable[..., Any], inputs: Sequence[Any], cores: int,
                  sync: Callable[[], Any] = lambda: None) -> Callable[[], Any]:
    """A runner of an opsched module (which applies its own per-stream threads) from a caller holding
    ``cores`` threads, as the timing loops use it beside the peers."""
    import torch

    def run() -> Any:
        torch.set_num_threads(cores)
        out = module(*inputs)
        sync()
        return out

    return run


def peer_candidates(model: Any, inputs: Sequence[Any], cores: int, peers: Sequence[str] = ("eager",),
                    sync: Callable[[], Any] = lambda: None,
                    say: Callable[[str], Any] = lambda text: None) -> tuple[list[Candidate], list[str]]:
    """The candidates of the peers named (see :mod:`opsched.peers`), and a note for each peer that cannot run
    here."""
    from opsched import peers as peer_runners

    unknown = [p for p in peers if p not in peer_runners.PEERS]
    if unknown:
        raise OpschedError(f"unknown peer {unknown[0]!r}; choose from {', '.join(peer_runners.PEERS)}")
    candidates = peer_runners.eager(model, inputs, cores, sync) if "eager" in peers else []
    if "sequential_models" in peers:
        candidates += peer_runners.eager(model, inputs, cores, sync, name="sequential_models")
    if "threads" in peers:
        candidates += peer_runners.threads(model, inputs, cores, sync)
    notes = []
    if "vmap" in peers:
        found = peer_runners.vmap(model, inputs, cores, sync)
        candidates += found
        if not found:
            notes.append("vmap left out: the models differ in architecture or do not read one input")
    if "torch_compile" in peers:
        say("torch.compile of the whole model (freezing on), compiled for 1 and all threads ...")
        try:
            candidates += peer_runners.torch_compile(model, inputs, cores, sync)
        except Exception as e:  # noqa: BLE001 - a peer that cannot compile is reported, not fatal
            notes.append(f"torch_compile left out: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
    if "onnxruntime" in peers:
        say("ONNX Runtime sessions for 1 and all threads ...")
        found, note = peer_runners.onnxruntime(model, inputs, cores)
        candidates += found
        if note:
            notes.append(f"onnxruntime left out: {note}")
    return candidates, notes


def schedule_candidates(graph: Graph, schedules: dict[str, Schedule], operator: Any, inputs: Sequence[Any],
                        cores: int, device: str = "cpu", sync: Callable[[], Any] = lambda: None,
                        cuda_graph: bool = False) -> tuple[list[Candidate], dict[str, Any]]:
    """A candidate per schedule (its compiled module run on ``inputs``, replayed as one CUDA graph with
    ``cuda_graph``) and the modules by name. A schedule whose module cannot be built becomes a candidate
    that raises, so it is dropped with the reason."""
    from opsched.runtime.kernels import unit_operator
    from opsched.runtime.module import OptimizedModule

    candidates, modules = [], {}
    for name, schedule in schedules.items():
        try:
            modules[name] = OptimizedModule(graph, schedule, cores, operator or unit_operator, device=device,
                                            cuda_graph=cuda_graph)
        except Exception as e:  # noqa: BLE001 - reported by evaluate, like a schedule that fails to run
            candidates.append(Candidate(name, _raising(e)))
            continue
        expected = schedule.predicted_latency if schedule.cost == "measured" else None
        candidates.append(Candidate(name, module_runner(modules[name], inputs, cores, sync), "schedule",
                                    expected_ms=expected))
    return candidates, modules


def _raising(error: BaseException) -> Callable[[], Any]:
    def run() -> Any:
        raise error
    return run


def reference_outputs(model: Any, inputs: Sequence[Any], cores: int) -> Any:
    """The model's own outputs on ``inputs``, in inference mode, as every candidate is verified against."""
    import torch

    torch.set_num_threads(cores)
    with torch.inference_mode():
        return model(*inputs)


@dataclass
class Job:
    """One model to optimise: its module (in eval mode, on ``device``) and example inputs, its captured
    graph, and the schedules to make: ``methods`` maps a name to (scheduler, options)."""

    model: Any
    inputs: tuple
    graph: Graph
    methods: dict[str, tuple[str, dict[str, Any]]]
    cost: str = "measured"
    device: str = "cpu"
    kernels: str = "eager"
    cores: int | None = None
    peers: Sequence[str] = ("eager",)
    tolerance: float = 1e-3
    repeats: int = 15
    cache: bool = True
    cuda_graph: bool = False
    say: Callable[[str], Any] = lambda text: None
    profile_progress: Callable[[str, int], Any] | None = None


@dataclass
class Outcome:
    """What :func:`run_job` made: the cost model, a schedule per method, and on a real device the compiled
    modules, the evaluation (with the peers) and notes on peers left out."""

    cost: CostModel
    schedules: dict[str, Schedule]
    operator: Any = None
    modules: dict[str, Any] = field(default_factory=dict)
    evaluation: Evaluation | None = None
    notes: list[str] = field(default_factory=list)

    def plan(self) -> Schedule | None:
        """The schedule to hand the user: the fastest verified one, recording what was chosen overall
        (possibly a peer) and every measured figure; before measuring (simulated costs), None."""
        ev = self.evaluation
        if ev is None:
            return None
        best = ev.fastest("schedule")
        if best is None:
            return None
        plan = self.schedules[best]
        plan.options["measured_as"] = best
        plan.options["chosen"] = {"name": ev.chosen, "kind": ev.kinds[ev.chosen], "threads": ev.threads[ev.chosen]}
        plan.options["measured_ms"] = {n: round(ms, 4) for n, ms in ev.measured_ms.items()}
        return plan


def run_job(job: Job) -> Outcome:
    """Cost the graph, make every schedule, and on a real device compile, verify and time them with the
    peers, interleaved; see :class:`Outcome`."""
    import torch
    import torch.utils._pytree as pytree

    cores = job.cores or torch.get_num_threads()
    flat = pytree.tree_leaves(tuple(job.inputs))
    simulated = job.cost.startswith("sim:")
    cost, operator = cost_model(job.graph, flat, job.cost, device=job.device, kernels=job.kernels, cores=cores,
                                cache=job.cache, progress=job.profile_progress)
    schedules = {}
    for name, (method, options) in job.methods.items():
        job.say(f"scheduling with {name} ...")
        schedule = search(job.graph, cost, method, **options)
        schedule.device = job.cost if simulated else job.device
        schedule.options["kernels"] = job.kernels
        if job.cuda_graph:
            schedule.options["cuda_graph"] = True
        schedule.batch = int(flat[0].shape[0]) if flat and getattr(flat[0], "dim", lambda: 0)() else None
        schedules[name] = schedule
    outcome = Outcome(cost, schedules, operator)
    if simulated:
        return outcome
    if job.kernels != "eager":
        # Compiled regions beside compiled units, for every staged schedule that does not run them yet (IOS
        # chose its own, block by block): which pays is measured.
        for name, schedule in list(schedules.items()):
            if schedule.stages is not None and not schedule.options.get("regions"):
                schedules[f"{name}+regions"] = with_regions(schedule, job.graph, cost)
    sync = torch.cuda.synchronize if job.device == "cuda" else (lambda: None)
    job.say("compiling the schedules ...")
    candidates, outcome.modules = schedule_candidates(job.graph, schedules, operator, job.inputs, cores, job.device,
                                                      sync, job.cuda_graph)
    peers, outcome.notes = peer_candidates(job.model, job.inputs, cores, job.peers, sync, job.say)
    job.say(f"verifying and measuring {len(candidates) + len(peers)} configurations, interleaved ...")
    outcome.evaluation = evaluate(candidates + peers, reference_outputs(job.model, job.inputs, cores),
                                  job.tolerance, job.repeats)
    torch.set_num_threads(cores)
    return outcome
