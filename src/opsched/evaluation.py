"""The evaluation every job ends with: candidates (opsched's plans and the peers a user would run instead)
verified against the reference outputs, the ones that fail dropped with the reason, the rest timed
interleaved, unsteady timings re-measured, and one chosen above the run's own noise (:mod:`opsched.noise`).

This module imports nothing of opsched's above it: :mod:`opsched.peers` makes candidates of the peers,
:mod:`opsched.pipeline` of the plans, and both hand them to :func:`evaluate`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opsched.errors import VerificationError


@dataclass
class Candidate:
    """One configuration to verify and time: ``run()`` calls it once on the job's inputs and returns its
    outputs (after waiting for the device). ``kind`` is ``schedule`` (an opsched plan) or ``peer`` (what the
    user would run instead); a peer timed at several thread counts is one candidate per count, under one
    ``name``, and the best count is kept. ``expected_ms`` is a prediction: a median far above it is
    re-measured. ``module``, where there is one, is what a user calls instead of the model: the same
    configuration, taking the model's inputs (``run`` is it bound to the job's inputs). ``prepare()`` and
    ``settle()``, when given, are called before and after each call, untimed: what the configuration needs
    ready and must not leave behind, because it would slow the others (the ``threads`` peer's pool, whose
    threads' OpenMP pools slow every parallel region in the process while they live). ``program``, when
    given, says what runs: candidates with equal programs run the same steps with the same kernels, so only
    the first of them is timed and the others are reported with it."""

    name: str
    run: Callable[[], Any]
    kind: str = "schedule"
    threads: int | None = None
    expected_ms: float | None = None
    module: Callable[..., Any] | None = None
    prepare: Callable[[], Any] | None = None
    settle: Callable[[], Any] | None = None
    program: Hashable | None = None

    @property
    def label(self) -> str:
        return self.name if self.threads is None else f"{self.name}@{self.threads}"


@dataclass
class Evaluation:
    """What :func:`evaluate` found: per candidate name the median milliseconds at its best thread count and
    that count, the largest output error scaled to each output's magnitude (``errors``, see
    :mod:`opsched.compare`) and the largest absolute difference (``abs_errors``), the candidates dropped
    (name -> why), warnings (unsteady timings, dropped candidates) and each verified candidate's ``module`` and
    ``run`` (at its best thread count).

    ``chosen`` is the configuration to use: the simplest one that no other is faster than above the run's
    noise (:mod:`opsched.noise`): peers before plans (the model itself first), plans in the order given.
    ``tie`` lists every configuration that no other beats so (the fastest among them); ``same_program`` maps a candidate to
    the one it was timed as (they compile to the same program); ``noise_floor`` is the same-program spread
    measured in this run (``noise_control`` timed twice) and ``samples`` the timed rounds of each name."""

    measured_ms: dict[str, float] = field(default_factory=dict)
    threads: dict[str, int | None] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    abs_errors: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    chosen: str | None = None
    warnings: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    modules: dict[str, Callable[..., Any] | None] = field(default_factory=dict)
    runs: dict[str, Callable[[], Any]] = field(default_factory=dict)
    tie: list[str] = field(default_factory=list)
    same_program: dict[str, str] = field(default_factory=dict)
    noise_floor: float | None = None
    noise_control: str | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    @property
    def left_out(self) -> set[str]:
        """The configurations timed for fewer rounds than the others: the race left them out."""
        rounds = max((len(s) for s in self.samples.values()), default=0)
        return {n for n, s in self.samples.items() if len(s) < rounds}

    def fastest(self, kind: str, among: Collection[str] | None = None) -> str | None:
        """The configuration of ``kind`` (``schedule`` or ``peer``) to use: the simplest of that kind that the
        fastest of that kind does not beat above the run's noise (see :func:`opsched.noise.choose`); with
        ``among``, of those named there only."""
        from opsched.noise import choose

        names = [n for n in self.order if self.kinds[n] == kind and (among is None or n in among)]
        left_out = self.left_out
        timed_through = [n for n in names if n not in left_out]
        if timed_through:
            return choose(self.samples, timed_through, self.noise_floor or 0.0)[0]
        # every one of the kind left out by the race: the fastest over the rounds they all ran
        rounds = min((len(self.samples[n]) for n in names), default=0)
        return min(names, key=lambda n: statistics.median(self.samples[n][:rounds])) if names else None

    def ratio(self, name: str, than: str) -> dict[str, float]:
        """``name``'s median over ``than``'s, with its bootstrap interval over this run's rounds."""
        from opsched.noise import ratio_interval

        ratio, low, high = ratio_interval(self.samples[name], self.samples[than])
        return {"ratio": round(ratio, 4), "low": round(low, 4), "high": round(high, 4)}

    def shared_medians(self, *names: str) -> list[float]:
        """The medians of ``names`` over the rounds all of them were timed in: a configuration the race left out
        has samples of its first rounds only, and the machine may have slowed after."""
        rounds = min(len(self.samples[n]) for n in names)
        return [statistics.median(self.samples[n][:rounds]) for n in names]

    def speedups(self, baseline: str) -> dict[str, float]:
        """Each verified configuration's speedup over ``baseline`` (its median into the baseline's), over the
        rounds both were timed in (:meth:`shared_medians`). Empty where ``baseline`` was not measured."""
        if baseline not in self.samples:
            return {}
        return {n: round(base / ms, 4) for n in self.measured_ms for base, ms in [self.shared_medians(baseline, n)]}

    def noise(self) -> dict[str, Any]:
        """The run's noise as reported beside its figures: the same-program spread and what was timed twice,
        the names tied at the top, the chosen configuration's ratio to every other verified name, and
        opsched's plan (the one :meth:`fastest` keeps) over the peer it keeps, each with its interval, and the
        rounds each configuration the race left out was timed for."""
        plan, peer = self.fastest("schedule"), self.fastest("peer")
        return {"same_program_spread": None if self.noise_floor is None else round(self.noise_floor, 4),
                "timed_twice": self.noise_control, "tie": list(self.tie), "same_program": dict(self.same_program),
                "left_out": {n: len(self.samples[n]) for n in sorted(self.left_out)},
                "chosen_over": {n: self.ratio(self.chosen, n) for n in self.order if n != self.chosen}
                if self.chosen else {},
                "plan_over_peer": {"plan": plan, "peer": peer, **self.ratio(plan, peer)} if plan and peer else None}


