"""The evaluation every job ends with: candidates (opsched's plans and the peers a user would run instead)
verified against the reference outputs, the ones that fail dropped with the reason, the rest timed
interleaved, unsteady timings re-measured, and the fastest verified one chosen.

This module imports nothing of opsched's above it: :mod:`opsched.peers` makes candidates of the peers,
:mod:`opsched.pipeline` of the plans, and both hand them to :func:`evaluate`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
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
    threads' OpenMP pools slow every parallel region in the process while they live)."""

    name: str
    run: Callable[[], Any]
    kind: str = "schedule"
    threads: int | None = None
    expected_ms: float | None = None
    module: Callable[..., Any] | None = None
    prepare: Callable[[], Any] | None = None
    settle: Callable[[], Any] | None = None

    @property
    def label(self) -> str:
        return self.name if self.threads is None else f"{self.name}@{self.threads}"


@dataclass
class Evaluation:
    """What :func:`evaluate` found: per candidate name the median milliseconds at its best thread count and
    that count, the largest output error, the candidates dropped (name -> why), the fastest verified
    name (``chosen``), warnings (unsteady timings, dropped candidates) and each verified candidate's
    ``module`` and ``run`` (at its best thread count)."""

    measured_ms: dict[str, float] = field(default_factory=dict)
    threads: dict[str, int | None] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    chosen: str | None = None
    warnings: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    modules: dict[str, Callable[..., Any] | None] = field(default_factory=dict)
    runs: dict[str, Callable[[], Any]] = field(default_factory=dict)

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
            result.modules[c.name] = c.module
            result.runs[c.name] = c.run
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


def reference_outputs(model: Any, inputs: Sequence[Any], cores: int) -> Any:
    """The model's own outputs on ``inputs``, in inference mode, as every candidate is verified against."""
    import torch

    torch.set_num_threads(cores)
    with torch.inference_mode():
        return model(*inputs)


@dataclass
class Verification:
    max_abs_error: float
    max_rel_error: float
    tolerance: float
    ok: bool


def verify(module: Callable[..., Any], reference: Callable[..., Any], inputs: Sequence[Any],
           tolerance: float = 1e-3, strict: bool = False) -> Verification:
    """Run both on ``inputs`` and compare every output tensor. With ``strict``, raise
    :class:`VerificationError` when the largest absolute difference exceeds ``tolerance``."""
    import torch

    with torch.inference_mode():
        got = module(*inputs)
        want = reference(*inputs)
    abs_error, rel_error = output_error(got, want)
    result = Verification(abs_error, rel_error, tolerance, abs_error <= tolerance)
    if strict and not result.ok:
        raise VerificationError(f"outputs differ from the model's by up to {abs_error:.3g} "
                                f"(tolerance {tolerance:g}); the schedule is not used")
    return result


def output_error(got: Any, want: Any) -> tuple[float, float]:
    """The largest absolute and relative differences between two structures of outputs (tensors, or
    arrays such as ONNX Runtime returns); raises :class:`VerificationError` when they do not correspond."""
    import torch
    import torch.utils._pytree as pytree

    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got) != len(want):
        raise VerificationError(f"the schedule returns {len(got)} outputs, the model {len(want)}")
    abs_error = rel_error = 0.0
    for a, b in zip(got, want):
        if not isinstance(b, torch.Tensor):
            continue
        a = torch.as_tensor(a)
        if a.shape != b.shape:
            raise VerificationError(f"an output has shape {tuple(a.shape)}, the model's {tuple(b.shape)}")
        diff = (a.double().to(b.device) - b.double()).abs()
        if diff.numel():
            abs_error = max(abs_error, diff.max().item())
            rel_error = max(rel_error, (diff / b.double().abs().clamp_min(1e-6)).max().item())
    return abs_error, rel_error
