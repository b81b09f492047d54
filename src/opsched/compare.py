"""Whether a configuration's outputs are the model's: the one comparison every job, peer and test verifies with.

Each output is compared at its own scale. For a floating-point output the error is the largest absolute
difference divided by the largest magnitude of the model's own output (``max |got - want| / max |want|``): an
output of size 1e12 and one of size 1e-6 from the same computation get the same error, and a wrong answer on
probabilities that are all below 1e-4 is as wrong as on logits. An absolute tolerance would reject every
schedule of a model whose outputs are large (float32 noise on 1e12 is about 1e5) and pass any answer on outputs
that are small.

The default tolerance comes from the output's dtype: ``3 * sqrt(eps)``, about half of the dtype's significant
digits (float32: 1.04e-3, float64: 4.5e-8, float16: 0.094, bfloat16: 0.27). A schedule reorders the same
arithmetic (convolutions split or stacked, reductions in another order, kernels from another library), which
moves a float32 result by a few eps per operator and by 1e-6 to 1e-5 of the output's scale over a whole
network; a wrong computation moves it by its own scale. Outputs of integers or booleans compare exactly, and
so do NaN and infinities: where the model gives NaN or an infinity the configuration must give the same at the
same position, and a NaN or infinity where the model gives a finite value is a mismatch naming the element.

>>> import torch
>>> want = torch.tensor([1e12, 2e12])
>>> compare_outputs(want * (1 + 1e-7), want).ok, compare_outputs(want * 1e-18 + 1e-7, want * 1e-18).ok
(True, False)
>>> print(compare_outputs((torch.tensor([1.0, float("nan")]),), (torch.tensor([1.0, 2.0]),)).why)
output 0: element (1,): nan where the model gives 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutputComparison:
    """The verdict on one structure of outputs: ``error`` is the largest scaled error over the floating-point
    outputs (see the module docstring), ``abs_error`` the largest absolute difference, ``tolerance`` the one
    applied to the output with the largest error relative to its tolerance, and ``why`` the first mismatch, in
    words naming the output and the element (empty when ``ok``)."""

    ok: bool
    error: float
    abs_error: float
    tolerance: float
    why: str = ""


def default_tolerance(dtype: Any) -> float:
    """The tolerance for a floating-point output of ``dtype``, scaled to its magnitude: ``3 * sqrt(eps)``.

    >>> import torch
    >>> [round(default_tolerance(d), 9) for d in (torch.float64, torch.float32)]
    [4.5e-08, 0.001035801]
    """
    import torch

    return 3.0 * math.sqrt(torch.finfo(dtype).eps)


def compare_outputs(got: Any, want: Any, tolerance: float | None = None) -> OutputComparison:
    """Compare every output leaf of ``got`` (tensors, or arrays such as ONNX Runtime returns) with ``want``'s,
    each at its own scale, against ``tolerance`` (default: each output's dtype's, see :func:`default_tolerance`).
    Never raises on what the outputs hold: a mismatch of count, shape, dtype, value or type is a verdict with
    ``why``."""
    import torch
    import torch.utils._pytree as pytree

    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return OutputComparison(False, math.inf, math.inf, tolerance or 0.0,
                                f"{len(got_leaves)} outputs where the model gives {len(want_leaves)}")
    verdicts = []
    for k, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        one = _compare_tensor(k, a, b, tolerance) if isinstance(b, torch.Tensor) else _compare_other(k, a, b, tolerance)
        if not one.ok:
            return one
        verdicts.append(one)
    # the output nearest its tolerance speaks for all; the absolute difference is the largest of any
    nearest = max(verdicts, key=lambda v: v.error / v.tolerance if v.tolerance else 0.0,
                  default=OutputComparison(True, 0.0, 0.0, tolerance or 0.0))
    return OutputComparison(True, nearest.error, max((v.abs_error for v in verdicts), default=0.0), nearest.tolerance)


def _compare_tensor(k: int, got: Any, want: Any, tolerance: float | None) -> OutputComparison:
    import torch

    try:
        got = torch.as_tensor(got)
    except Exception:  # noqa: BLE001 - anything that is not array-like is a mismatch, said in words
        return _mismatch(k, f"a {type(got).__name__} where the model gives a tensor")
    if got.shape != want.shape:
        return _mismatch(k, f"shape {tuple(got.shape)} where the model gives {tuple(want.shape)}")
    if got.dtype != want.dtype:
        return _mismatch(k, f"dtype {got.dtype} where the model gives {want.dtype}")
    got = got.detach().to(want.device)
    want = want.detach()
    if not (want.is_floating_point() or want.is_complex()):
        differ = got != want
        if differ.any():
            return _mismatch(k, _element_text(differ, got, want))
        return OutputComparison(True, 0.0, 0.0, tolerance or 0.0)
    tol = tolerance if tolerance is not None else default_tolerance(want.real.dtype if want.is_complex()
                                                                    else want.dtype)
    wide = torch.complex128 if want.is_complex() else torch.float64
    got, want = got.to(wide), want.to(wide)
    finite = torch.isfinite(want)
    # NaN and infinities must stand where the model's stand: equal positions, equal values (NaN equals NaN here)
    special = ~finite | ~torch.isfinite(got)
    if special.any():
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        differ = special & ~same
        if differ.any():
            return _mismatch(k, _element_text(differ, got, want))
    if not finite.any():
        return OutputComparison(True, 0.0, 0.0, tol)
    diff = (got[finite] - want[finite]).abs()
    abs_error = diff.max().item() if diff.numel() else 0.0
    scale = want[finite].abs().max().item()
    error = abs_error / max(scale, torch.finfo(torch.float64).tiny)
    if not error <= tol:
        worst = torch.zeros_like(finite)
        position = finite.nonzero()[int(diff.argmax())]
        worst[tuple(position)] = True
        return OutputComparison(False, error, abs_error, tol,
                                f"output {k}: differs from the model's by up to {abs_error:.3g}, {error:.3g} of its "
                                f"largest magnitude {scale:.3g} (tolerance {tol:.3g}); "
                                f"{_element_text(worst, got, want)}")
    return OutputComparison(True, error, abs_error, tol)


def _compare_other(k: int, got: Any, want: Any, tolerance: float | None) -> OutputComparison:
    """A leaf that is not a tensor: a Python number compares as a float64 scalar, anything else by equality."""
    import torch

    if isinstance(want, float) and isinstance(got, (int, float)):
        return _compare_tensor(k, torch.tensor(float(got), dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), tolerance)
    try:
        equal = got == want
        if getattr(equal, "shape", ()) != ():  # an array of verdicts, not one
            raise TypeError(f"comparing gives a {type(equal).__name__}, not True or False")
        equal = bool(equal)
    except Exception as e:  # noqa: BLE001 - an output that cannot be compared is a verdict, not a crash
        return _mismatch(k, f"a {type(want).__name__}, which cannot be compared ({type(e).__name__}: {e})")
    if not equal:
        return _mismatch(k, f"{_short(got)} where the model gives {_short(want)}")
    return OutputComparison(True, 0.0, 0.0, tolerance or 0.0)


def _mismatch(k: int, what: str) -> OutputComparison:
    return OutputComparison(False, math.inf, math.inf, 0.0, f"output {k}: {what}")


def _element_text(differ: Any, got: Any, want: Any) -> str:
    """The first element where ``differ`` holds, with both values."""
    position = tuple(int(i) for i in differ.nonzero()[0])
    where = f"element {position}" if position else "the value"
    return f"{where}: {_short(got[position].item())} where the model gives {_short(want[position].item())}"


def _short(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)[:80]