UNSTEADY_SPREAD = 2.0     # a median more than this times the fastest sample is re-measured
UNEXPECTED_FACTOR = 3.0   # a median more than this times the prediction is re-measured
MAX_RETIMINGS = 2
RACE_AFTER = 5  # rounds before a configuration plainly slower than the fastest stops being timed (timing.RACE_MARGIN)
# each sample's untimed lead-in lasts this long (at most 50 calls): one call of a short configuration did not clear
# the wake of the one before it. Measured here (2 cores, 16 small CNNs fused, six searches each, interleaved): a
# 0.29 ms plan timed at 0.55-0.63 ms after the batched graph's plans in three searches of six with one lead-in call,
# and at 0.29-0.31 ms in all six with 20 ms of lead-in (5 ms: five of six)
LEAD_IN_SECONDS = 0.02


def evaluate(candidates: Sequence[Candidate], reference: Any, tolerance: float | None = None, repeats: int = 15,
             progress: Callable[[], Any] | None = None) -> Evaluation:
    """Verify every candidate against ``reference`` (the outputs the model itself gives, any structure of
    tensors) with :func:`opsched.compare.compare_outputs` (each output at its own scale; ``tolerance``
    default: each output dtype's), drop those that raise or differ (saying why), time the rest interleaved
    (medians of ``repeats`` rounds) and choose (see :class:`Evaluation`).

    Candidates with the same ``program`` are timed once. One candidate (the one with the lowest ``expected_ms``,
    else the first verified) is timed twice, the second time as a control: how far its two medians land apart is
    the run's noise floor, and no configuration is chosen over a simpler one for a gain below it or below the
    bootstrap interval of the ratio. Each sample is led in by LEAD_IN_SECONDS of untimed calls of the same
    configuration (:func:`opsched.timing.interleaved_samples`). A configuration whose every sample after RACE_AFTER
    rounds is slower by RACE_MARGIN (10%) than every sample of the fastest is timed no more, a margin that widens to
    three times the control's spread in a noisier run (:func:`opsched.timing.race_leavers`): its median is of the
    rounds it ran.

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
    >>> ev.chosen, sorted(ev.measured_ms), ev.dropped["wrong"]  # doctest: +ELLIPSIS
    ('double', ['double'], "output 0: differs from the model's by up to 1, 0.5 of its largest magnitude 2 ...")
    """
    from opsched.compare import compare_outputs
    from opsched.noise import choose, same_program_spread
    from opsched.timing import interleaved_samples, steady_allocator, unsteady

    steady_allocator()
    result = Evaluation()
    if all_zero(reference):
        result.warnings.append("every output of the model is zero on these inputs: the comparison cannot tell a wrong "
                               "plan from a right one (an untrained model whose last layer starts at zero?)")
    verified = []
    for c in candidates:
        try:
            if c.prepare is not None:
                c.prepare()
            verdict = compare_outputs(c.run(), reference, tolerance)
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported and left out, never fatal
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result.dropped.setdefault(c.name, f"failed: {type(e).__name__}: {first}")
            continue
        finally:
            if c.settle is not None:  # dropped or not, what its call left behind must not slow the others
                c.settle()
        if not verdict.ok:
            result.dropped.setdefault(c.name, verdict.why)
            continue
        verified.append(c)
        result.errors[c.name] = max(verdict.error, result.errors.get(c.name, 0.0))
        result.abs_errors[c.name] = max(verdict.abs_error, result.abs_errors.get(c.name, 0.0))
    for name, why in result.dropped.items():
        if name not in result.errors:
            result.warnings.append(f"{name} dropped: {why}")
    if not verified:
        return result
    timed, alias = _distinct_programs(verified)
    # the control, one configuration again as one more in every round (see opsched.noise): the one predicted
    # fastest, since the race never leaves the pair out (a slow one timed twice every round cost Inception V3's
    # evaluation a third of its time), else the first
    position = {id(c): k for k, c in enumerate(timed)}
    predicted: dict[int, float] = {}  # by timed candidate, the lowest prediction of it or its same-program aliases
    for c in verified:
        if c.expected_ms and math.isfinite(c.expected_ms):
            k = position[id(alias.get(c.label, c))]
            predicted[k] = min(predicted.get(k, math.inf), c.expected_ms)
    twice = min(predicted, key=predicted.__getitem__) if predicted else 0
    runners = [c.run for c in timed] + [timed[twice].run]
    around = [(c.prepare, c.settle) for c in timed] + [(timed[twice].prepare, timed[twice].settle)]
    # the control and the configuration it repeats run every round (the noise floor compares them)
    race = {"race_after": RACE_AFTER, "control": (twice, len(runners) - 1)}
    samples = interleaved_samples(runners, repeats, warmup=2, after_each=progress, around=around,
                                  lead_in_seconds=LEAD_IN_SECONDS, **race)
    for _ in range(MAX_RETIMINGS):
        if not _suspect(timed, samples):
            break
        samples = interleaved_samples(runners, repeats, warmup=1, after_each=progress, around=around,
                                      lead_in_seconds=LEAD_IN_SECONDS, **race)
    *samples, again = samples
    for c, s in zip(timed, samples):
        if unsteady(s, UNSTEADY_SPREAD):
            result.warnings.append(f"{c.label}: timings stayed unsteady over {1 + MAX_RETIMINGS} measurements "
                                   "(the machine is busy); its figure is not reliable")
        elif c.expected_ms and statistics.median(s) > UNEXPECTED_FACTOR * c.expected_ms:
            result.warnings.append(f"{c.label}: measured {statistics.median(s) / c.expected_ms:.1f}x its "
                                   "prediction in every measurement")
    result.noise_floor = same_program_spread(samples[twice], again)
    result.noise_control = timed[twice].label
    by_label = {c.label: s for c, s in zip(timed, samples)}
    rounds = len(again)  # the control ran every round
    for c in verified:
        s = by_label[alias[c.label].label if c.label in alias else c.label]
        ms = statistics.median(s)
        # a name's thread counts: one timed every round over one the race left out, then the lower median (the
        # medians of a left-out one and a full one are of different rounds: the machine may have slowed between)
        if c.name not in result.measured_ms or (len(s) < rounds, ms) < (
                len(result.samples[c.name]) < rounds, result.measured_ms[c.name]):
            result.measured_ms[c.name] = ms
            result.threads[c.name] = c.threads
            result.kinds[c.name] = c.kind
            result.modules[c.name] = c.module
            result.runs[c.name] = c.run
            result.samples[c.name] = list(s)
            if c.label in alias:
                result.same_program[c.name] = alias[c.label].name
            else:
                result.same_program.pop(c.name, None)
    result.order = [n for kind in ("peer", "schedule") for n in result.measured_ms if result.kinds[n] == kind]
    # the race's left-out configurations are neither chosen nor tied: compared on full medians, one left out
    # before the machine slowed could pass for faster than what beat it in every round they shared
    left_out = result.left_out
    result.chosen, result.tie = choose(result.samples, [n for n in result.order if n not in left_out],
                                       result.noise_floor)
    return result


