"""ONNX exports kept between runs (:mod:`opsched.runtime.onnx_store`): named by everything the export reads (a
weight changed in place or loaded, another argument shape, dtype or layout, another module setting is another
name), found again by a new process's operator without exporting, checked before use (a stored file that answers
otherwise is exported anew), and the folder kept under its limit, least recently used first."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.small_models import build, onnxruntime_verdict, recipes
from torch import nn

from opsched.graph.capture import capture
from opsched.graph.interpret import all_values
from opsched.runtime import kernels
from opsched.runtime.kernels import OnnxRuntimeOperator
from opsched.runtime.onnx_store import OnnxStore, export_key


class Block(nn.Module):
    def __init__(self, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=stride, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


def _traced(stride=1, seed=0):
    torch.manual_seed(seed)
    return torch.fx.symbolic_trace(Block(stride).eval())


@settings(max_examples=40, deadline=None)
@given(change=st.sampled_from(["weight in place", "through .data", "through numpy", "load_state_dict", "buffer",
                               "stride", "shape", "dtype", "layout", "options", "nothing"]))
def test_the_key_changes_with_everything_the_export_reads_and_only_with_that(change):
    module, x = _traced(), torch.randn(1, 3, 8, 8)
    key = export_key(module, (x,), {"input_names": ["in0"]})
    options, args = {"input_names": ["in0"]}, (torch.randn(1, 3, 8, 8),)  # other values: the same export
    if change == "weight in place":
        with torch.no_grad():
            module.conv.weight[0, 0, 0, 0] += 1e-6
    elif change == "through .data":  # neither bumps the version counter
        module.conv.weight.data[0, 0, 0, 0] = 5.0
    elif change == "through numpy":
        module.conv.bias.detach().numpy()[0] = 5.0
    elif change == "load_state_dict":
        module.load_state_dict(_traced(seed=1).state_dict())
    elif change == "buffer":
        module.norm.running_var.fill_(2.0)
    elif change == "stride":
        module = _traced(stride=2)
    elif change == "shape":
        args = (torch.randn(2, 3, 8, 8),)
    elif change == "dtype":
        module, args = module.double(), (x.double(),)
    elif change == "layout":
        args = (x.contiguous(memory_format=torch.channels_last),)
    elif change == "options":
        options = {"input_names": ["x"]}
    assert (export_key(module, args, options) == key) == (change == "nothing")


def _scaled(x):  # a function of the user's: what it reads (a global, a closure) the key cannot follow
    return x * 2


torch.fx.wrap("_scaled")


class Wrapped(nn.Module):
    def forward(self, x):
        return _scaled(x)


def test_a_module_the_key_cannot_read_is_not_named():
    module, x = _traced(), torch.randn(1, 3, 8, 8)
    assert export_key(module.to("meta"), (x,), {}) is None
    assert export_key(Block(), (x,), {}) is None  # not an FX graph
    assert export_key(torch.fx.symbolic_trace(Wrapped()), (x,), {}) is None


def test_a_nested_graph_s_code_is_in_the_key():
    def outer(activation):
        root = torch.fx.symbolic_trace(nn.Sequential(nn.Identity()))
        root.add_submodule("inner", torch.fx.symbolic_trace(activation))
        return root

    x = torch.randn(1, 3)
    assert export_key(outer(nn.ReLU()), (x,), {}) != export_key(outer(nn.Sigmoid()), (x,), {})


def test_the_folder_keeps_the_most_recently_used_within_its_limit(tmp_path):
    store = OnnxStore(tmp_path, limit=250)
    for k in range(3):
        store.put(f"k{k}", bytes(100))
        os.utime(tmp_path / f"k{k}.onnx", (1000 + k, 1000 + k))
    assert store.get("k0") == bytes(100)  # used now: the most recent
    assert store.evict() == 1
    assert store.get("k1") is None and store.get("k0") and store.get("k2")
    assert store.summary() == {"path": str(tmp_path), "exports": 2, "bytes": 200}
    assert store.clear() == 2 and store.summary()["exports"] == 0


def test_a_folder_that_cannot_be_written_only_means_exporting_again(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = OnnxStore(blocked / "onnx")
    store.put("k", b"data")  # no exception
    assert store.get("k") is None


def _unit_graph(seed=0):
    torch.manual_seed(seed)
    model, x = Block().eval(), torch.randn(1, 3, 8, 8)
    graph = capture(model, (x,))
    return model, x, graph, all_values(graph, [x])


def _compiled(graph, values):
    operator = OnnxRuntimeOperator(values.__getitem__)
    return operator, [operator([node], 1) for node in graph.nodes]


def _run(graph, calls, x):
    values = {graph.inputs[0]: x}
    for node, call in zip(graph.nodes, calls):
        values[node.name] = call(*[values[a] for a in node.args])
    return values[graph.nodes[-1].name]


def test_a_new_operator_finds_the_exports_of_an_earlier_one_without_exporting(monkeypatch):
    pytest.importorskip("onnxruntime")
    model, x, graph, values = _unit_graph()
    _compiled(graph, values)  # its exports stored
    exported = []
    real = kernels.onnx_bytes
    monkeypatch.setattr(kernels, "onnx_bytes", lambda *a, **k: exported.append(1) or real(*a, **k))
    operator, calls = _compiled(graph, values)  # as a new process would: nothing exported in this one
    assert exported == [] and operator.eager_units == []
    with torch.inference_mode():
        torch.testing.assert_close(_run(graph, calls, x), model(x), rtol=1e-4, atol=1e-5)


def test_a_stored_export_that_answers_otherwise_is_exported_anew(monkeypatch):
    """What the key cannot see (here: every export named alike, and the name holding another model's export) is
    caught by running the stored export once against the unit before it is used."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(kernels, "export_key", lambda module, args, options: "same")
    *_, other_graph, other_values = _unit_graph(seed=1)
    _compiled(other_graph, other_values)  # its export stored under the name
    stored = OnnxStore().get("same")
    model, x, graph, values = _unit_graph(seed=0)
    exported = []
    real = kernels.onnx_bytes
    monkeypatch.setattr(kernels, "onnx_bytes", lambda *a, **k: exported.append(1) or real(*a, **k))
    operator, calls = _compiled(graph, values)
    assert exported == [1] and operator.eager_units == []  # exported anew, and on its session
    with torch.inference_mode():
        torch.testing.assert_close(_run(graph, calls, x), model(x), rtol=1e-4, atol=1e-5)
    assert OnnxStore().get("same") not in (None, stored)  # the right export stored in its place


def test_a_stored_export_that_cannot_run_on_the_unit_is_exported_anew(monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(kernels, "export_key", lambda module, args, options: "same")
    OnnxStore().put("same", b"not an ONNX model")
    model, x, graph, values = _unit_graph()
    operator, calls = _compiled(graph, values)
    assert operator.eager_units == []
    with torch.inference_mode():
        torch.testing.assert_close(_run(graph, calls, x), model(x), rtol=1e-4, atol=1e-5)


def test_opsched_cache_counts_and_clears_the_stored_exports(capsys):
    import json

    from opsched.cli import main

    OnnxStore().put("k", b"exported")
    assert main(["cache", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["onnx_exports"]["exports"] == 1
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["onnx_exports_removed"] == 1
    assert main(["cache", "info"]) == 0
    assert "0 ONNX exports" in capsys.readouterr().out


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(recipe=recipes(), method=st.sampled_from(["sequential", "ios"]), regions=st.booleans())
def test_random_models_with_other_weights_never_run_a_stored_export_of_the_first(recipe, method, regions):
    """A random model (views, in-place writes, pools, gates, several inputs and outputs) run on ONNX Runtime, then
    the same model with other weights (the same graph, the same shapes: every name alike but for the weights),
    then the first again, each from the store where it can: each answers as its own model."""
    pytest.importorskip("onnxruntime")
    recipe = {**recipe, "dtype": "float32"}  # (ONNX Runtime's CPU kernels are float32's)
    first, inputs = build(recipe)
    second, _ = build({**recipe, "seed": recipe["seed"] + 1})
    exported = []
    real = kernels.onnx_bytes

    def counted(*args, **options):
        made = real(*args, **options)
        exported.append(1)
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "onnx_bytes", counted)
        for model in (first, second, first):
            exported.clear()
            verdict = onnxruntime_verdict(model, inputs, method, regions)
            assert verdict.ok, verdict.why
    # the first model again: every export from the store (one rejected by the check before use would be made anew)
    assert exported == []


def test_a_stored_export_rejected_is_never_run_even_where_exporting_anew_fails(monkeypatch):
    """The unit stays eager, and a session at another thread count does not take the rejected export either."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(kernels, "export_key", lambda module, args, options: "same")
    *_, other_graph, other_values = _unit_graph(seed=1)
    _compiled(other_graph, other_values)  # its export stored under the name
    model, x, graph, values = _unit_graph(seed=0)

    def fails(*args, **kwargs):
        raise RuntimeError("made up")

    monkeypatch.setattr(kernels, "onnx_bytes", fails)
    operator = OnnxRuntimeOperator(values.__getitem__)
    for threads in (1, 2):
        call = operator([graph.nodes[0]], threads)
        with torch.inference_mode():
            torch.testing.assert_close(call(x), model(x), rtol=1e-4, atol=1e-5)
    assert operator.eager_units


@pytest.mark.parametrize("asked", ["onnxruntime", "auto"])
def test_no_cache_keeps_no_export_and_the_default_keeps_them(asked):
    """``--no-cache`` ("read and write no cache") holds for the exports too."""
    pytest.importorskip("onnxruntime")
    import opsched

    model, x = Block().eval(), torch.randn(1, 3, 8, 8)
    opsched.optimize(model, (x,), kernels=asked, repeats=3, cache=False)
    assert OnnxStore().summary()["exports"] == 0
    opsched.optimize(model, (x,), kernels=asked, repeats=3)
    assert OnnxStore().summary()["exports"] > 0
