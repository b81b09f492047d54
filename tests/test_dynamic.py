"""Dimensions declared dynamic (opsched/runtime/dynamic.py): reading torch.export's ``dynamic_shapes``, asking
torch.export whether the model keeps them free, and a plan per size made from the schedule of another size."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

import opsched
from opsched.errors import CaptureError, OpschedError, SignatureMismatch
from opsched.runtime.dynamic import (
    check_with_export,
    dense_order,
    dims_from_record,
    dims_record,
    dynamic_dims,
    served_by,
)
from opsched.runtime.guards import call_signature


class Tokens(torch.nn.Module):
    """A small sequence model with two branches (a 1-D convolution and a position-wise MLP) over ``(N, L, C)``:
    its sizes vary along the length ``L``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        a = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(a) + self.mlp(x)).mean(1)


class FixedBatch(torch.nn.Module):
    def forward(self, x):
        return x.view(2, -1).sum(1)


def test_the_forms_of_torch_export_are_read_and_bad_ones_refused_in_one_line():
    x, y = torch.zeros(2, 16, 8), torch.zeros(3)
    length = Dim("length", min=4, max=64)
    assert dynamic_dims(({1: length}, None), (x, y)) == ({1: (4, 64)}, {})
    assert dynamic_dims(((None, length, None), None), (x, y)) == ({1: (4, 64)}, {})
    assert dynamic_dims({"x": {-2: length}}, (x,), Tokens()) == ({1: (4, 64)},)
    assert dynamic_dims(({0: Dim.DYNAMIC},), (x,)) == ({0: (0, math.inf)},)
    assert dynamic_dims(({0: Dim("batch")},), (x,))[0][0][1] == math.inf  # unbounded: torch's own default
    with pytest.raises(OpschedError, match="input 0 dim 1 is 16 in the example, outside its range 32..64"):
        dynamic_dims(({1: Dim("length", min=32, max=64)},), (x,))
    with pytest.raises(OpschedError, match="one entry per input"):
        dynamic_dims(({1: length},), (x, y))
    with pytest.raises(OpschedError, match="has 3 dimensions, not a dimension 3"):
        dynamic_dims(({3: length},), (x,))
    with pytest.raises(OpschedError, match="does not take"):
        dynamic_dims({"tokens": {1: length}}, (x,), Tokens())
    with pytest.raises(OpschedError, match="expected a torch.export.Dim"):
        dynamic_dims(({1: "length"},), (x,))
    assert dims_from_record(dims_record(({1: (4, math.inf)}, {})), "f") == ({1: (4, math.inf)}, {})
    # torch.export's other forms: bounded hints, an int for a static size, nested arguments (one entry per tensor)
    assert dynamic_dims(({1: Dim.DYNAMIC(min=4)},), (x,)) == ({1: (4, math.inf)},)
    assert dynamic_dims(((2, Dim.AUTO(max=64), 8),), (x,)) == ({1: (0, 64)},)
    assert dynamic_dims(({1: length}, None), (x, [y, y])) == ({1: (4, 64)}, {}, {})
    with pytest.raises(OpschedError, match="declared static at 3, the example's is 2"):
        dynamic_dims(((3, None, None),), (x,))
    with pytest.raises(OpschedError, match="input 0 has 3 dimensions, its entry 2"):
        dynamic_dims(((None, length),), (x,))
    with pytest.raises(OpschedError, match="tensor arguments only"):
        dynamic_dims(({0: length},), ([x],))


def _checked(model, inputs, spec):
    return check_with_export(model, inputs, spec, dynamic_dims(spec, inputs, model))


class DataDependent(torch.nn.Module):
    def forward(self, x):
        return x[: int(x.sum().item() > 0) + 1] * 2


def test_torch_export_checks_the_declaration_and_gives_the_ranges_it_found():
    with pytest.raises(CaptureError, match="does not keep those dimensions free"):
        _checked(FixedBatch(), (torch.zeros(2, 5),), ({0: Dim("batch", min=1, max=8)},))
    length = ({1: Dim("length", min=4, max=64)},)
    assert _checked(Tokens(), (torch.zeros(2, 16, 16),), length) == (({1: (4, 64)},), "")
    # a batch of 1 is what torch.export would take for a constant: checked at 2, the range kept from 1
    assert _checked(Tokens(), (torch.zeros(1, 16, 16),), ({0: Dim("batch", min=1, max=8)},)) == (({0: (1, 8)},), "")
    # Dim.AUTO that torch.export makes static is not dynamic (a named Dim there is refused, above)
    assert _checked(FixedBatch(), (torch.zeros(2, 5),), ({0: Dim.AUTO},)) == (({},), "")
    # a model torch.export cannot trace: a note, the declared ranges standing (each size is still verified)
    dims, note = _checked(DataDependent(), (torch.ones(4, 3),), ({1: Dim("width", min=2, max=9)},))
    assert dims == ({1: (2, 9)},) and note.startswith("torch.export could not check dynamic_shapes"), note


