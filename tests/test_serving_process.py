"""opsched serve --engine process: the models in a process of their own, behind the same Open Inference Protocol
front end, driven by the official client; answers exactly the models', errors as the local engine gives them, the
models' process gone once the server stops, and on its death its requests answered 500 rather than hung on and a new
process started (within limits). Skipped without the ``serve`` extra."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("cloudpickle")

from opsched.compare import compare_outputs
from opsched.errors import OpschedError
from opsched.serving import serve
from opsched.serving.batcher import ModelEndpoint
from opsched.serving.process_engine import (
    Channel,
    ProcessEndpoint,
    _portable,
    _rebuilt,
    frame,
    from_wire,
    to_wire,
)
from opsched.serving.protocol import DATATYPES
from tests.support.served_models import RefusesLarge, Unpicklable, client_answers_are_the_models


class Sleeps(torch.nn.Module):
    """Sleeps ``seconds`` a call of inputs holding a 1 or more (startup's calls, on zeros and the batching check's
    second sample made from them, do not wait), then answers its input plus one and the process it ran in."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if (x >= 1).any():
            time.sleep(self.seconds)
        return x + 1, torch.full((x.shape[0], 1), os.getpid(), dtype=torch.int64)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(DATATYPES)), st.lists(st.integers(0, 3), max_size=3), st.booleans(), st.integers(0, 9))
def test_every_datatype_and_shape_crosses_between_the_processes_unchanged(datatype, shape, transposed, seed):
    dtype = DATATYPES[datatype]
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 1000
    tensor = values > 0 if dtype == torch.bool else values.to(dtype)
    if transposed and tensor.dim() >= 2:  # a view that is not contiguous travels as its values
        tensor = tensor.transpose(0, 1)
    wire = to_wire(tensor)
    back = from_wire(wire)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    before = tensor.clone()
    back.fill_(0)  # writable, and its own memory
    assert torch.equal(tensor, before)


def test_an_error_crosses_as_itself_or_by_its_name_and_message():
    assert repr(_rebuilt(*_portable(ValueError("v")))) == repr(ValueError("v"))
    cannot_pickle = _rebuilt(*_portable(Unpicklable("held")))
    unreadable_here = _rebuilt(b"a class this process cannot import", "ModelError", "went wrong")
    for error, name, text in ((cannot_pickle, "Unpicklable", "held"), (unreadable_here, "ModelError", "went wrong")):
        assert isinstance(error, OpschedError) and type(error).__name__ == name and str(error) == text