def _distinct_programs(candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, Candidate]]:
    """The candidates to time (the first of each ``program`` at each thread count) and, by label, the
    candidate each other one is timed as."""
    timed, alias, first = [], {}, {}
    for c in candidates:
        key = None if c.program is None else (c.program, c.threads)
        if key is not None and key in first:
            alias[c.label] = first[key]
            continue
        if key is not None:
            first[key] = c
        timed.append(c)
    return timed, alias


def _suspect(candidates: Sequence[Candidate], samples: Sequence[Sequence[float]]) -> bool:
    from opsched.timing import unsteady

    return any(unsteady(s, UNSTEADY_SPREAD) or (c.expected_ms and statistics.median(s) >
                                                UNEXPECTED_FACTOR * c.expected_ms)
               for c, s in zip(candidates, samples))


def module_runner(module: Callable[..., Any], inputs: Sequence[Any], cores: int,
                  sync: Callable[[], Any] = lambda: None) -> Callable[[], Any]:
    """A runner of an opsched module (which applies its own per-stream threads) from a caller holding
    ``cores`` threads, as the timing loops use it beside the peers. A compiled plan's guard checks the call at
    the runner's first run (a plan that does not serve it fails there, and is dropped); the runs after time what
    runs once the call is checked, as the module ``opsched.optimize`` returns runs its plan: it checks each call
    once, whichever configuration was chosen, a plan or a peer (:class:`~opsched.runtime.guarded.GuardedModule`;
    the check's cost, the same for every configuration, is measured in docs/calls.md). Timed with the check, a
    plan paid it where the peers did not: EfficientNet-B0 at 96 px, 360 tensors watched, 0.5 ms of 3.7."""
    import torch

    guard = getattr(module, "guard", None) if hasattr(module, "run") else None
    checked: list[Any] = []  # the flat inputs, once the guard passed them

    def run() -> Any:
        torch.set_num_threads(cores)
        if guard is None:
            out = module(*inputs)
        else:
            if not checked:
                checked.append(guard.check(tuple(inputs)))
            out = module.run(checked[0])
        sync()
        return out

    return run


