"""The one runner: every job (optimize, multi, map, run) and benchmark goes from graph to measured,
verified result through these functions, over the pipeline's stages:
capture -> Graph -> cost model -> scheduler -> Schedule -> compile -> evaluate (verify, time, choose).

- :func:`cost_model`: the cost model a ``--cost`` names (measured here, or a simulated GPU) and the kernels
  the units run with (``--kernels``);
- :func:`search`: one scheduler, refined by measurement where the costs are measured;
- :func:`schedule_candidates` and :func:`peer_candidates`: what :func:`opsched.evaluation.evaluate` verifies
  and times: each plan compiled, and the peers a user would run instead (see :mod:`opsched.peers`);
- :func:`make_schedules`: the cost model and every method's schedule for one graph;
- :func:`run_workload`: all of it for one graph (and others of the same model): cost, search every method,
  compile, evaluate with the peers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opsched.cost.base import CostModel
from opsched.cost.devices import is_simulated
from opsched.errors import OpschedError
from opsched.evaluation import Candidate, Evaluation, evaluate, module_runner, reference_outputs
from opsched.graph.blocks import DEFAULT_MAX_SIZE
from opsched.graph.ir import Graph
from opsched.schedule import Measurement, Schedule
from opsched.schedulers import make_schedule

MAX_REFINEMENTS = 8


def default_streams(simulated: bool, device: str, cores: int) -> int:
    """The streams LIOS and exact get unless told: 8 on a GPU, real or simulated (LIOS's setting), the core
    count on a CPU, where more streams than cores only take turns."""
    return 8 if simulated or device == "cuda" else cores


def method_options(method: str, streams: int | None = None, max_group_size: int = 3, max_groups: int = 8,
                   split: bool = True, max_block_size: int = DEFAULT_MAX_SIZE, time_limit: float = 30.0,
                   default_streams: int = 8) -> dict[str, Any]:
    """The options each scheduler takes, from the command line's flags. ``default_streams`` is the number of
    streams LIOS and exact get when ``streams`` is not given (see :func:`default_streams`)."""
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
        return _measured_stream_schedule(schedule, graph, cost, method, options)
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


# stream schedulers that choose among their schedules by predicted latency (hivemind: how many streams), and so
# may choose another once streams were measured; the others would return the schedule they returned
CHOOSE_BY_PREDICTION = ("hivemind",)


def _measured_stream_schedule(schedule: Schedule, graph: Graph, cost: Any, method: str,
                              options: dict[str, Any]) -> Schedule:
    """A stream schedule's prediction replaced by its run measured in place (its timeline, scaled to it):
    built from units timed alone, it would promise what streams sharing the cores cannot deliver (LIOS on
    Inception V3 was predicted at 110 ms and measured at 164 ms), and beside the staged schedules, whose
    stages are measured, it would not be comparable. A scheduler that chooses by predicted latency searches
    again with what the run taught the cost model (:meth:`~opsched.cost.measure.MeasuredCost.measure_streams`)
    until it returns a schedule already measured; the fastest measured is kept."""
    from opsched.runtime.program import compile_program
    from opsched.schedule import OpTiming

    runs: dict[tuple[tuple[int, ...], ...], Schedule] = {}
    searched = schedule.stats.get("search_seconds", 0.0)
    while True:
        streams = tuple(tuple(graph.index[name] for name in names) for names in schedule.streams() if names)
        if streams in runs:
            break
        measured = cost.measure_streams(streams, compile_program(schedule, graph, cost.cores),
                                        schedule.predicted_latency)
        end = max((o.finish for o in schedule.ops), default=0.0)
        scale = measured / end if end > 0 else 1.0
        schedule.stats["predicted_from_units"] = schedule.predicted_latency
        schedule.ops = [OpTiming(o.name, o.stream, o.start * scale, o.finish * scale) for o in schedule.ops]
        schedule.predicted_latency = measured
        runs[streams] = schedule
        # searched again only where the run taught the cost model (see MeasuredCost.measure_streams)
        if method not in CHOOSE_BY_PREDICTION or streams not in cost.measured_streams or len(runs) >= MAX_REFINEMENTS:
            break
        schedule = make_schedule(method, graph, cost, **options)
        searched += schedule.stats.get("search_seconds", 0.0)
    fastest = min(runs.values(), key=lambda s: s.predicted_latency)
    fastest.stats["refinements"] = len(runs)
    if "search_seconds" in fastest.stats:
        fastest.stats["search_seconds"] = searched
    return fastest


def with_regions(schedule: Schedule, graph: Graph, cost: CostModel) -> Schedule:
    """A staged schedule run with compiled regions: each run of its one-group stages joined into one stage and,
    where the cost model prices regions, predicted as the region it runs as (the lower bounds with it)."""
    from opsched.cost.measure import stages_of
    from opsched.schedule import from_stages, joined_runs
    from opsched.schedulers.bounds import lower_bounds

    # (a cost model that prices no regions prices each joined run as its units, one after another)
    plan = from_stages(graph, cost, schedule.method, joined_runs(stages_of(schedule, graph)),
                       stats=dict(schedule.stats), options=dict(schedule.options),
                       run=dataclasses.replace(schedule.run, regions=True))
    plan.device, plan.batch, plan.bounds = schedule.device, schedule.batch, lower_bounds(graph, cost)
    return plan


def cost_model(graph: Graph, inputs: Sequence[Any], spec: str = "measured", *, device: str = "cpu",
               kernels: Any = "eager", cores: int | None = None, cache: bool = True,
               progress: Callable[[str, int], Any] | None = None,
               replayed: bool = False) -> tuple[CostModel, Any]:
    """The cost model ``spec`` names (``measured`` on ``device``, or ``sim:NAME``) and the kernels the units
    are measured with and will run on (a :class:`~opsched.runtime.kernels.ChosenKernels`; None for a simulated
    device, where nothing runs). ``kernels``: what ``--kernels`` asks (the choice is then
    :func:`~opsched.runtime.choice.choose_kernels`'s for ``device``; for ``auto``, measured unit by unit:
    :mod:`opsched.runtime.auto`), or a choice made already (a mapping's).
    ``replayed``: on a GPU, for plans replayed as CUDA graphs, costs measured without launches (see
    :class:`~opsched.runtime.profile.InPlaceRuns`): measured with them, at batch 1 every stage pays its
    launches and the events between streams, concurrency rarely pays, and IOS found few concurrent stages."""
    if is_simulated(spec):
        from opsched.cost.simulate import SimulatedGPU

        return SimulatedGPU(graph, spec), None
    if spec != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {spec!r}")
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import ChosenKernels, kernels_for
    from opsched.runtime.profile import measured_cost

    values = all_values(graph, inputs)
    if kernels == "auto" and not replayed:
        from opsched.runtime.auto import auto_cost

        return auto_cost(graph, inputs, values, device, cores=cores, cache=None if cache else False,
                         progress=progress)
    if not isinstance(kernels, ChosenKernels):
        kernels = kernels_for(graph, kernels, device, values.__getitem__, keep_exports=cache)
    cost = measured_cost(graph, inputs, kernels, device, progress=progress, values=values, cores=cores,
                         cache=None if cache else False, replayed=replayed)
    return cost, kernels


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
    if "cuda_graph" in peers:
        say("the whole model as one CUDA graph ...")
        try:
            candidates += peer_runners.cuda_graph_peer(model, inputs, sync)
        except Exception as e:  # noqa: BLE001 - a model that cannot be captured (host syncs) is reported
            notes.append(f"cuda_graph left out: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
    for name in ("onnxruntime", "onnxruntime_models", "onnxruntime_concurrent"):
        if name in peers:
            say(f"ONNX Runtime sessions ({name}) ...")
            try:
                found, note = getattr(peer_runners, name)(model, inputs, cores)
            except Exception as e:  # noqa: BLE001 - a peer ONNX Runtime cannot run (a bfloat16 graph) is reported
                found, note = [], f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            candidates += found
            if note:
                notes.append(f"{name} left out: {note}")
    return candidates, notes


def schedule_candidates(graph: Graph, schedules: dict[str, Schedule], kernels: Any, inputs: Sequence[Any],
                        cores: int, device: str = "cpu", sync: Callable[[], Any] = lambda: None,
                        cuda_graph: bool = False, guard: Any = None) -> tuple[list[Candidate], dict[str, Any]]:
    """A candidate per schedule (its compiled module run on ``inputs``, replayed as one CUDA graph with
    ``cuda_graph``, behind ``guard``: see :class:`~opsched.runtime.guards.Guard`) and the modules by name, every
    unit on the kernel ``kernels`` chose for it (None: the kernels each plan records). A schedule whose module
    cannot be built becomes a candidate that raises, so it is dropped with the reason."""
    from opsched.runtime.module import OptimizedModule

    candidates, modules = [], {}
    for name, schedule in schedules.items():
        try:
            modules[name] = OptimizedModule(graph, schedule, cores, kernels, device=device,
                                            cuda_graph=cuda_graph, guard=guard)
        except Exception as e:  # noqa: BLE001 - reported by evaluate, like a schedule that fails to run
            candidates.append(Candidate(name, _raising(e)))
            continue
        expected = schedule.predicted_latency if schedule.cost == "measured" and schedule.costed else None
        candidates.append(Candidate(name, module_runner(modules[name], inputs, cores, sync), "schedule",
                                    expected_ms=expected, module=modules[name], program=modules[name].program_key))
    return candidates, modules


def _raising(error: BaseException) -> Callable[[], Any]:
    def run() -> Any:
        raise error
    return run


@dataclass
class Workload:
    """One model to optimise: its module (in eval mode, on ``device``) and example inputs, its captured
    graph, and the schedules to make: ``methods`` maps a name to (scheduler, options). ``measure``: on a real
    device, compile, verify and time the schedules with the peers (False: cost and schedule only). ``costed``:
    the graph's cost model and kernels as :func:`cost_model` makes them for these settings, where made already
    (``--kernels auto`` times its choice again on every call)."""

    model: Any
    inputs: tuple
    graph: Graph
    methods: dict[str, tuple[str, dict[str, Any]]]
    cost: str = "measured"
    device: str = "cpu"
    kernels: str = "eager"
    cores: int | None = None
    peers: Sequence[str] = ("eager",)
    tolerance: float | None = None
    repeats: int = 15
    cache: bool = True
    cuda_graph: bool = False
    say: Callable[[str], Any] = lambda text: None
    profile_progress: Callable[[str, int], Any] | None = None
    measure: bool = True
    costed: tuple[CostModel, Any] | None = None  # the graph's cost model and kernels, where made already
    # with --kernels auto on the CPU, the whole graph on Inductor beside the plans where auto offers it (one
    # model's job: a model batch chooses among its own graphs, see opsched.multi.optimize)
    whole_on_inductor: bool = False


@dataclass
class Outcome:
    """What a job made: the cost model, a schedule per method, and on a real device the compiled modules, the
    evaluation (with the peers) and notes on peers left out. What ``opsched.optimize``, ``opsched.optimize_batch`` and
    ``opsched.map`` return, as their commands report it: :meth:`plan`, :attr:`module`, :attr:`measured_ms`,
    :attr:`chosen`."""

    cost: CostModel | None
    schedules: dict[str, Schedule]
    kernels: Any = None  # the ChosenKernels every schedule was measured with and runs on (None: simulated)
    modules: dict[str, Any] = field(default_factory=dict)
    evaluation: Evaluation | None = None
    notes: list[str] = field(default_factory=list)
    graph: Graph | None = None
    requested: str | None = None  # the method asked for: the plan when nothing was measured
    guarded: Any = None  # opsched.optimize's module: a plan per call signature (opsched.runtime.guarded)
    # other graphs of the same model measured in the same run, by the suffix of their schedules' names (see
    # run_workload); each holds its own schedules and modules and shares this evaluation
    also: dict[str, Outcome] = field(default_factory=dict)

    def same_graph(self) -> list[Outcome]:
        """This outcome and those in ``also`` of the same graph (other kernels: the whole graph on Inductor), whose
        schedules count as this one's (a model batch's graph without its batched units, in ``also`` too, does
        not: it shares the evaluation only)."""
        return [self] + [other for other in self.also.values() if other.graph is self.graph]

    @property
    def every_schedule(self) -> dict[str, Schedule]:
        """The schedules of :meth:`same_graph`'s outcomes, by name."""
        return {name: schedule for outcome in self.same_graph() for name, schedule in outcome.schedules.items()}

    @property
    def measured_ms(self) -> dict[str, float]:
        """Every verified configuration's median milliseconds (empty before measuring)."""
        return dict(self.evaluation.measured_ms) if self.evaluation else {}

    @property
    def chosen(self) -> str | None:
        """The configuration chosen: the simplest verified one that no other beats above the run's
        noise (see :class:`~opsched.evaluation.Evaluation`), a schedule's name or a peer's."""
        return self.evaluation.chosen if self.evaluation else None

    @property
    def module(self) -> Any:
        """The chosen configuration as a callable taking the model's inputs (the compiled plan, the model
        itself, or its torch.compile or ONNX Runtime form; None for a peer with no single callable, such as
        ``threads``). Run it at ``evaluation.threads[chosen]`` intra-op threads, as it was timed. From
        ``opsched.optimize``: the :class:`~opsched.runtime.guarded.GuardedModule` that serves every call."""
        if self.guarded is not None:
            return self.guarded
        return self.evaluation.modules.get(self.chosen) if self.evaluation else None

    def save(self, path: Any) -> None:
        """Write the plan file: with ``opsched.optimize``'s module, every call signature it serves (what
        ``opsched.load`` reads; see :mod:`opsched.deploy`), else :meth:`plan`."""
        if self.guarded is not None:
            from opsched.deploy import save

            save(self.guarded, path)
            return
        plan = self.plan()
        if plan is None:
            raise OpschedError("no verified plan to save")
        plan.save(path)

    def plan(self, name: str | None = None) -> Schedule | None:
        """The schedule to hand the user, recording what was chosen overall (possibly a peer) and every measured
        figure: ``name``'s, or by default the simplest verified schedule of this outcome's that none of its other
        schedules beats above the run's noise (:mod:`opsched.noise`); the schedules of an outcome in ``also``
        count as this one's where it has the same graph (other kernels: the whole graph on Inductor), not where
        it has another (a model batch's graph without its batched units: it shares the evaluation only). When
        nothing was measured (simulated costs), the requested method's; None when it did not verify."""
        ev = self.evaluation
        if ev is None:
            return self.schedules.get(self.requested) if self.requested else None
        mine = self.same_graph()
        best = name or ev.fastest("schedule", among=self.every_schedule)
        if best is None or best not in ev.measured_ms:
            return None
        holder = next((o for o in mine if best in o.schedules), None)
        if holder is None:
            raise KeyError(f"{best!r} is not a schedule of this outcome's graph")
        # a copy: reading the plan never changes the schedule the job made
        schedule = holder.schedules[best]
        kernels = holder.kernels.choice if holder.kernels is not None else schedule.unit_kernels
        return dataclasses.replace(schedule, unit_kernels=dict(kernels) if kernels else None,
                                   options=dict(schedule.options), measured=Measurement(
            best, {"name": ev.chosen, "kind": ev.kinds[ev.chosen], "threads": ev.threads[ev.chosen]},
            {n: round(ms, 4) for n, ms in ev.measured_ms.items()},
            list(ev.tie),  # beaten by none above the run's noise; the first was chosen
            round(ev.noise_floor, 4)))


def make_schedules(job: Workload) -> Outcome:
    """Cost the graph and make every schedule, nothing run: with compiled kernels on a real device (to be
    measured), each schedule's compiled regions beside it; see :class:`Outcome`."""
    import torch
    import torch.utils._pytree as pytree

    cores = job.cores or torch.get_num_threads()
    flat = pytree.tree_leaves(tuple(job.inputs))
    simulated = is_simulated(job.cost)
    cost, kernels = job.costed or cost_model(job.graph, flat, job.cost, device=job.device, kernels=job.kernels,
                                             cores=cores, cache=job.cache, progress=job.profile_progress,
                                             replayed=job.cuda_graph)
    schedules = {}
    for name, (method, options) in job.methods.items():
        job.say(f"scheduling with {name} ...")
        schedule = search(job.graph, cost, method, **options)
        schedule.device = job.cost if simulated else job.device
        schedule.run = dataclasses.replace(schedule.run, kernels=job.kernels, cuda_graph=job.cuda_graph)
        schedule.batch = int(flat[0].shape[0]) if flat and getattr(flat[0], "dim", lambda: 0)() else None
        if getattr(cost, "kernel_choice", None):  # --kernels auto: how the units' kernels were chosen
            schedule.stats["kernel_choice"] = cost.kernel_choice
        schedules[name] = schedule
    if not simulated and job.measure and kernels is not None and kernels.asked != "eager":
        # Compiled regions beside compiled units, for every schedule that does not run them yet (IOS chose its
        # own, block by block): which pays is measured. A stream schedule's regions are its streams' runs of
        # units (four different small networks on ONNX Runtime: a session per network and stream).
        for name, schedule in list(schedules.items()):
            if schedule.run.regions or schedule.devices is not None:
                continue
            schedules[f"{name}+regions"] = (
                with_regions(schedule, job.graph, cost) if schedule.stages is not None
                else dataclasses.replace(schedule, run=dataclasses.replace(schedule.run, regions=True)))
    return Outcome(cost, schedules, kernels, graph=job.graph)


ON_INDUCTOR = "+inductor"  # the whole graph as one Inductor region, beside the plans (whole_graph_on_inductor)


# optimizes of a graph that do not compile it on Inductor after the whole graph there lost its first race beside the
# plans; twice as many after each further loss in a row (see whole_graph_on_inductor)
RETRY_AFTER = 4


def whole_graph_on_inductor(job: Workload, outcome: Outcome) -> Outcome | None:
    """The sequential plan of ``outcome``'s graph (which ``job`` asks for) with every unit on Inductor, run as one
    compiled region (its schedule named ``sequential+regions+inductor``), to be measured beside ``outcome``'s
    plans: where ``--kernels auto`` offers it on the CPU (:func:`~opsched.runtime.auto.inductor_offered`: Inductor
    compiles for seconds per graph, which a choice block by block cannot pay); else None. Why it was offered or not is recorded in
    the cost model's ``kernel_choice`` and the schedules' stats, which ``opsched show`` prints."""
    from opsched.runtime.auto import inductor_offered

    if not job.whole_on_inductor or job.kernels != "auto" or job.device != "cpu" or outcome.kernels is None \
            or "sequential" not in outcome.schedules or len(job.graph) == 0:
        return None
    offered, why = inductor_offered(outcome.cost)
    race = outcome.cost.whole_graph_race("inductor") if offered else None
    if race is not None and race.whole_ms >= race.plan_ms:
        # Compiling takes seconds to a minute a graph: where it ran slower than a plan here before, or did not
        # compile or verify, it is not paid on every optimize (Inception V3: its 7-8 s of a 33 s optimize with
        # every cache warm), yet tried again now and then, fewer as it keeps losing: a loss within the noise, or
        # a failure that passes (a compile killed on a busy machine), is not remembered for good
        lost = (f"the whole graph on Inductor ran {race.whole_ms / race.plan_ms:.2f}x the fastest plan when last "
                "timed beside it here" if race.whole_ms < math.inf else
                "the whole graph on Inductor did not compile or verify when last tried here")
        wait = RETRY_AFTER * 2 ** (max(race.lost, 1) - 1)
        if race.skipped < wait:
            outcome.cost.skip_whole_graph("inductor")
            offered = False
            why = (f"{lost}; not compiled again for {wait - race.skipped} optimizes of this graph, this one "
                   "included (--no-cache tries it now)")
        else:
            why = f"{lost}, {race.lost} time(s) in a row; tried again after {race.skipped} optimizes without it"
    if getattr(outcome.cost, "kernel_choice", None) is None:  # ONNX Runtime not installed: nothing else chosen
        outcome.cost.kernel_choice = {}
        for schedule in outcome.schedules.values():
            schedule.stats["kernel_choice"] = outcome.cost.kernel_choice
    outcome.cost.kernel_choice["inductor_whole_graph"] = {"offered": offered, "why": why}
    if not offered:
        return None
    job.say(f"Inductor offered for the whole graph ({why}) ...")
    sequential = outcome.schedules["sequential"]
    # its prediction stays the units' on the cost model's kernels: Inductor's whole graph is measured, not costed
    schedule = dataclasses.replace(sequential, run=dataclasses.replace(sequential.run, regions=True),
                                   stats={**sequential.stats, "inductor_whole_graph": why},
                                   options=dict(sequential.options))
    return Outcome(outcome.cost, {f"sequential+regions{ON_INDUCTOR}": schedule},
                   outcome.kernels.every_unit_on("inductor"), graph=job.graph)


def run_workload(job: Workload, also: dict[str, Workload] | None = None) -> Outcome:
    """Cost the graph, make every schedule, and on a real device compile, verify and time them with the
    peers, interleaved; see :class:`Outcome`. ``also``: other graphs of the same model (as a model batch's
    graph without its batched units), each under a suffix; their schedules are made the same way and measured
    in the same run, named with the suffix (``hivemind+regions+unbatched``), and their outcomes are in the
    result's ``also``, sharing its evaluation."""
    import torch

    outcome = make_schedules(job)
    if is_simulated(job.cost) or not job.measure:
        return outcome
    for suffix, other in (also or {}).items():
        made = make_schedules(other)
        made.schedules = {f"{name}{suffix}": schedule for name, schedule in made.schedules.items()}
        outcome.also[suffix] = made
    on_inductor = whole_graph_on_inductor(job, outcome)
    if on_inductor is not None:
        outcome.also[ON_INDUCTOR] = on_inductor
    evaluate_plans(outcome, job.graph, job.model, job.inputs, cores=job.cores or torch.get_num_threads(),
                   device=job.device, peers=job.peers, tolerance=job.tolerance, repeats=job.repeats,
                   cuda_graph=job.cuda_graph, say=job.say)
    if on_inductor is not None:  # what offering it cost, and how it ran beside the plans, for the next optimize
        outcome.cost.kernel_choice["inductor_whole_graph"]["compile_seconds"] = round(
            on_inductor.kernels.compile_seconds, 1)
        remember_inductor_race(outcome, on_inductor)
    return outcome


def remember_inductor_race(outcome: Outcome, on_inductor: Outcome) -> None:
    """Keep in the cost cache the whole graph on Inductor's median (infinite where it did not compile or verify)
    and the fastest of ``outcome``'s plans', measured in one interleaved run, which
    :func:`whole_graph_on_inductor` reads on the next optimize of the graph; nothing where no plan was timed."""
    evaluation = outcome.evaluation
    (name,) = on_inductor.schedules
    plans = [evaluation.measured_ms[n] for n in outcome.schedules if n in evaluation.measured_ms]
    if plans and (name in evaluation.measured_ms or name in evaluation.dropped):
        outcome.cost.remember_whole_graph_race("inductor", evaluation.measured_ms.get(name, math.inf), min(plans),
                                               len(evaluation.samples.get(name, ())))


def evaluate_plans(outcome: Outcome, graph: Graph, model: Any, inputs: Sequence[Any], *, cores: int,
                   device: str = "cpu", peers: Sequence[str] = ("eager",), tolerance: float | None = None,
                   repeats: int = 15, cuda_graph: bool = False, extra: Sequence[Candidate] = (),
                   say: Callable[[str], Any] = lambda text: None) -> Outcome:
    """The end of every job: compile ``outcome``'s schedules, verify them and the ``peers`` (and ``extra``
    candidates) against ``model``'s own outputs and time them interleaved; fills in ``outcome.modules``,
    ``notes`` and ``evaluation``. A schedule of any kind runs: one model's, a model batch's (the batch is the
    model) or a mapping's (on its devices)."""
    import torch

    from opsched.runtime.cuda import current_api
    from opsched.runtime.guards import Guard

    sync = current_api().synchronize if device == "cuda" else (lambda: None)
    say("compiling the schedules ...")
    guard = Guard.of(tuple(inputs), model)  # every plan refuses calls it was not made for
    candidates, outcome.modules = schedule_candidates(graph, outcome.schedules, outcome.kernels, inputs, cores,
                                                      device, sync, cuda_graph, guard)
    for other in outcome.also.values():  # after this graph's: where they tie, this graph's plan is kept
        found, other.modules = schedule_candidates(other.graph, other.schedules, other.kernels, inputs, cores,
                                                   device, sync, cuda_graph, guard)
        candidates += found
    found, outcome.notes = peer_candidates(model, inputs, cores, peers, sync, say)
    everything = candidates + list(extra) + found
    say(f"verifying and measuring {len(everything)} configurations, interleaved ...")
    outcome.evaluation = evaluate(everything, reference_outputs(model, inputs, cores), tolerance, repeats)
    for other in outcome.also.values():  # one run: its evaluation and notes (the peers left out) are theirs too
        other.evaluation, other.notes = outcome.evaluation, outcome.notes
    torch.set_num_threads(cores)
    return outcome
