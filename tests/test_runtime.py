"""The runtime: StreamPrograms, the CPU executor, operator merge, and compiled modules that verify."""

import dataclasses
import os
import sys
import threading
import time

import pytest
import torch

from opsched.cost.simulate import SimulatedGPU
from opsched.cost.table import TableCost
from opsched.errors import OpschedError, VerificationError
from opsched.evaluation import verify
from opsched.graph.capture import capture
from opsched.graph.ir import Graph, Node
from opsched.runtime import make_executor
from opsched.runtime.cpu import CPUExecutor, Gate, UnitFailed
from opsched.runtime.kernels import unit_operator
from opsched.runtime.lowered import Call, LoweredProgram, lower
from opsched.runtime.merge import MergeError, merged_operator
from opsched.runtime.module import OptimizedModule, compile
from opsched.runtime.program import Record, Run, Wait, compile_program, staged_program
from opsched.schedule import DevicesSection, from_stages, from_streams
from opsched.schedulers import make_schedule

ZOO_SMALL = [("inception_v3", 75), ("squeezenet", 64), ("nasnet", 64), ("randwire", 64)]
METHODS = [("sequential", {}), ("greedy", {}), ("lios", {"streams": 3}), ("nimble", {"streams": 4}),
           ("ios", {"max_block_size": 10})]


def diamond() -> Graph:
    return Graph([Node("a", args=("x",), latency=1.0), Node("b", args=("a",), latency=2.0),
                  Node("c", args=("a",), latency=3.0), Node("d", args=("b", "c"), latency=1.0)], inputs=["x"])


def test_staged_program_forks_and_joins_through_stream_zero():
    g = diamond()
    s = from_stages(g, TableCost(g), "t", [("concurrent", [[0]]), ("concurrent", [[1], [2]]), ("concurrent", [[3]])])
    p = compile_program(s, g, cores=2)
    assert [type(step) for step in p.streams[1]] == [Wait, Run, Record]
    assert [type(step) for step in p.streams[0]] == [Run, Record, Run, Wait, Run]
    assert [step.threads for step in p.runs()] == [2, 1, 2, 1]


def test_stream_program_has_events_only_on_cross_stream_edges():
    g = diamond()
    s = from_streams(g, TableCost(g), "t", [[0, 1, 3], [2]])
    p = compile_program(s, g, cores=2)
    assert p.events == 2  # a -> c and c -> d cross streams; a -> b and b -> d do not
    waits = [step for steps in p.streams for step in steps if isinstance(step, Wait)]
    assert len(waits) == 2


def test_stream_program_waits_once_where_the_order_is_already_implied():
    # a -> b -> c and a -> c on three streams: c's stream waits for b, which waited for a, so not for a too
    g = Graph([Node("a", args=("x",), latency=1.0), Node("b", args=("a",), latency=1.0),
               Node("c", args=("a", "b"), latency=1.0)], inputs=["x"])
    p = compile_program(from_streams(g, TableCost(g), "t", [[0], [1], [2]]), g, cores=2)
    assert [type(step) for step in p.streams[2]] == [Wait, Run]
    assert sum(isinstance(step, Wait) for steps in p.streams for step in steps) == 2


def _cpu_devices(*threads: int) -> DevicesSection:
    """A devices section putting stream k on a CPU device of ``threads[k]`` threads."""
    return DevicesSection({"name": "cpus", "devices": [{"name": f"cpu{k}", "kind": "cpu", "threads": t}
                                                       for k, t in enumerate(threads)]})


def test_stream_threads_follow_predicted_concurrency_and_mapped_devices():
    g = diamond()
    s = from_streams(g, TableCost(g), "t", [[0, 1, 3], [2]])
    p = compile_program(s, g, cores=2)
    threads = {g.nodes[run.units[0]].name: run.threads for run in p.runs()}
    assert threads == {"a": 2, "b": 1, "c": 1, "d": 2}  # a and d run alone: every core
    s.devices = _cpu_devices(1, 3)
    threads = {g.nodes[run.units[0]].name: run.threads for run in compile_program(s, g, cores=2).runs()}
    assert threads == {"a": 1, "b": 1, "c": 3, "d": 1}


def test_every_intermediate_is_released_and_outputs_are_kept():
    g = diamond()
    s = from_streams(g, TableCost(g), "t", [[0, 1, 3], [2]])
    p = compile_program(s, g, cores=2)
    released = [slot for run in p.runs() for slot in run.release]
    a, b, c, d = (p.slot(n) for n in "abcd")
    assert sorted(released) == sorted([a, a, b, c])  # a is read on both streams: released once on each
    assert p.readers[a] == 2 and d not in released and p.slot("x") not in released


