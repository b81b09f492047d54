"""Units on ONNX Runtime sessions (``--kernels onnxruntime``): every schedule, with units and with compiled
regions, gives eager's outputs; a unit ONNX cannot take runs eagerly and is named; each session has the
step's threads."""

import pytest
import torch
from support.small_models import ChannelSplit, unit_costed
from torch import nn

from opsched.cost.table import TableCost
from opsched.graph.capture import capture
from opsched.graph.interpret import all_values
from opsched.runtime.kernels import OnnxRuntimeOperator, kernels_for
from opsched.runtime.module import OptimizedModule
from opsched.runtime.regions import compiled_regions
from opsched.schedulers import SCHEDULERS, make_schedule

ort = pytest.importorskip("onnxruntime")


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, k, padding=k // 2), nn.BatchNorm2d(8), nn.ReLU())
                                      for k in (1, 3, 5))
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.head = nn.Linear(24 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.pool(torch.cat([b(x) for b in self.branches], 1))
        return self.head(y.flatten(1)).softmax(-1), y.mean()


def _setup():
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    return model, x, unit_costed(model, x)


@pytest.mark.parametrize("method", sorted(SCHEDULERS))
@pytest.mark.parametrize("regions", [False, True])
def test_every_schedule_on_onnxruntime_sessions_equals_eager(method, regions):
    model, x, graph = _setup()
    options = {"streams": 2} if method in ("lios", "nimble", "exact", "hivemind") else {}
    plan = make_schedule(method, graph, TableCost(graph), **options)
    if regions:
        graph, plan = compiled_regions(graph, plan)
    operator = OnnxRuntimeOperator(all_values(graph, [x]).__getitem__)
    module = OptimizedModule(graph, plan, 2, operator)
    with torch.inference_mode():
        got, want = module(x), model(x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert operator.eager_units == []
    module.close()


def test_a_unit_onnx_cannot_take_runs_eagerly_and_is_named():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.special.i1e(x) + 1  # no ONNX export for the modified Bessel function

    x = torch.randn(4, 5)
    graph = capture(Odd().eval(), (x,))
    for n in graph.nodes:
        n.latency = 1.0
    operator = kernels_for(graph, "onnxruntime", example=all_values(graph, [x]).__getitem__)
    plan = make_schedule("sequential", graph, TableCost(graph))
    with torch.inference_mode():
        got = OptimizedModule(graph, plan, 1, operator)(x)
    torch.testing.assert_close(got, torch.special.i1e(x) + 1)
    assert operator.eager_units == [graph.nodes[0].name]


@pytest.mark.parametrize("regions", [False, True])
def test_a_batch_norm_of_no_convolution_runs_on_its_session(regions):
    # RepVGG's block normalises its input itself, a batch norm that folds into no convolution; captured as
    # aten._native_batch_norm_legit_no_training, which the ONNX exporter refused: every unit holding one stayed
    # eager (timm's RepVGG-A0: no block on ONNX Runtime, 1.62x the time of ONNX Runtime's session)
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    block = timm.create_model("repvgg_a0").stages[0][1].eval()
    for norm in block.modules():
        if isinstance(norm, nn.BatchNorm2d):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2)
            nn.init.normal_(norm.weight)
            nn.init.normal_(norm.bias)
    x = torch.randn(2, 48, 8, 8)
    graph = capture(block, (x,))
    assert any(m.target is torch.ops.aten._native_batch_norm_legit_no_training.default
               for n in graph.nodes for m in n.run.graph.nodes)
    for n in graph.nodes:
        n.latency = 1.0
    plan = make_schedule("sequential", graph, TableCost(graph))
    if regions:
        graph, plan = compiled_regions(graph, plan)
    operator = OnnxRuntimeOperator(all_values(graph, [x]).__getitem__)
    with torch.inference_mode():
        got, want = OptimizedModule(graph, plan, 1, operator)(x), block(x)
    assert operator.eager_units == [] and operator.why_eager == {}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_each_session_has_the_threads_of_its_step(monkeypatch):
    made = []
    real = ort.InferenceSession

    def spy(model, options, **kw):
        made.append(options.intra_op_num_threads)
        return real(model, options, **kw)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    _, x, graph = _setup()
    operator = OnnxRuntimeOperator(all_values(graph, [x]).__getitem__)
    node = graph.nodes[0]
    a, b = operator([node], 1), operator([node], 2)
    assert made == [1, 2] and a is not b and operator([node], 2) is b  # one session a unit and thread count


def test_max_pools_go_back_to_the_kernel_for_onnx_and_give_the_same_values():
    from opsched.graph.maxpool import max_pool2d_by_slices, max_pools_by_kernel

    model = nn.Sequential(nn.Conv2d(3, 32, 1), nn.MaxPool2d(3, 2, 1, ceil_mode=True)).eval()
    x = torch.randn(1, 3, 64, 64)
    graph = capture(model, (x,))
    gm = next(n.run for n in graph.nodes if any(m.target is max_pool2d_by_slices for m in n.run.graph.nodes))
    back = max_pools_by_kernel(gm)
    targets = [m.target for m in back.graph.nodes]
    assert torch.ops.aten.max_pool2d.default in targets and max_pool2d_by_slices not in targets
    assert any(m.target is max_pool2d_by_slices for m in gm.graph.nodes)  # the unit itself is unchanged
    args = [all_values(graph, [x])[a] for a in graph.nodes[[n.run for n in graph.nodes].index(gm)].args]
    assert torch.equal(back(*args), gm(*args))


def test_the_measured_cost_model_prices_blocks_as_regions_and_ios_plans_with_them(tmp_path, monkeypatch):
    import opsched.cost.measure as measure_module
    from opsched.cost.cache import LatencyCache
    from opsched.graph.blocks import split_blocks
    from opsched.runtime.profile import measured_cost

    # the second model must read the cache, however busy the machine was at the first (a cached profile far
    # slower than the graph timed now is measured again, and a one-unit region's price with it)
    monkeypatch.setattr(measure_module, "CACHE_DISAGREEMENT", float("inf"))

    model, x, graph = _setup()
    cache = LatencyCache(tmp_path / "c.sqlite")
    values = all_values(graph, [x])
    cost = measured_cost(graph, [x], cores=2, kernels=kernels_for(graph, "onnxruntime", example=values.__getitem__),
                        cache=cache, repeats=3, values=values)
    blocks = [list(b.units) for b in split_blocks(graph)]
    priced = cost.region_latencies(blocks)
    assert all(ms > 0 for ms in priced) and cost.counts["regions_measured"] == sum(len(b) > 1 for b in blocks)
    assert [priced[k] for k, b in enumerate(blocks) if len(b) == 1] == [cost.op_latency(b[0]) for b in blocks
                                                                         if len(b) == 1]
    plan = make_schedule("ios", graph, cost)
    assert plan.bounds["lower_bound"] <= plan.predicted_latency
    if plan.run.regions:  # each one-group stage is priced as the region it runs as
        one_group = [st for st in plan.stages if len(st.groups) == 1 and st.strategy == "concurrent"]
        assert all(tuple(graph.index[u] for u in st.groups[0]) in cost.regions for st in one_group)
    module = OptimizedModule(graph, plan, 2, cost.runs.kernels)
    with torch.inference_mode():
        for a, b in zip(module(x), model(x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    module.close()
    again = measured_cost(graph, [x], cores=2, kernels=kernels_for(graph, "onnxruntime", example=values.__getitem__),
                         cache=cache, repeats=3, values=values)
    assert again.region_latencies(blocks) == priced and again.counts["regions_measured"] == 0


def test_eager_kernels_price_no_regions():
    from opsched.runtime.profile import measured_cost

    _, x, graph = _setup()
    cost = measured_cost(graph, [x], cores=2, cache=False, repeats=2)
    assert cost.region_latencies([list(range(len(graph)))]) is None
    assert "regions" not in make_schedule("ios", graph, cost).options


def test_a_unit_reading_a_list_or_part_of_one_runs_on_its_session():
    # ShuffleNet V2 x0.5 failed here ("'list' object has no attribute 'detach'"): the session was fed the list
    model = ChannelSplit().eval()
    x = torch.randn(1, 8, 6, 6)
    graph = capture(model, (x,))
    for n in graph.nodes:
        n.latency = 1.0
    reads_a_list = [n.name for n in graph.nodes
                    if any(isinstance(v, (list, tuple)) for v in (all_values(graph, [x])[a] for a in n.args))]
    operator = OnnxRuntimeOperator(all_values(graph, [x]).__getitem__)
    module = OptimizedModule(graph, make_schedule("sequential", graph, TableCost(graph)), 1, operator)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)
    assert reads_a_list and operator.eager_units == []  # the case is here, on sessions
    module.close()