def test_the_blocking_end_reads_each_message_and_nothing_after_it():
    """What follows the messages the server reads at startup is its event loop's: not one byte read ahead."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frame("say", "preparing") + frame("started", {"m": 1}) + frame("ready"))
        channel = Channel(ours)
        assert channel.receive() == ("say", "preparing") and channel.receive() == ("started", {"m": 1})
        ours.setblocking(False)
        assert ours.recv(1 << 16) == frame("ready")  # left whole in the socket


def test_the_models_process_answers_behind_the_same_front_end():
    http = pytest.importorskip("tritonclient.http")
    httpx = pytest.importorskip("httpx")
    cnn, refuses = RefusesLarge().net.eval(), RefusesLarge().eval()  # the first with plans, the second answers itself
    said = []
    models = {"cnn": (cnn, (torch.randn(1, 3, 16, 16),)), "refuses": (refuses, (torch.randn(1, 3, 16, 16),)),
              "sleeps": (Sleeps(0.3), (torch.zeros(1, 2),))}
    with serve(models, port=0, block=False, engine="process", max_batch=4, max_delay_ms=5, queue_size=8,
               optimize_options={"repeats": 3, "cache": False}, say=said.append) as serving:
        assert serving.wait_ready(240)
        assert all(isinstance(e, ProcessEndpoint) for e in serving.endpoints.values())
        assert serving.endpoints["cnn"].batchable and serving.endpoints["cnn"].max_batch == 4
        client = http.InferenceServerClient(serving.url.removeprefix("http://"))
        assert client.is_server_ready() and client.is_model_ready("cnn")
        assert client.get_model_metadata("refuses")["inputs"] == [{"name": "x", "datatype": "FP32",
                                                                   "shape": [-1, 3, 16, 16]}]
        client_answers_are_the_models(client, "cnn", "input", cnn, (1, 3, 4))

        def infer(model, body):
            return httpx.post(f"{serving.url}/v2/models/{model}/infer", content=body, timeout=60)

        def body(data, shape=(1, 3, 16, 16), name="x"):
            return json.dumps({"inputs": [{"name": name, "shape": list(shape), "datatype": "FP32", "data": data}]})

        inputs = [torch.randn(1, 3, 16, 16) for _ in range(16)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda x: infer("cnn", body(x.flatten().tolist(), name="input")), inputs))
        for x, answer in zip(inputs, answers):
            assert answer.status_code == 200, answer.text
            got = torch.tensor(answer.json()["outputs"][0]["data"]).reshape(1, 4)
            assert compare_outputs(got, cnn(x).detach()).ok

        good = body([1] * 768)
        failed = infer("refuses", body([500] + [1] * 767))
        assert failed.status_code == 500 and failed.json() == {"error": "model 'refuses' failed: ValueError: input "
                                                                        "above 100"}
        failed = infer("refuses", body([-500] + [1] * 767))  # its name and message, as the local engine gives them
        assert failed.status_code == 500 and failed.json() == {"error": "model 'refuses' failed: Unpicklable: input "
                                                                        "below -100"}
        assert infer("refuses", good.replace('"FP32"', '"INT64"')).json()["error"] == \
            "input 'x' of 'refuses' is FP32, not INT64"
        assert infer("nope", good).status_code == 404
        assert infer("refuses", good).status_code == 200  # still serving

        # the sleeping model (a call of up to 4 takes 0.3 s) queues 8: of 20 requests at once, some are refused at once
        # with 503, and every accepted one is answered, by the models' process
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: infer("sleeps", body([1, 1], (1, 2))), range(20)))
        codes = [a.status_code for a in answers]
        assert set(codes) == {200, 503} and codes.count(200) >= 3, codes
        assert all("has 8 requests waiting" in a.json()["error"] for a in answers if a.status_code == 503)
        pids = {a.json()["outputs"][1]["data"][0] for a in answers if a.status_code == 200}
        assert pids == {serving_pid(serving)}
        assert serving_pid(serving) != os.getpid()
    assert serving_process(serving).poll() == 0  # answered what it had and ended
    assert {"cnn: ready", "ready"} <= set(said), "\n".join(said)  # what the local engine says, through its say


def serving_process(serving):
    return next(iter(serving.endpoints.values())).models.process


def serving_pid(serving):
    return serving_process(serving).pid


def test_models_larger_than_the_sockets_buffer_reach_their_process():
    """21 MB of weights: the models' process reads them only once it has imported torch, long after the socket's
    buffer is full."""
    torch.manual_seed(0)
    big = torch.nn.Linear(2048, 2560)
    with serve({"big": (big, (torch.zeros(1, 2048),))}, port=0, block=False, engine="process", optimize=False,
               say=lambda text: None) as serving:
        assert serving.wait_ready(120)
        x = torch.randn(1, 2048)
        client = pytest.importorskip("httpx")
        body = {"inputs": [{"name": "input", "shape": [1, 2048], "datatype": "FP32", "data": x.flatten().tolist()}]}
        answer = client.post(f"{serving.url}/v2/models/big/infer", json=body, timeout=60)
        got = torch.tensor(answer.json()["outputs"][0]["data"]).reshape(1, 2560)
        assert compare_outputs(got, big(x).detach()).ok


def _models_processes() -> list[int]:
    """The pids of this process's children that run a models' process (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                command = cmdline.read()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"opsched.serving.process_engine" in command:
            found.append(int(entry))
    return found


SLEEPS_BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 1]}]})


def _killed_with_a_request_in_it(serving, httpx):
    """SIGKILL the models' process while it runs a request; that request's answer."""
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{serving.url}/v2/models/sleeps/infer", content=SLEEPS_BODY, timeout=60)
        time.sleep(0.5)  # accepted, and running there
        os.kill(serving_pid(serving), signal.SIGKILL)
        return waiting.result()


def test_when_the_models_process_dies_its_requests_get_500_and_it_is_started_again():
    httpx = pytest.importorskip("httpx")
    said = []
    models = {"sleeps": (Sleeps(0.8), (torch.zeros(1, 2),))}
    with serve(models, port=0, block=False, engine="process", optimize=False, say=said.append) as serving:
        assert serving.wait_ready(120)
        first = serving_pid(serving)
        answer = _killed_with_a_request_in_it(serving, httpx)
        assert answer.status_code == 500 and "the models' process ended (exit status -9)" in answer.json()["error"]
        # starting it again takes at least an import of torch: meanwhile 503 at once, and not ready
        meanwhile = httpx.post(f"{serving.url}/v2/models/sleeps/infer", content=SLEEPS_BODY, timeout=60)
        assert meanwhile.status_code == 503 and "being started again" in meanwhile.json()["error"]
        assert httpx.get(f"{serving.url}/v2/health/live").status_code == 200
        assert httpx.get(f"{serving.url}/v2/health/ready").status_code == 400  # a load balancer sends it nothing
        assert serving.wait_ready(120)
        assert httpx.get(f"{serving.url}/v2/models/sleeps/ready").status_code == 200
        again = httpx.post(f"{serving.url}/v2/models/sleeps/infer", content=SLEEPS_BODY, timeout=60).json()
        assert again["outputs"][0]["data"] == [2, 2]
        assert again["outputs"][1]["data"][0] == serving_pid(serving) != first
        assert _models_processes() == [serving_pid(serving)]
    assert _models_processes() == []
    assert any("exit status -9); it is being started again" in line for line in said)
    assert any("was started again" in line for line in said)