def _tiny(fail: bool = False) -> tuple[Graph, torch.Tensor]:
    def boom(x):
        raise ValueError("unit failed")

    nodes = [Node("a", args=("x",), run=torch.relu), Node("b", args=("x",), run=boom if fail else torch.neg),
             Node("c", args=("a", "b"), run=torch.add)]
    return Graph(nodes, inputs=["x"]), torch.randn(5)


def test_executor_runs_streams_and_reports_a_failing_unit_without_hanging():
    g, x = _tiny()
    for n in g.nodes:
        n.latency = 1.0
    s = from_stages(g, TableCost(g), "t", [("concurrent", [[0], [1]]), ("concurrent", [[2]])])
    ex = CPUExecutor(compile_program(s, g, 2), unit_operator)
    assert torch.equal(ex(x)[0], torch.relu(x) - x)
    g2, x = _tiny(fail=True)
    for n in g2.nodes:
        n.latency = 1.0
    ex2 = CPUExecutor(compile_program(from_stages(g2, TableCost(g2), "t", [("concurrent", [[0], [1]]),
                                                                          ("concurrent", [[2]])]), g2, 2),
                      unit_operator)
    with pytest.raises(UnitFailed, match="unit 'b' failed: ValueError: unit failed"):
        ex2(x)
    assert torch.equal(ex(x)[0], torch.relu(x) - x)  # the other executor is unaffected


def test_executor_is_safe_to_call_from_several_threads():
    g, _ = _tiny()
    for n in g.nodes:
        n.latency = 1.0
    s = from_stages(g, TableCost(g), "t", [("concurrent", [[0], [1]]), ("concurrent", [[2]])])
    ex = CPUExecutor(compile_program(s, g, 2), unit_operator)
    errors = []

    def worker(seed):
        x = torch.randn(50, generator=torch.Generator().manual_seed(seed))
        for _ in range(50):
            if not torch.equal(ex(x)[0], torch.relu(x) - x):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _gnu_openmp() -> bool:
    """PyTorch runs on GNU OpenMP (libgomp) here, whose pools are per thread; Linux, where /proc counts them."""
    try:
        with open("/proc/self/maps") as maps:
            return "libgomp" in maps.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _gnu_openmp(),
                    reason="counts GNU OpenMP's per-thread pools through /proc")
def test_a_worker_that_ran_several_threads_leaves_no_openmp_pool_behind():
    # With GNU OpenMP, a thread that opened a 2-thread parallel region keeps a pool thread while it lives, and
    # pools holding more threads than cores make every later parallel region wait for sleeping threads (1.5x
    # slower eager SqueezeNet, measured). Such a worker must be gone once the call returns.
    g = Graph([Node("a", args=("x",), run=torch.exp), Node("b", args=("x",), run=torch.neg),
               Node("c", args=("a", "b"), run=torch.add)], inputs=["x"])
    for n in g.nodes:
        n.latency = 1.0
    s = from_streams(g, TableCost(g), "t", [[1, 2], [0]])
    s.devices = _cpu_devices(1, 2)  # exp runs on the worker, on 2 threads
    program = compile_program(s, g, cores=2)
    assert [run.threads for run in program.streams[1] if isinstance(run, Run)] == [2]
    ex = CPUExecutor(program, unit_operator)
    x = torch.randn(1 << 22)
    expected = torch.exp(x) - x  # on this thread's own OpenMP pool, made now if it had none
    # the threads this test makes: those alive now that were not before (a thread of an earlier test ending
    # meanwhile, Ray's or a builder's, is no thread of ours)
    before = set(os.listdir("/proc/self/task"))
    made = lambda: set(os.listdir("/proc/self/task")) - before
    for _ in range(3):
        assert torch.allclose(ex(x)[0], expected)
    deadline = time.monotonic() + 5
    while len(made()) > 1 and time.monotonic() < deadline:  # a retired worker may be exiting
        time.sleep(0.01)
    assert len(made()) == 1  # one idle worker, with no OpenMP pool
    ex.close()


