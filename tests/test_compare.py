"""Verification at each output's own scale (opsched.compare): the same model verifies the same way at any output
magnitude, wrong answers on small outputs are caught, and special values and non-float outputs compare exactly.
The scaled error is checked against an independent float64 NumPy computation on random cases."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import small_models

from opsched.compare import compare_outputs, default_tolerance
from opsched.errors import VerificationError
from opsched.evaluation import Candidate, evaluate, verify
from opsched.graph.capture import capture
from opsched.runtime.module import OptimizedModule


class Branches(torch.nn.Module):
    """Two convolution branches joined, its output multiplied by ``scale``."""

    def __init__(self, scale: float):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 8, 1)
        self.head = torch.nn.Conv2d(16, 4, 1)
        self.scale = scale

    def forward(self, x):
        return self.head(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)) * self.scale


def _plan(model, x):
    graph = capture(model, (x,))
    return OptimizedModule(graph, small_models.schedule_all(graph)["greedy"], 2)


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e12])
def test_one_model_verifies_the_same_at_every_output_scale(scale):
    torch.manual_seed(0)
    model = Branches(scale).eval()
    x = torch.randn(1, 3, 8, 8)
    right = verify(_plan(model, x), model, (x,))
    assert right.ok and right.max_error < 1e-5, right
    # a wrong plan: the captured head's weights changed after capture, so it computes something else
    wrong_model = Branches(scale).eval()
    wrong_model.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
    wrong = verify(_plan(wrong_model, x), model, (x,))
    assert not wrong.ok and wrong.max_error > 1e-2
    with pytest.raises(VerificationError, match="output 0: differs"):
        verify(_plan(wrong_model, x), model, (x,), strict=True)


def test_a_wrong_schedule_over_a_large_vocabulary_is_rejected_though_every_probability_is_small():
    torch.manual_seed(0)
    vocabulary = 50257
    right = torch.nn.Sequential(torch.nn.Linear(16, vocabulary), torch.nn.Softmax(-1)).eval()
    unrelated = torch.nn.Sequential(torch.nn.Linear(16, vocabulary), torch.nn.Softmax(-1)).eval()
    x = torch.randn(1, 16)
    with torch.inference_mode():
        want, got = right(x), unrelated(x)
    assert (got - want).abs().max() < 1e-3  # what the old absolute tolerance (1e-3) accepted
    ev = evaluate([Candidate("wrong", lambda: unrelated(x)), Candidate("right", lambda: right(x))], want, repeats=3)
    assert "wrong" in ev.dropped and "of its largest magnitude" in ev.dropped["wrong"]
    assert ev.chosen == "right"


def _numpy_error(got: np.ndarray, want: np.ndarray) -> float:
    """The scaled error, computed independently in float64 NumPy."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), np.finfo(np.float64).tiny))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.floats(-12, 12), st.floats(-9, -1), st.integers(0, 2**31 - 1))
def test_the_scaled_error_matches_numpy_and_the_verdict_does_not_depend_on_the_output_scale(n, log_scale, log_noise,
                                                                                          seed):
    rng = np.random.default_rng(seed)
    want = rng.standard_normal(n).astype(np.float32)
    got = (want + 10.0 ** log_noise * np.abs(want).max() * rng.standard_normal(n)).astype(np.float32)
    base = compare_outputs(torch.from_numpy(got), torch.from_numpy(want))
    scale = np.float32(10.0 ** log_scale)
    scaled = compare_outputs(torch.from_numpy(got * scale), torch.from_numpy(want * scale))
    assert math.isclose(base.error, _numpy_error(got, want), rel_tol=1e-9, abs_tol=1e-300)
    tolerance = default_tolerance(torch.float32)
    # scaling by a float32 power-of-ten rounds each value once: a verdict can only flip at the tolerance's edge
    if abs(base.error - tolerance) > 1e-6 * tolerance + 4 * np.finfo(np.float32).eps:
        assert base.ok == scaled.ok == (base.error <= tolerance)
        assert math.isclose(scaled.error, base.error, rel_tol=1e-5, abs_tol=4 * np.finfo(np.float32).eps)


