"""The measured cost model (``--cost measured``): latencies timed on the real device, in milliseconds.

Measuring every stage the IOS search considers is what made IOS's search slow (tens of thousands of
stages for Inception V3). This model measures what is cheap and predicts the rest:

- every unit *in place*: the whole graph run in order through the executor, once per intra-op thread count
  a stage can give a unit (all cores alone, ``cores // k`` beside k - 1 other groups), each unit's time
  read from the executor's timeline. A unit timed in a loop on its own finds its weights and inputs in
  cache and comes out faster than it runs inside the model (on GoogLeNet, the sum fell 15% short);
- the cost of joining one more stream (the executor's event hand-off), from a two-stream program of
  empty steps against a one-stream one;
- a stage is *predicted* from those: the longest group at its thread count, no shorter than the stage's
  work spread over the cores, times a contention factor, plus the hand-off per extra group; a merged
  stage is the units' time alone times a merge factor;
- on a GPU (``device="cuda"``) threads do not apply: the units are profiled once, timed with CUDA events, and
  concurrent kernels share the SMs instead of cores. How much of the device a unit fills is measured: the
  unit run as ``SHARING_COPIES`` copies on as many streams at once, in place, against the unit alone; a unit
  that fills a fraction f of the SMs takes about ``max(1, copies * f)`` times as long that way. A concurrent
  stage is predicted as its longest group, no shorter than the device time its units fill (each unit's
  latency times its fraction), times the contention factor, plus the hand-off per extra group; the
  capacity (how many units' worth of work the GPU does at once, which bounds every schedule) is one over
  the smallest fraction;
- on a GPU, for plans replayed as CUDA graphs (``replayed``, see :class:`~opsched.runtime.profile.InPlaceRuns`),
  every timed run is queued behind a hold on the device, so that it shows its device work without its launches,
  as the graph replays it: measured with their launches at batch 1, concurrent stages rarely paid and IOS made
  few of them, though replayed they run without launches (docs/gpu.md has the figures);
- :meth:`MeasuredCost.measure_schedule` runs a whole staged schedule and keeps the latency of each of its
  concurrent and merge stages as measured in place; from then on the measured latency is used, and the contention and merge factors
  become the median ratio of measured to predicted. The pipeline (:func:`opsched.pipeline.search_measured`)
  searches, measures the schedule that wins, and searches again until the winner holds only measured
  stages: only schedules that win cost a measurement.

Timing: a warm-up run, then ``repeats`` runs, interleaved when several programs are measured (so that a
burst of load on a shared machine spreads over all of them instead of skewing one); the median is kept,
which ignores outliers. This model runs nothing itself: it asks an :class:`~opsched.runtime.profile.InPlaceRuns`
(the runtime's, which runs everything through the same executor and kernels as the final program) for the
timelines it needs, and reads them.

Every measurement goes to the sqlite cache (``cache.py``) under this device's fingerprint, so a second
search of the same model re-measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from opsched.cost.cache import LatencyCache
from opsched.events import simulate
from opsched.graph.interpret import all_values
from opsched.graph.ir import Graph, indices

StageKey = tuple[str, tuple[tuple[int, ...], ...]]  # (strategy, groups of unit indices)

CONTENTION_PRIOR = 1.0
MERGE_PRIOR = 0.85  # optimistic, so that searches try merges and measurement settles them
SHARING_COPIES = 4  # copies of a unit run at once on a GPU to see how much of the device it fills
CACHE_DISAGREEMENT = 2.0  # cached unit timings summing to more than this times the graph timed now are redone


class WholeGraphRace(NamedTuple):
    """The whole graph compiled as one region against the fastest plan, when last timed side by side."""

    whole_ms: float  # infinite where it did not compile or verify
    plan_ms: float
    lost: int  # races in a row it ran no faster than the plan (0: it won the last)
    skipped: int  # optimizes since the last race that did not compile it


def cpu_fingerprint(cores: int) -> str:
    """What makes CPU timings comparable: the processor, the cores used, PyTorch and its backends, and how
    eager units run their convolutions (see :mod:`opsched.runtime.packed`)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"cpu|{model}|{os.cpu_count()} logical|{cores} threads|torch {torch.__version__}|"
            f"mkldnn {torch.backends.mkldnn.is_available()}|convolution weights reordered once")