def test_timeline_records_every_unit():
    g, x = _tiny()
    for n in g.nodes:
        n.latency = 1.0
    s = make_schedule("greedy", g, TableCost(g))
    ex = CPUExecutor(compile_program(s, g, 2), unit_operator)
    ex(x, record_timeline=True)
    assert sorted(u for _, units, _, _ in ex.timeline for u in units) == [0, 1, 2]
    assert all(0 <= start <= finish for _, _, start, finish in ex.timeline)


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Conv2d(8, 4, 1, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Conv2d(8, 6, 5, padding=2, bias=False), torch.nn.BatchNorm2d(6),
                                     torch.nn.ReLU())
        self.c = torch.nn.Sequential(torch.nn.Conv2d(8, 3, 3, padding=1), torch.nn.ReLU())
        self.d = torch.nn.Conv2d(8, 3, 3, padding=1)  # no activation: cannot merge with the others

    def forward(self, x):
        x = torch.relu(x)
        return self.a(x), self.b(x), self.c(x), self.d(x)


def test_merge_folds_batch_norm_pads_kernels_and_matches_the_units():
    torch.manual_seed(0)
    m = _Branches()
    for bn in (m.a[1], m.b[1]):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
    m.eval()
    x = torch.randn(2, 8, 9, 9)
    g = capture(m, (x,))
    convs = [g.nodes[g.index[n]] for n in ("a.0", "b.0", "c.0")]
    h = g.nodes[0].run(x)
    with torch.no_grad():
        outs = merged_operator(convs)(h)
        for node, out in zip(convs, outs):
            assert torch.allclose(out, node.run(h), atol=1e-5)
    with pytest.raises(MergeError):
        merged_operator([convs[0], g.nodes[g.index["d"]]])


@pytest.fixture(scope="module")
def zoo_small(zoo_captured):
    return {name: zoo_captured(name, 1, size) for name, size in ZOO_SMALL}


@pytest.mark.parametrize("name", [n for n, _ in ZOO_SMALL])
def test_every_scheduler_executes_and_verifies_on_every_zoo_model(zoo_small, name):
    m, g = zoo_small[name]
    cost = SimulatedGPU(g, "v100")  # an analytical cost: quick, and it chooses merges
    merges = 0
    for method, options in METHODS:
        s = make_schedule(method, g, cost, **options)
        merges += sum(st.strategy == "merge" for st in s.stages or [])
        check = verify(OptimizedModule(g, s, cores=2), m.model, m.inputs)
        assert check.ok, (method, check)
    if name == "inception_v3":
        assert merges > 0  # the merge path really ran


def test_compile_from_a_model_and_verify_strictly():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    g = capture(model, (x,))
    fast = compile(model, make_schedule("sequential", g, SimulatedGPU(g, "t4")), example_inputs=(x,))
    assert verify(fast, model, (x,), strict=True).ok
    wrong = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    with pytest.raises(VerificationError, match="differ"):
        verify(fast, wrong, (x,), strict=True)


def test_dag_json_graphs_cannot_be_compiled():
    g = diamond()
    with pytest.raises(Exception, match="no operator"):
        OptimizedModule(g, make_schedule("sequential", g, TableCost(g)))


def test_inductor_units_compute_what_the_eager_units_do():
    """One compilation per unit and thread count (a few seconds): the compiled units give eager's values,
    and compiling leaves the unit's own graph as it was."""
    from opsched.graph.interpret import all_values
    from opsched.runtime.kernels import InductorOperator

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    g = capture(model, (x,))
    operator = InductorOperator(all_values(g, [x]).__getitem__)
    compiled = operator([g.nodes[0]], 1)
    assert operator([g.nodes[0]], 1) is compiled  # memoised
    with torch.inference_mode():
        assert torch.allclose(compiled(x), model(x), atol=1e-5)
        assert isinstance(g.nodes[0].run(x), torch.Tensor)
    assert operator.compile_seconds > 0


def test_a_device_with_no_units_does_not_shift_the_threads_of_the_next():
    g = diamond()
    s = from_streams(g, TableCost(g), "t", [[0, 1, 3], [], [2]])
    s.devices = _cpu_devices(1, 5, 3)
    threads = {g.nodes[run.units[0]].name: run.threads for run in compile_program(s, g, cores=2).runs()}
    assert threads == {"a": 1, "b": 1, "c": 3, "d": 1}


def _names(nodes, threads):
    """An operator whose callable is what it was asked for, so that lowered steps compare by value."""
    return tuple(n.name for n in nodes), threads