def all_zero(outputs: Any) -> bool:
    """Whether ``outputs`` (any structure) hold floating-point tensors and every one is all zeros: outputs that
    no wrong answer would differ from by much.

    >>> import torch
    >>> all_zero((torch.zeros(2), {"n": torch.zeros(1, dtype=torch.long)})), all_zero([torch.zeros(2), torch.ones(1)])
    (True, False)
    """
    import torch
    import torch.utils._pytree as pytree

    floats = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and not any(bool(t.any()) for t in floats)


def reference_outputs(model: Any, inputs: Sequence[Any], cores: int) -> Any:
    """The model's own outputs on ``inputs``, in inference mode, as every candidate is verified against."""
    import torch

    torch.set_num_threads(cores)
    with torch.inference_mode():
        return model(*inputs)


@dataclass
class Verification:
    """The verdict of :func:`verify`: ``max_error`` is scaled to each output's magnitude (see
    :mod:`opsched.compare`), ``max_abs_error`` the largest absolute difference, ``why`` the first mismatch."""

    max_abs_error: float
    max_error: float
    tolerance: float
    ok: bool
    why: str = ""


def verify(module: Callable[..., Any], reference: Callable[..., Any], inputs: Sequence[Any],
           tolerance: float | None = None, strict: bool = False) -> Verification:
    """Run both on ``inputs`` and compare every output with :func:`opsched.compare.compare_outputs` (each at
    its own scale; ``tolerance`` default: each output dtype's). With ``strict``, raise
    :class:`VerificationError` naming the first mismatch."""
    import torch

    from opsched.compare import compare_outputs

    with torch.inference_mode():
        got = module(*inputs)
        want = reference(*inputs)
    verdict = compare_outputs(got, want, tolerance)
    result = Verification(verdict.abs_error, verdict.error, verdict.tolerance, verdict.ok, verdict.why)
    if strict and not result.ok:
        raise VerificationError(f"{verdict.why}; the schedule is not used")
    return result
