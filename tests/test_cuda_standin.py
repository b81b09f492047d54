"""The CUDA stand-in (tests/cuda_standin.py) itself: each rule it enforces raises when broken, so that the
CUDA backend passing through it means something."""

import pytest
import torch
from cuda_standin import BrokenRule, CudaStandIn


def test_waiting_on_an_event_never_recorded_raises():
    cuda = CudaStandIn()
    with pytest.raises(BrokenRule, match="never recorded"):
        cuda.wait(cuda.new_stream(), cuda.new_event())


def test_events_have_no_order():
    cuda = CudaStandIn()
    a, b = cuda.new_event(timing=True), cuda.new_event(timing=True)
    cuda.record(a, cuda.current_stream())
    cuda.record(b, cuda.current_stream())
    with pytest.raises(TypeError):
        min(a, b)
    with pytest.raises(TypeError):
        a < b  # noqa: B015 - the comparison itself must raise


def test_reading_another_streams_tensor_without_waiting_is_a_race():
    cuda = CudaStandIn()
    side = cuda.new_stream()
    with cuda.use_stream(cuda.current_stream()):
        y = torch.ones(3) * 2
    with cuda.use_stream(side), pytest.raises(BrokenRule, match="race"):
        y + 1
    fork = cuda.new_event()
    cuda.record(fork, cuda.current_stream())
    cuda.wait(side, fork)
    with cuda.use_stream(side):
        y + 1  # ordered now


def _read_on_side_stream(cuda):
    """A tensor made on the current stream and read on a side stream (after a proper wait)."""
    side = cuda.new_stream()
    with cuda.use_stream(cuda.current_stream()):
        y = torch.ones(3) * 2
    fork = cuda.new_event()
    cuda.record(fork, cuda.current_stream())
    cuda.wait(side, fork)
    with cuda.use_stream(side):
        z = y + 1
    return side, y, z


def test_freeing_a_tensor_read_on_another_stream_needs_record_stream_or_an_event():
    cuda = CudaStandIn()
    _, y, _ = _read_on_side_stream(cuda)
    del y
    with pytest.raises(BrokenRule, match="freed without record_stream"):
        cuda.check()

    cuda = CudaStandIn()
    side, y, _ = _read_on_side_stream(cuda)
    cuda.record_stream(y, side)
    del y
    cuda.check()

    cuda = CudaStandIn()
    side, y, _ = _read_on_side_stream(cuda)
    done = cuda.new_event()
    cuda.record(done, side)
    cuda.wait(cuda.current_stream(), done)  # the allocating stream waits for the read: safe to reuse
    del y
    cuda.check()


def test_capture_needs_side_streams_forked_from_and_joined_back_to_the_capture_stream():
    cuda = CudaStandIn()
    side = cuda.new_stream()
    x = torch.ones(3)
    with pytest.raises(BrokenRule, match="without having forked"), cuda.capture(cuda.new_graph()), \
            cuda.use_stream(side):
        x + 1

    before = cuda.new_event()
    cuda.record(before, cuda.current_stream())
    with pytest.raises(BrokenRule, match="recorded outside the capture"), cuda.capture(cuda.new_graph()):
        cuda.wait(side, before)

    with pytest.raises(BrokenRule, match="not joined back"), cuda.capture(cuda.new_graph()):
        fork = cuda.new_event()
        cuda.record(fork, cuda.current_stream())
        cuda.wait(side, fork)
        with cuda.use_stream(side):
            x + 1

    graph = cuda.new_graph()
    with cuda.capture(graph):
        fork = cuda.new_event()
        cuda.record(fork, cuda.current_stream())
        cuda.wait(side, fork)
        with cuda.use_stream(side):
            y = x + 1
        join = cuda.new_event()
        cuda.record(join, side)
        cuda.wait(cuda.current_stream(), join)
    x.fill_(5)
    cuda.replay(graph)
    assert y.tolist() == [6.0, 6.0, 6.0]  # replay recomputes into the captured memory


def test_capture_forbids_synchronising_and_timing_and_nesting():
    cuda = CudaStandIn()
    a, b = cuda.new_event(timing=True), cuda.new_event(timing=True)
    with pytest.raises(BrokenRule, match="synchronize during graph capture"), cuda.capture(cuda.new_graph()):
        cuda.synchronize()
    with pytest.raises(BrokenRule, match="event times read during graph capture"), cuda.capture(cuda.new_graph()):
        cuda.elapsed_ms(a, b)
    with pytest.raises(BrokenRule, match="inside a graph capture"), cuda.capture(cuda.new_graph()), \
            cuda.capture(cuda.new_graph()):
        pass
    with pytest.raises(BrokenRule, match="never captured"):
        cuda.replay(cuda.new_graph())


def test_event_times_need_timing_events_recorded_and_completed():
    cuda = CudaStandIn()
    stream = cuda.current_stream()
    plain, a, b = cuda.new_event(), cuda.new_event(timing=True), cuda.new_event(timing=True)
    with pytest.raises(BrokenRule, match="never recorded"):
        cuda.elapsed_ms(a, b)
    cuda.record(plain, stream)
    cuda.record(a, stream)
    cuda.record(b, stream)
    with pytest.raises(BrokenRule, match="without timing"):
        cuda.elapsed_ms(plain, b)
    with pytest.raises(BrokenRule, match="no synchronize"):
        cuda.elapsed_ms(a, b)
    cuda.synchronize()
    assert cuda.elapsed_ms(a, b) >= 0


def test_a_graph_keeping_an_inference_tensor_is_refused():
    cuda = CudaStandIn()
    with torch.inference_mode():
        static = torch.ones(3)
    with pytest.raises(BrokenRule, match="inference tensor"), cuda.capture(cuda.new_graph()):
        static + 1


def test_on_meta_a_tensor_created_on_the_cpu_is_caught():
    cuda = CudaStandIn("meta")
    x = torch.ones(3, device="meta")
    with cuda.use_stream(cuda.current_stream()):
        x + torch.tensor(1.0)  # a CPU scalar is fine, as on CUDA
        with pytest.raises(BrokenRule, match="on cpu"):
            torch.zeros(3).sum()


def test_streams_of_another_device_are_refused():
    with pytest.raises(TypeError), CudaStandIn().use_stream(CudaStandIn().new_stream()):
        pass


def test_the_caller_reading_outputs_needs_them_joined_back():
    cuda = CudaStandIn()
    side = cuda.new_stream()
    with cuda.use_stream(side):
        y = torch.ones(2) * 3
    with pytest.raises(BrokenRule, match="race"):
        cuda.assert_ready(y)