def test_lowering_a_staged_program_makes_calls_records_and_waits():
    g = diamond()
    s = from_stages(g, TableCost(g), "t", [("concurrent", [[0]]), ("concurrent", [[1], [2]]), ("concurrent", [[3]])])
    lowered = lower(compile_program(s, g, cores=2), _names)
    # slots: x 0, a 1, b 2, c 3, d 4; a is read on both streams, so each releases it once
    assert lowered == LoweredProgram(
        streams=((Call((("a",), 2), reads=(0,), writes=(1,), release=(), threads=2, units=(0,), name="a"),
                  Record(0),
                  Call((("b",), 1), reads=(1,), writes=(2,), release=(1,), threads=1, units=(1,), name="b"),
                  Wait(1),
                  Call((("d",), 2), reads=(2, 3), writes=(4,), release=(2, 3), threads=2, units=(3,), name="d")),
                 (Wait(0),
                  Call((("c",), 1), reads=(1,), writes=(3,), release=(1,), threads=1, units=(2,), name="c"),
                  Record(1))),
        events=2, inputs=1, slots=5, readers=(0, 2, 1, 1, 0), outputs=(4,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lowered.streams[0][0].release = ()
    merged = lower(staged_program(g, [("concurrent", [[0]]), ("merge", [[1], [2]]), ("concurrent", [[3]])], cores=2),
                   _names)
    assert merged.calls(0)[1] == Call((("b", "c"), 2), reads=(1,), writes=(2, 3), release=(1,), threads=2,
                                      units=(1, 2), name="b+c")


def _exp_neg_add() -> Graph:
    g = Graph([Node("a", args=("x",), run=torch.exp), Node("b", args=("x",), run=torch.neg),
               Node("c", args=("a", "b"), run=torch.add)], inputs=["x"])
    for n in g.nodes:
        n.latency = 1.0
    return g


def test_lowering_a_stream_program_makes_calls_records_and_waits():
    g = _exp_neg_add()
    lowered = lower(compile_program(from_streams(g, TableCost(g), "t", [[0, 2], [1]]), g, cores=1), _names)
    assert lowered == LoweredProgram(
        streams=((Call((("a",), 1), reads=(0,), writes=(1,), release=(), threads=1, units=(0,), name="a"),
                  Wait(0),
                  Call((("c",), 1), reads=(1, 2), writes=(3,), release=(1, 2), threads=1, units=(2,), name="c")),
                 (Call((("b",), 1), reads=(0,), writes=(2,), release=(), threads=1, units=(1,), name="b"),
                  Record(0))),
        events=1, inputs=1, slots=4, readers=(0, 1, 1, 0), outputs=(3,))
    with pytest.raises(ValueError, match="the program takes 1 inputs, got 2"):
        lowered.start([1, 2])


def test_make_executor_with_a_cpu_thread_per_stream_is_the_cpu_executor():
    g = _exp_neg_add()
    program = compile_program(from_streams(g, TableCost(g), "t", [[0, 2], [1]]), g, cores=2)
    x = torch.randn(4)
    by_stream = make_executor(program, unit_operator, [None, None])  # a device per stream, all CPU threads
    by_name = make_executor(program, unit_operator, "cpu")
    assert isinstance(by_stream, CPUExecutor)
    with torch.inference_mode():
        assert torch.equal(by_stream(x)[0], by_name(x)[0])
        assert torch.allclose(by_stream(x)[0], x.exp() - x)
    by_stream.close()
    by_name.close()
    with pytest.raises(OpschedError, match="the program has 2 streams, but 3 devices were given"):
        make_executor(program, unit_operator, [None, None, None])


def test_a_gate_lets_every_waiter_through_once_set_and_setting_it_twice_is_harmless():
    gate = Gate()
    through = []
    waiters = [threading.Thread(target=lambda k=k: (gate.wait(), through.append(k))) for k in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    assert through == []  # closed until set
    gate.set()
    gate.set()  # a failing stream opens every gate, one maybe opened already
    for w in waiters:
        w.join(timeout=5)
    assert sorted(through) == [0, 1, 2, 3]
    gate.wait()  # open for good


def test_every_stream_runs_in_the_callers_autocast():
    # autocast is thread-local: a branch on a worker thread ran in float32 while the caller's ran in bfloat16
    from opsched.graph.capture import capture
    from opsched.runtime.module import OptimizedModule

    class TwoBranches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.a(x), self.b(x)

    model, x = TwoBranches().eval(), torch.randn(4, 16)
    graph = capture(model, (x,))
    for n in graph.nodes:
        n.latency = 1.0
    plan = from_streams(graph, TableCost(graph), "two", [[0], [1]])
    module = OptimizedModule(graph, plan, 2)
    assert len(module.program.streams) == 2
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, want = module.run([x]), model(x)
    assert [g.dtype for g in got] == [w.dtype for w in want] == [torch.bfloat16] * 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    module.close()