class MeasuredCost:
    """Latencies of ``graph``'s units measured on this CPU with ``cores`` threads (default: PyTorch's
    count), or on the current GPU (timed with CUDA events), the example ``inputs`` feeding the graph. It runs
    nothing itself: ``runs`` (an :class:`~opsched.runtime.profile.InPlaceRuns` of the graph on the CPU or the
    GPU, each unit on the kernel the plan runs it on, a warm-up and ``runs.repeats`` runs each time; a unit's
    kernel is part of its key in the cache) times what it asks for, and it reads the timelines;
    :func:`opsched.runtime.profile.measured_cost` makes both. ``cache=None`` uses the default cache file;
    ``False`` turns caching off. ``values`` (every unit's output on ``inputs``, see
    :func:`opsched.graph.interpret.all_values`) saves computing them again when the caller has them.
    On a GPU ``cores`` does not apply (see the module docstring)."""

    name = "measured"

    def __init__(self, graph: Graph, inputs: Sequence[torch.Tensor], runs: Any, cores: int | None = None,
                 cache: LatencyCache | bool | None = None, values: dict[str, Any] | None = None):
        self.graph = graph
        self.gpu = runs.device == "cuda"
        self.cores = 1 if self.gpu else cores or torch.get_num_threads()
        self.capacity = float(self.cores)
        self.fill: list[float] | None = None  # on a GPU: the fraction of the device each unit fills
        self.runs = runs
        self.kernels = runs.kernels.asked  # the kernels asked for
        self.column = runs.kernels.cache_column  # their column of the cache
        self.repeats = runs.repeats
        self.batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
        self.device = cpu_fingerprint(self.cores) if not self.gpu else runs.device_description()
        # timed under the caller's autocast (every stream's thread runs in it): such timings are another device's
        autocast = [f"{d} {torch.get_autocast_dtype(d)}" for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if autocast:
            self.device += f"|autocast {', '.join(autocast)}"
        self.cache = LatencyCache() if cache is None or cache is True else (cache or None)
        self.values = values if values is not None else all_values(graph, inputs)
        self.signatures = [self._unit_signature(u) for u in range(len(graph))]
        self.thread_options = sorted({max(1, self.cores // k) for k in range(1, self.cores + 1)}, reverse=True)
        self.latency: dict[int, list[float]] = {}
        self.measured_stages: dict[StageKey, float] = {}
        self.regions: dict[tuple[int, ...], float] = {}
        self.region_error: str | None = None
        self.kernel_choice: dict | None = None  # with --kernels auto, how the units' kernels were chosen
        self.predicted_when_measured: dict[StageKey, float] = {}
        self.contention = CONTENTION_PRIOR
        self.merge_factor = MERGE_PRIOR
        # stream schedules run whole (their streams, as unit lists, to milliseconds), and the median ratio of
        # their runs to their predictions from unit latencies, which then scales the others' predictions
        self.measured_streams: dict[tuple[tuple[int, ...], ...], float] = {}
        self.stream_factor = 1.0
        self._stream_ratios: list[float] = []
        self.counts = {"units_measured": 0, "units_cached": 0, "stages_measured": 0, "stages_cached": 0,
                       "regions_measured": 0, "regions_cached": 0}
        self.profile_seconds = 0.0
        started = time.perf_counter()
        self._measure_units()
        # Units that run alone all run with the one thread count the whole graph runs fastest with. Chosen
        # unit by unit (1 thread for 67 of GoogLeNet's 81 units), the plan switched the OpenMP team size
        # from unit to unit and ran 1.33x slower than eager, where every unit at 2 threads matched it.
        lone, whole = self._fastest_thread_count()
        if whole is not None and self.counts["units_cached"] and sum(self.latency[lone]) > CACHE_DISAGREEMENT * whole:
            # Cached unit timings far slower than the whole graph timed now were taken while something else held
            # the cores (SqueezeNet's once summed to 1173 ms against a 20 ms run): measure them again. (Faster
            # ones are not redone: the machine is busier now, and would give worse figures.)
            self.counts["units_cached"] = 0
            self._measure_units(refresh=True)
        self.best_threads = [lone] * len(graph)
        self.best = list(self.latency[lone])
        self.sync_overhead = self._measure_handoff()
        if self.gpu:
            self.fill = self._measure_fill()
            self.capacity = 1.0 / min(self.fill, default=1.0)
        self.profile_seconds += time.perf_counter() - started

    # -- the cost-model interface --

    def op_latency(self, unit: int) -> float:
        # A unit alone runs with the thread count the whole graph ran fastest with (see __init__).
        return self.best[unit]

    def stage_threads(self, groups: Sequence[Sequence[int]]) -> list[list[int]] | None:
        if len(groups) != 1:
            return None
        return [[self.best_threads[u] for u in groups[0]]]

    def stage_latency(self, groups: Sequence[Sequence[int]]) -> float:
        key = ("concurrent", tuple(tuple(g) for g in groups))
        measured = self.measured_stages.get(key)
        return measured if measured is not None else self.predict(key)

    def merge_latency(self, units: Sequence[int]) -> float | None:
        key = ("merge", tuple((u,) for u in units))
        measured = self.measured_stages.get(key)
        return measured if measured is not None else self.predict(key)

    def region_latencies(self, regions: Sequence[Sequence[int]]) -> list[float] | None:
        """Each run of units (a block, in topological order) compiled as one region and run back to back
        on every core, measured in place; None with eager kernels, which have nothing to fuse. From then on
        a plan with regions prices a one-group stage of exactly those units at what its region measured. If
        profiling them fails (a region a compiler cannot take), None too, and ``region_error`` says why."""
        if self.kernels == "eager" or self.gpu or self.region_error:
            return None
        wanted = [tuple(r) for r in regions]
        missing = []
        for region in dict.fromkeys(wanted):
            if region in self.regions:
                continue
            if len(region) == 1:
                self.regions[region] = self.best[region[0]]
                continue
            cached = self._cached(self._stage_key(("region", (region,))), f"cores={self.cores}")
            if cached is None:
                missing.append(region)
            else:
                self.regions[region] = cached
                self.counts["regions_cached"] += 1
        if missing:
            started = time.perf_counter()
            try:
                self._measure_regions(missing)
            except Exception as e:  # noqa: BLE001 - a region that fails to compile or run: plans without regions
                self.region_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                return None
            finally:
                self.profile_seconds += time.perf_counter() - started
        return [self.regions[r] for r in wanted]

    def stream_latency(self, makespan: float, streams: Sequence[Sequence[int]]) -> float:
        if self.gpu:  # streams share the SMs: no faster than the device time their units fill
            return max(makespan, self._device_time(u for s in streams for u in s))
        busy = [units for units in streams if units]
        if len(busy) < 2:
            return makespan
        measured = self.measured_streams.get(tuple(tuple(units) for units in busy))
        if measured is not None:
            return measured
        # Beside each other, K streams share the cores: a unit gets cores // K threads (the compiled program
        # gives it as many as the streams its predicted timeline overlaps), and the schedule is costed the way
        # a concurrent stage is: the streams' timeline at those latencies, no shorter than their work spread
        # over the cores, times the measured contention, plus the hand-off of each stream beyond the first.
        # Costed with each unit's lone latency instead, sixteen small CNNs on sixteen streams were predicted
        # 2.27 ms and ran 2.60, slower than their one-stream plan (1.78), which the search could not see.
        threads = max(1, self.cores // len(busy))
        alone = self.latency[threads]
        stream_of = {u: k for k, units in enumerate(busy) for u in units}
        preds = self.graph.preds
        times = simulate(busy, alone.__getitem__,
                         lambda u: [(j, self.sync_overhead if stream_of[j] != stream_of[u] else 0.0)
                                    for j in indices(preds[u])])
        work = sum(alone[u] for u in stream_of) * threads / self.cores
        spread = self.contention * max(max(times.finish.values()), work) + self.sync_overhead * (len(busy) - 1)
        return self.stream_factor * max(makespan, spread)

    def describe(self) -> dict:
        described = {"name": self.name, "unit": "ms", "device": self.device, "kernels": self.kernels,
                     "cores": self.cores, "sync_overhead_ms": self.sync_overhead, "contention": self.contention,
                     "merge_factor": self.merge_factor, "profile_seconds": round(self.profile_seconds, 3),
                     **self.counts}
        if self.region_error:
            described["region_error"] = self.region_error
        if self.kernel_choice is not None:
            described["kernel_choice"] = self.kernel_choice
        if self.gpu:
            del described["cores"]
            described["capacity"] = self.capacity
        return described

    # -- prediction --

    def predict(self, stage: StageKey) -> float:
        """The latency of a stage from its units' latencies (see the module docstring)."""
        strategy, groups = stage
        if strategy == "merge":
            return self.merge_factor * sum(self.latency[self.cores][u] for g in groups for u in g)
        if len(groups) == 1:
            return sum(self.best[u] for u in groups[0])
        if self.gpu:
            longest = max(sum(self.best[u] for u in g) for g in groups)
            filled = self._device_time(u for g in groups for u in g)
            return self.contention * max(longest, filled) + self.sync_overhead * (len(groups) - 1)
        threads = max(1, self.cores // len(groups))
        alone = self.latency[threads]
        longest = max(sum(alone[u] for u in g) for g in groups)
        work = sum(alone[u] for g in groups for u in g) * threads / self.cores
        return self.contention * max(longest, work) + self.sync_overhead * (len(groups) - 1)

    def unmeasured(self, stages: Iterable[StageKey]) -> list[StageKey]:
        """The stages among ``stages`` whose latency is predicted, not measured."""
        return [s for s in stages
                if (s[0] == "merge" or len(s[1]) > 1) and s not in self.measured_stages]

    # -- measuring --

    def measure_schedule(self, stages: Sequence[StageKey], refresh: bool = False,
                         threads: Sequence[Any] | None = None) -> None:
        """Run a staged schedule whole and keep, for each of its concurrent (several groups) and merge
        stages, its latency as measured in place: from the start of its first unit to the start of the
        next stage's, so its fork and join count. One-unit stages keep their profiled time, so that the
        all-sequential schedule is costed exactly as it was profiled. Without ``refresh``, a schedule whose
        stages are all in the cache is not run; ``threads`` are the schedule's per-stage thread choices.
        Then update the contention and merge factors."""
        started = time.perf_counter()
        wanted = [s for s in stages if s[0] == "merge" or len(s[1]) > 1]
        for stage in wanted:
            self.predicted_when_measured.setdefault(stage, self._predict_with_priors(stage))
        cached = {s: self._cached(self._stage_key(s), f"cores={self.cores}") for s in wanted}
        if not refresh and all(v is not None for v in cached.values()):
            for stage, ms in cached.items():
                if stage not in self.measured_stages:
                    self.measured_stages[stage] = ms
                    self.counts["stages_cached"] += 1
        elif wanted:
            runs = self.runs.stages([stages], [self.cores], f"measuring a schedule of {len(stages)} stages",
                                    [threads] if threads else None)[0]
            stage_of = {u: k for k, (_, groups) in enumerate(stages) for g in groups for u in g}
            durations: dict[int, list[float]] = {k: [] for k, s in enumerate(stages) if s in cached}
            for timeline in runs:
                starts = [float("inf")] * len(stages)
                end = 0.0
                for _, units, start, finish in timeline:
                    k = stage_of[units[0]]
                    starts[k] = min(starts[k], start)
                    end = max(end, finish)
                bounds = starts[1:] + [end]
                for k, samples in durations.items():
                    samples.append((bounds[k] - starts[k]) * 1000.0)
            for k, samples in durations.items():
                ms = statistics.median(samples)
                self.counts["stages_measured"] += 1
                self.measured_stages[stages[k]] = ms
                self._store(self._stage_key(stages[k]), f"cores={self.cores}", ms, len(samples))
        self._update_factors()
        self.profile_seconds += time.perf_counter() - started

    def measure_program(self, program: Any) -> float:
        """Median milliseconds of a whole program run in place, from the call's start to its last unit's
        end: what a stream schedule's prediction is replaced by (its timeline from unit latencies knows
        nothing of streams slowing each other on shared cores)."""
        started = time.perf_counter()
        runs = self.runs.programs([program], "measuring a stream schedule")[0]
        self.profile_seconds += time.perf_counter() - started
        return statistics.median(max(finish for *_, finish in timeline) * 1000.0 for timeline in runs)

    def measure_streams(self, streams: Sequence[Sequence[int]], program: Any, predicted: float) -> float:
        """Milliseconds of a stream schedule's ``program`` run whole (:meth:`measure_program`), which
        ``predicted`` (by this model, now) the schedule: from then on these streams cost what they measured,
        and the streams factor, by which every other schedule of several streams is predicted, becomes the
        median ratio of such runs to their predictions from unit latencies. On two cores, ResNet-18 x4's
        six streams were predicted 57 ms and ran 89, slower than one stream (71): the search sees it so."""
        ms = self.measure_program(program)
        busy = tuple(tuple(units) for units in streams if units)
        # a GPU's streams are priced by the SMs they fill, not scaled; compiled kernels' streams run as regions,
        # measured as such, and these runs unit by unit say nothing of them (LIOS's taught hivemind to keep to
        # one stream, where two ran SqueezeNet and ShuffleNet V2 1.6x faster as ONNX Runtime regions)
        if len(busy) > 1 and not self.gpu and self.kernels == "eager":
            if busy not in self.measured_streams:
                self._stream_ratios.append(ms / (predicted / self.stream_factor))
                self.stream_factor = statistics.median(self._stream_ratios)
            self.measured_streams[busy] = ms
        return ms

    def _predict_with_priors(self, stage: StageKey) -> float:
        saved = self.contention, self.merge_factor
        self.contention, self.merge_factor = 1.0, 1.0
        try:
            return self.predict(stage)
        finally:
            self.contention, self.merge_factor = saved

    def _update_factors(self) -> None:
        def ratios(strategy: str) -> list[float]:
            return [self.measured_stages[s] / p for s, p in self.predicted_when_measured.items()
                    if s[0] == strategy and (strategy == "merge" or len(s[1]) > 1) and p > 0]

        concurrent, merged = ratios("concurrent"), ratios("merge")
        if concurrent:
            self.contention = statistics.median(concurrent)
        if merged:
            self.merge_factor = statistics.median(merged)

    def _measure_units(self, refresh: bool = False) -> None:
        """Time every unit in place: the whole graph run in order, once per thread count, the units'
        times read from the executor's timeline (a unit timed in a loop on its own finds its weights
        and inputs in cache, and comes out faster than it runs inside the model)."""
        missing = []
        for threads in self.thread_options:
            cached = [self._cached(self.signatures[u], str(threads)) for u in range(len(self.graph))]
            if refresh or any(c is None for c in cached):
                missing.append(threads)
            else:
                self.latency[threads] = cached
                self.counts["units_cached"] += len(self.graph)
        if not missing:
            return
        order = [("concurrent", [[u]]) for u in range(len(self.graph))]
        timelines = self.runs.stages([order] * len(missing), missing, f"profiling {len(self.graph)} units")
        for threads, runs in zip(missing, timelines):
            per_unit: list[list[float]] = [[] for _ in range(len(self.graph))]
            for timeline in runs:
                for _, units, start, finish in timeline:
                    per_unit[units[0]].append((finish - start) * 1000.0)
            # Units with the same signature do the same work: they share one figure, here and in the cache.
            by_signature: dict[str, list[float]] = {}
            for u, samples in enumerate(per_unit):
                by_signature.setdefault(self.signatures[u], []).extend(samples)
            shared = {sig: statistics.median(samples) for sig, samples in by_signature.items()}
            self.latency[threads] = [shared[self.signatures[u]] for u in range(len(self.graph))]
            for sig, ms in shared.items():
                self._store(sig, str(threads), ms, len(by_signature[sig]))
            self.counts["units_measured"] += len(self.graph)

    def _fastest_thread_count(self) -> tuple[int, float | None]:
        """The thread count the whole graph, run unit after unit, is fastest with, and its milliseconds: timed
        now, interleaved, never taken from the cache, since unit timings cached while the machine was busy
        once made every unit of VoVNet run on one thread, 1.7x slower than eager. (None for the time where
        there is one thread count, which is not timed.)"""
        if len(self.thread_options) == 1:
            return self.thread_options[0], None
        times = self.runs.whole(self.thread_options)  # on the CPU only: a GPU has one thread option
        ms, threads = min(zip(times, self.thread_options), key=lambda pair: (pair[0], -pair[1]))
        return threads, ms

    def _measure_regions(self, regions: Sequence[tuple[int, ...]]) -> None:
        """Time ``regions`` in place: the whole graph run in order with each of them compiled as one region
        (the other units one by one), each region's time read from the timeline. A region that a read from
        outside cuts in several (see :mod:`opsched.runtime.regions`) counts the time of all its parts."""
        from opsched.schedule import from_stages

        region_of = {u: k for k, region in enumerate(regions) for u in region}
        stages, started = [], set()
        for u in range(len(self.graph)):
            k = region_of.get(u)
            if k is None:
                stages.append(("concurrent", [[u]]))
            elif k not in started:
                started.add(k)
                stages.append(("concurrent", [list(regions[k])]))
        names, runs = self.runs.regions(from_stages(self.graph, self, "regions", stages), self.cores,
                                        f"profiling {len(regions)} compiled regions")
        samples: list[list[float]] = [[] for _ in regions]
        for timeline in runs:
            total = [0.0] * len(regions)
            for _, units, start, finish in timeline:
                k = region_of.get(self.graph.index[names[units[0]]])
                if k is not None:
                    total[k] += (finish - start) * 1000.0
            for k, ms in enumerate(total):
                samples[k].append(ms)
        for region, region_samples in zip(regions, samples):
            ms = statistics.median(region_samples)
            self.regions[region] = ms
            self.counts["regions_measured"] += 1
            self._store(self._stage_key(("region", (region,))), f"cores={self.cores}", ms, len(region_samples))

    def whole_graph_race(self, kernels: str) -> WholeGraphRace | None:
        """The milliseconds of the whole graph compiled on ``kernels`` as one region and of the fastest plan, when
        last timed side by side (interleaved, one run) on this device with this batch and core count
        (:meth:`remember_whole_graph_race`), with how many such races in a row it lost and how many optimizes
        skipped it since (:meth:`skip_whole_graph`); None where never so, or without a cache. All are kept by the
        graph whatever kernels its units were chosen to run on: where the choice is close enough to change from
        one optimize to the next (a small graph on a busy machine), the fastest plan's time hardly does."""
        if not self.cache:
            return None
        what, threads = self._whole_graph_key(), f"cores={self.cores}"
        whole = self.cache.get(self.device, what, kernels, self.batch, threads)
        plan = self.cache.get(self.device, what, "fastest plan", self.batch, threads)
        if whole is None or plan is None:
            return None
        # (a race kept before the counts were: one loss, nothing skipped)
        lost = self.cache.get(self.device, what, f"{kernels}: races lost", self.batch, threads)
        skipped = self.cache.get(self.device, what, f"{kernels}: optimizes skipped", self.batch, threads)
        return WholeGraphRace(whole, plan, int(lost if lost is not None else whole >= plan), int(skipped or 0))

    def remember_whole_graph_race(self, kernels: str, whole_ms: float, plan_ms: float, samples: int) -> None:
        """Keep what :meth:`whole_graph_race` reads: two latencies of one interleaved run, so that their ratio
        holds however busy the machine was then, and the races lost in a row (none where the whole graph was the
        faster)."""
        if self.cache:
            before = self.whole_graph_race(kernels)
            lost = (before.lost if before else 0) + 1 if whole_ms >= plan_ms else 0
            what, threads = self._whole_graph_key(), f"cores={self.cores}"
            self.cache.put(self.device, what, kernels, self.batch, threads, whole_ms, samples)
            self.cache.put(self.device, what, "fastest plan", self.batch, threads, plan_ms, samples)
            self.cache.put(self.device, what, f"{kernels}: races lost", self.batch, threads, lost, 1)
            self.cache.put(self.device, what, f"{kernels}: optimizes skipped", self.batch, threads, 0, 1)

    def skip_whole_graph(self, kernels: str) -> None:
        """Count one more optimize that did not compile the whole graph on ``kernels`` (see
        :meth:`whole_graph_race`)."""
        race = self.whole_graph_race(kernels)
        if race is not None:
            self.cache.put(self.device, self._whole_graph_key(), f"{kernels}: optimizes skipped", self.batch,
                           f"cores={self.cores}", race.skipped + 1, 1)

    def _whole_graph_key(self) -> str:
        """The whole graph's key whatever kernels its units were chosen to run on."""
        unchosen = [self._unit_signature(u, kernel=False) for u in range(len(self.graph))]
        return self._stage_key(("whole graph", (tuple(range(len(self.graph))),)), unchosen)

    def _measure_handoff(self) -> float:
        """Milliseconds one extra stream adds to a stage: a two-stream stage of empty steps against a
        one-stream stage of the same steps."""
        key = "handoff"
        cached = self._cached(key, f"cores={self.cores}")
        if cached is not None:
            return cached
        t_one, t_two = self.runs.handoff(self.cores)
        handoff = max(0.0, t_two - t_one)
        self._store(key, f"cores={self.cores}", handoff, self.repeats)
        return handoff

    def _measure_fill(self) -> list[float]:
        """GPU: the fraction of the device each unit fills, from the unit run as ``SHARING_COPIES`` copies
        on as many streams at once, in place (a stage per unit), against the unit alone: k copies of a unit
        filling f of the SMs take ``max(1, k * f)`` times as long as one. Below 1 / k the copies all fit and
        f cannot be told apart from 1 / k, which is the figure kept."""
        copies = SHARING_COPIES
        key = f"copies={copies}"
        together = [self._cached(self.signatures[u], key) for u in range(len(self.graph))]
        if any(t is None for t in together):
            n = len(self.graph)
            runs = self.runs.copies(copies, f"profiling {n} units, {copies} copies at once")
            per_unit: list[list[float]] = [[] for _ in range(n)]
            for timeline in runs:
                spans: dict[int, tuple[float, float]] = {}
                for _, units, start, finish in timeline:
                    u = units[0] % n
                    first, last = spans.get(u, (start, finish))
                    spans[u] = (min(first, start), max(last, finish))
                for u, (start, finish) in spans.items():
                    per_unit[u].append((finish - start) * 1000.0)
            together = [statistics.median(samples) for samples in per_unit]
            for u, ms in enumerate(together):
                self._store(self.signatures[u], key, ms, len(per_unit[u]))
        return [min(1.0, max(1.0 / copies, t / (copies * alone))) if alone > 0 else 1.0
                for t, alone in zip(together, self.best)]

    def _device_time(self, units: Iterable[int]) -> float:
        """GPU: the time the device is full with ``units`` (each unit's latency times the fraction it fills)."""
        return sum(self.best[u] * self.fill[u] for u in units)

    # -- cache keys --

    def _unit_signature(self, u: int, kernel: bool = True) -> str:
        node = self.graph.nodes[u]
        doc = {"kernel": self.runs.choice[node.name] if kernel else None, "kind": node.kind, "ops": list(node.ops),
               "attrs": {k: _plain(v) for k, v in sorted(node.attrs.items())},
               "inputs": [_describe_value(self.values[a]) for a in node.args], "shape": _plain(node.shape),
               "dtype": node.dtype, "flops": node.flops, "param_bytes": node.param_bytes}
        return "unit:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    def _stage_key(self, stage: StageKey, signatures: Sequence[str] | None = None) -> str:
        signatures = signatures or self.signatures
        strategy, groups = stage
        inside = [u for g in groups for u in g]
        position = {u: i for i, u in enumerate(inside)}
        external: dict[str, int] = {}
        wiring = []
        for u in inside:
            wiring.append([f"u{position[self.graph.index[a]]}" if a in self.graph.index and
                           self.graph.index[a] in position else f"x{external.setdefault(a, len(external))}"
                           for a in self.graph.nodes[u].args])
        doc = {"strategy": strategy, "groups": [[signatures[u] for u in g] for g in groups], "wiring": wiring}
        return "stage:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]

    def _cached(self, what: str, threads: str) -> float | None:
        return self.cache.get(self.device, what, self.column, self.batch, threads) if self.cache else None

    def _store(self, what: str, threads: str, ms: float, samples: int) -> None:
        if self.cache:
            self.cache.put(self.device, what, self.column, self.batch, threads, ms, samples)


def stages_of(schedule: Any, graph: Graph) -> list[StageKey]:
    """A staged schedule's stages as cost-model keys."""
    index = graph.index
    return [(st.strategy, tuple(tuple(index[u] for u in g) for g in st.groups)) for st in schedule.stages]


def _describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype), list(value.stride())]
    return repr(value)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