def test_a_models_process_that_keeps_ending_is_not_started_again(monkeypatch):
    from opsched.serving import process_engine

    httpx = pytest.importorskip("httpx")
    monkeypatch.setattr(process_engine, "RESTARTS", 1)
    said = []
    models = {"sleeps": (Sleeps(2.0), (torch.zeros(1, 2),))}
    with serve(models, port=0, block=False, engine="process", optimize=False, say=said.append) as serving:
        assert serving.wait_ready(120)
        assert _killed_with_a_request_in_it(serving, httpx).status_code == 500
        assert serving.wait_ready(120)  # started again once
        answer = _killed_with_a_request_in_it(serving, httpx)
        assert answer.status_code == 500 and "the models' process ended (exit status -9)" in answer.json()["error"]
        later = httpx.post(f"{serving.url}/v2/models/sleeps/infer", content=SLEEPS_BODY, timeout=60)
        assert later.status_code == 500 and "not started again: restart the server" in later.json()["error"]
        assert httpx.get(f"{serving.url}/v2/health/ready").status_code == 400
        assert httpx.get(f"{serving.url}/v2/models/sleeps/ready").status_code == 400
        assert _models_processes() == []
    assert any("(exit status -9), 2 times within 600 s; it is not started again" in line for line in said), said


def test_a_server_stopped_while_its_models_process_starts_again_leaves_no_process_behind():
    httpx = pytest.importorskip("httpx")
    said = []
    models = {"sleeps": (Sleeps(2.0), (torch.zeros(1, 2),))}
    serving = serve(models, port=0, block=False, engine="process", optimize=False, say=said.append)
    try:
        assert serving.wait_ready(120)
        assert _killed_with_a_request_in_it(serving, httpx).status_code == 500
    finally:
        started = time.monotonic()
        serving.stop(90)
    assert not serving.thread.is_alive() and time.monotonic() - started < 60
    assert _models_processes() == []
    # stopped during the start (an import of torch, at least), not after it
    assert any("being started again" in line for line in said) and not any("was started again" in line for line in said)


class HoldsALock(torch.nn.Module):
    """Cannot be pickled."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, x):
        return x + 1


def test_a_model_that_cannot_be_sent_or_set_up_is_one_line():
    with pytest.raises(OpschedError, match="cannot be pickled") as raised:
        serve({"m": (HoldsALock(), (torch.zeros(1, 2),))}, port=0, block=False, engine="process", optimize=False)
    assert "\n" not in str(raised.value)
    with pytest.raises(OpschedError, match="cannot read .*no_such_plan.json"):  # as the local engine raises it
        serve({"m": (torch.nn.Linear(2, 2), (torch.zeros(1, 2),))}, port=0, block=False, engine="process",
              plans={"m": "no_such_plan.json"})


def test_by_default_the_models_run_in_their_own_process_or_here_where_they_cannot_be_sent():
    """The command line's default (serve blocking): the models' own process, or this one where they cannot be sent
    there (said once)."""
    from opsched.serving import _served_here
    from opsched.serving.process_engine import ProcessModels
    from opsched.serving.served import ServedModels

    options = {"optimize": False}
    for model, engine in ((Sleeps(0.0), ProcessModels), (HoldsALock(), ServedModels)):
        said = []
        served = _served_here({"m": (model, (torch.zeros(1, 2),))}, options, None, said.append)
        try:
            assert isinstance(served, engine)
        finally:
            served.close()
        here = [line for line in said if "they run in this process (--engine local)" in line]
        assert len(here) == (engine is ServedModels), said


def test_a_server_that_does_not_block_serves_the_callers_objects_whose_weight_changes_it_follows():
    httpx = pytest.importorskip("httpx")
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]})
    model = torch.nn.Linear(2, 1)
    with serve({"m": (model, (torch.zeros(1, 2),))}, port=0, block=False, optimize=False,
               say=lambda text: None) as serving:
        assert serving.wait_ready(120) and isinstance(serving.endpoints["m"], ModelEndpoint)
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.fill_(0.5)
        answer = httpx.post(f"{serving.url}/v2/models/m/infer", content=body, timeout=60)
        assert answer.json()["outputs"][0]["data"] == [3.5], answer.text
