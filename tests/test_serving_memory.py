"""What a server's preparation may hold in memory (opsched.serving.memory): kernels chosen only where choosing fits
(``--kernels auto`` holds about 25 times the weights it chooses for), eager kernels and one line otherwise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opsched.serving import memory


def test_weight_bytes_counts_parameters_and_buffers_of_every_model():
    norm = torch.nn.BatchNorm1d(3)  # 6 parameters, 6 buffers of float32 and one int64 count
    assert memory.weight_bytes([torch.nn.Linear(10, 10), norm, object()]) == 110 * 4 + 12 * 4 + 8
    assert memory.weight_bytes([torch.nn.Linear(4, 4).half()]) == 20 * 2


@given(st.integers(0, 10**12), st.integers(0, 10**13))
def test_choice_fits_exactly_where_its_factor_of_the_weights_is_available(weights, available):
    assert memory.fits_kernel_choice(weights, available) == (memory.CHOICE_FACTOR * weights <= available)


def test_kernels_cut_back_to_eager_only_where_auto_would_not_fit(monkeypatch):
    model = torch.nn.Linear(100, 100)  # 40,400 bytes
    monkeypatch.setattr(memory, "available_bytes", lambda: 40_400 * memory.CHOICE_FACTOR)
    assert memory.kernels_that_fit({"kernels": "auto"}, [model], "m") == ({"kernels": "auto"}, "")
    monkeypatch.setattr(memory, "available_bytes", lambda: 40_400 * memory.CHOICE_FACTOR - 1)
    options, note = memory.kernels_that_fit({"repeats": 3}, [model], "m")  # auto is the default
    assert options == {"repeats": 3, "kernels": "eager"}
    assert note.startswith("m: eager kernels: choosing kernels would hold about") and "\n" not in note
    assert memory.kernels_that_fit({"kernels": "onnxruntime"}, [model], "m") == ({"kernels": "onnxruntime"}, "")
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # unknown: assumed to fit
    assert memory.kernels_that_fit({"kernels": "auto"}, [model], "m")[0]["kernels"] == "auto"


def test_a_server_short_of_memory_prepares_its_plans_and_fused_graph_on_eager_kernels(monkeypatch):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from opsched.serving import serve

    monkeypatch.setattr(memory, "available_bytes", lambda: 1)
    torch.manual_seed(0)
    models = {name: (torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval(),
                     (torch.randn(1, 3, 8, 8),)) for name in ("a", "b")}
    said = []
    with serve(models, port=0, block=False, engine="local", max_batch=2,
               optimize_options={"repeats": 3, "cache": False}, say=said.append) as serving:
        assert serving.wait_ready(240)
        for endpoint in serving.endpoints.values():
            assert {plan.schedule.run.kernels for plan in endpoint.module.plans.values()} == {"eager"}
        serving.stop()
    assert sum(": eager kernels: choosing kernels would hold about" in line for line in said) == 3, said