def test_integers_and_booleans_compare_exactly():
    assert compare_outputs(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])).ok
    verdict = compare_outputs((torch.ones(2), torch.tensor([True, False])), (torch.ones(2), torch.tensor([True, True])))
    assert not verdict.ok and verdict.why == "output 1: element (1,): False where the model gives True"
    assert "dtype torch.int32 where the model gives torch.int64" in compare_outputs(
        torch.tensor([1], dtype=torch.int32), torch.tensor([1])).why


def test_nan_and_infinities_must_stand_where_the_models_stand():
    nan, inf = float("nan"), float("inf")
    assert compare_outputs(torch.tensor([nan, inf, -inf, 1.0]), torch.tensor([nan, inf, -inf, 1.0])).ok
    assert compare_outputs(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])).why == \
        "output 0: element (1,): nan where the model gives 2"
    assert compare_outputs(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, nan]])).why == \
        "output 0: element (0, 1): 2 where the model gives nan"
    assert not compare_outputs(torch.tensor([-inf]), torch.tensor([inf])).ok
    # a NaN where the model's is finite is a VerificationError naming output and element, never a crash
    model = torch.nn.Identity()
    with pytest.raises(VerificationError, match=r"output 0: element \(0,\): nan where the model gives 1"):
        verify(lambda x: x * torch.tensor([nan]), model, (torch.ones(1),), strict=True)


def test_outputs_that_are_not_tensors_are_compared_or_refused_in_words():
    assert compare_outputs([torch.ones(1), 3, "label", None], [torch.ones(1), 3, "label", None]).ok
    assert compare_outputs([2.0], [2.0 + 1e-9]).ok and not compare_outputs([2.5], [2.0]).ok
    assert compare_outputs(["a"], ["b"]).why == "output 0: 'a' where the model gives 'b'"

    class Opaque:
        def __eq__(self, other):
            return np.array([True, False])

    assert compare_outputs([Opaque()], [Opaque()]).why.startswith("output 0: a Opaque, which cannot be compared")
    assert compare_outputs([torch.ones(2)], [torch.ones(2), torch.ones(2)]).why == \
        "1 outputs where the model gives 2"
    assert compare_outputs([torch.ones(2)], [torch.ones(3)]).why == "output 0: shape (2,) where the model gives (3,)"


def test_arrays_from_onnx_runtime_compare_like_tensors_and_zero_outputs_are_exact():
    assert compare_outputs([np.ones(3, dtype=np.float32)], (torch.ones(3),)).ok
    assert compare_outputs(torch.zeros(3), torch.zeros(3)).ok
    assert not compare_outputs(torch.tensor([0.0, 1e-30]), torch.zeros(2)).ok


def test_default_tolerances_follow_each_dtypes_noise():
    assert default_tolerance(torch.float64) < 1e-7 < default_tolerance(torch.float32) < 1.1e-3
    assert default_tolerance(torch.float16) < default_tolerance(torch.bfloat16) < 0.3
    # a float16 output is judged by float16's tolerance, not float32's
    want = torch.tensor([1.0, 2.0], dtype=torch.float16)
    assert compare_outputs(want * (1 + 2e-2), want).ok and not compare_outputs(want * 1.2, want).ok


def test_a_model_whose_every_output_is_zero_is_verified_with_a_warning_that_says_it_proves_nothing():
    # an untrained timm ResMLP or torchvision ViT answered zeros: every plan, right or wrong, "matched" exactly
    zeros = torch.zeros(2, 3)
    ev = evaluate([Candidate("plan", lambda: zeros * 5)], reference=zeros, repeats=3)
    assert "plan" in ev.measured_ms and any("cannot tell a wrong plan" in w for w in ev.warnings)
    ev = evaluate([Candidate("plan", lambda: zeros + 1)], reference=zeros + 1, repeats=3)
    assert not any("cannot tell" in w for w in ev.warnings)