def test_which_calls_a_plans_schedule_serves():
    dims = ({1: (4, 64)},)
    planned = call_signature((torch.zeros(2, 16, 8),))
    assert served_by(call_signature((torch.zeros(2, 40, 8),)), planned, dims) == ""
    assert served_by(call_signature((torch.zeros(2, 80, 8),)), planned, dims).endswith("range 4..64")
    assert served_by(call_signature((torch.zeros(3, 16, 8),)), planned, dims) is None  # not declared
    assert served_by(call_signature((torch.zeros(2, 40, 8, dtype=torch.float64),)), planned, dims) is None
    assert served_by(call_signature((torch.zeros(2, 8, 40).transpose(1, 2),)), planned, dims) is None  # layout
    assert served_by(call_signature((torch.zeros(2, 80, 8)[:, ::2],)), planned, dims) is None  # not dense
    # the same sizes in another layout is no call of another size
    assert served_by(call_signature((torch.zeros(2, 8, 1).transpose(1, 2),)), call_signature((torch.zeros(2, 1, 8),)),
                     dims) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False), st.booleans())
def test_dense_order_agrees_with_torch_on_every_layout(shape, rng, sliced):
    # against PyTorch's own test of a dense layout, on tensors laid out in every order, and sliced ones
    order = list(range(len(shape)))
    rng.shuffle(order)
    laid = torch.empty([shape[d] for d in order]).permute([order.index(d) for d in range(len(shape))])
    if sliced:
        laid = torch.empty([shape[d] * 2 for d in order]).permute(
            [order.index(d) for d in range(len(shape))])[tuple(slice(None, None, 2) for _ in shape)]
    found = dense_order(laid.shape, laid.stride())
    assert (found is not None) == _fills_one_block(laid)
    if found is not None:
        assert [d for d in found if shape[d] > 1] == [d for d in order if shape[d] > 1]


def _fills_one_block(t):
    """Brute force: the tensor's elements sit at distinct offsets that fill one block of memory."""
    offsets = sorted(sum(i * s for i, s in zip(index, t.stride())) for index in itertools.product(*map(range, t.shape)))
    return offsets == list(range(offsets[0], offsets[0] + len(offsets)))


def test_a_length_declared_dynamic_gets_a_plan_per_length_from_the_first_schedule(tmp_path):
    torch.manual_seed(0)
    model = Tokens().eval()
    x = torch.randn(2, 16, 16)
    lines = []
    result = opsched.optimize(model, (x,), repeats=3, dynamic_shapes=({1: Dim("length", min=4, max=64)},))
    fast = result.module
    fast.say = lines.append
    with torch.no_grad():
        for length in (24, 40):
            longer = torch.randn(2, length, 16)
            assert opsched.compare.compare_outputs(fast(longer), model(longer)).ok  # the model answers
            fast.wait_for_builds()
            assert opsched.compare.compare_outputs(fast(longer), model(longer)).ok  # its own plan answers
            plan = fast.plans[call_signature((longer,))]
            assert plan.schedule is None or "the schedule made for input 0 (2, 16, 16)" in plan.note, plan.note
            assert set(plan.measured_ms) >= {"eager"}, plan.measured_ms  # timed beside the model
        # out of the range: a plan made as for any new signature, and strict refuses it naming the range
        fast.strict = True
        with pytest.raises(SignatureMismatch, match="dim 1 is 80, outside dynamic_shapes' range 4..64"):
            fast(torch.randn(2, 80, 16))
        # strict serves sizes within the range: the plan is made before answering
        within = torch.randn(2, 8, 16)
        assert opsched.compare.compare_outputs(fast(within), model(within)).ok
        # after a weight change too: the schedules still hold (only the weights changed)
        for p in model.parameters():
            p.mul_(0.9)
        other = torch.randn(2, 12, 16)
        assert opsched.compare.compare_outputs(fast(other), model(other)).ok
        assert "the schedule made for input 0 (2, 16, 16)" in fast.plans[call_signature((other,))].note
    assert any("(a dynamic dimension)" in line for line in lines), lines
    path = tmp_path / "plan.json"
    result.save(path)
    loaded = opsched.load(path, model, say=lambda line: None)
    # the file holds the plans built from the weights as they are (those from before the change are not written)
    assert loaded.dynamic == fast.dynamic and len(loaded.plans) == sum(not p.stale for p in fast.plans.values())
    loaded.close()
    fast.close()


def test_a_declaration_the_model_contradicts_is_refused_by_optimize():
    with pytest.raises(CaptureError, match="dynamic_shapes"):
        opsched.optimize(FixedBatch(), (torch.zeros(2, 5),), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
