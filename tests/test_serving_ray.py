"""opsched serve --engine ray: the models in Ray Serve deployments on a local Ray, behind the same Open Inference
Protocol front end, driven by the official client; answers exactly the models', errors as the local engine gives
them, a deployment that cannot start answering 500 with the reason while the others serve, the local Ray gone once
the server stops. Skipped without the ``serve`` extra or Ray Serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("ray.serve")

from opsched.compare import compare_outputs
from opsched.serving import serve
from opsched.serving.ray_engine import RemoteEndpoint
from tests.support.served_models import RefusesLarge, client_answers_are_the_models


class OnlyHere(torch.nn.Module):
    """Runs in this process only: in a replica's it raises, so its deployment fails to start."""

    def __init__(self):
        super().__init__()
        self.here = os.getpid()

    def forward(self, x):
        if os.getpid() != self.here:
            raise RuntimeError("not in the process that made me")
        return x + 1


def test_ray_serve_deployments_answer_behind_the_same_front_end():
    http = pytest.importorskip("tritonclient.http")
    httpx = pytest.importorskip("httpx")
    import ray
    from ray import serve as ray_serve

    cnn = RefusesLarge().eval()
    models = {"cnn": (cnn, (torch.randn(1, 3, 16, 16),)), "broken": (OnlyHere(), (torch.ones(1, 2),))}
    with serve(models, port=0, block=False, engine="ray", optimize=False, max_batch=4, max_delay_ms=5,
               say=lambda text: None) as serving:
        deadline = time.monotonic() + 240
        while not serving.endpoints["broken"].failed and time.monotonic() < deadline:
            time.sleep(0.5)
        assert serving.endpoints["cnn"].ready.is_set()
        assert all(isinstance(e, RemoteEndpoint) for e in serving.endpoints.values())
        assert serving.endpoints["cnn"].batchable and serving.endpoints["cnn"].max_batch == 4  # the replica's
        assert sum(name.startswith("opsched-serve-") for name in ray_serve.status().applications) == 2  # one a model

        client = http.InferenceServerClient(serving.url.removeprefix("http://"))
        assert client.is_model_ready("cnn") and not client.is_model_ready("broken")
        assert not client.is_server_ready()  # one deployment did not start
        assert client.get_model_metadata("cnn")["inputs"] == [{"name": "x", "datatype": "FP32",
                                                               "shape": [-1, 3, 16, 16]}]
        client_answers_are_the_models(client, "cnn", "x", cnn, (1, 3))

        inputs = [torch.randn(1, 3, 16, 16) for _ in range(16)]

        def ask(x):
            body = {"inputs": [{"name": "x", "shape": [1, 3, 16, 16], "datatype": "FP32",
                                "data": x.flatten().tolist()}]}
            return httpx.post(f"{serving.url}/v2/models/cnn/infer", json=body, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, inputs))
        for x, answer in zip(inputs, answers):
            assert answer.status_code == 200, answer.text
            got = torch.tensor(answer.json()["outputs"][0]["data"]).reshape(1, 4)
            assert compare_outputs(got, cnn(x).detach()).ok

        def infer(model, body):
            return httpx.post(f"{serving.url}/v2/models/{model}/infer", content=body, timeout=60)

        def body(data):
            return json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": data}]})

        good = body([1] * 768)
        assert infer("cnn", good).status_code == 200
        failed = infer("cnn", body([500] + [1] * 767))
        assert failed.status_code == 500 and failed.json() == {"error": "model 'cnn' failed: ValueError: input above 100"}
        assert infer("cnn", good.replace('"FP32"', '"INT64"')).json()["error"] == \
            "input 'x' of 'cnn' is FP32, not INT64"
        assert infer("nope", good).status_code == 404
        broken = infer("broken", json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                                         "data": [0, 0]}]}))
        assert broken.status_code == 500 and broken.json()["error"].endswith(
            "its Ray Serve deployment failed to start: RuntimeError: not in the process that made me")
        assert infer("cnn", good).status_code == 200  # still serving
        serving.stop(timeout=180)
    assert not ray.is_initialized()  # the local Ray started for the server is gone with it


def test_ray_options_without_the_ray_engine_are_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "opsched", "serve", "squeezenet", "--replicas", "2"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.strip() == "opsched: error: --replicas goes with --engine ray"
