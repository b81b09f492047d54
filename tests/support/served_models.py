"""Models the serving tests serve in another process (a Ray Serve replica, the process engine's models' process):
defined here, in a file of the tests that those processes cannot import, so that they travel by value."""

from __future__ import annotations

import threading

import torch


class RefusesLarge(torch.nn.Module):
    """A small CNN that raises ValueError on inputs above 100, and on inputs below -100 an error that cannot
    cross between processes as itself (randn gives neither)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))

    def forward(self, x):
        if (x > 100).any():
            raise ValueError("input above 100")
        if (x < -100).any():
            raise Unpicklable("input below -100")
        return self.net(x)


class Unpicklable(Exception):
    """An error that cannot cross between processes as itself (it holds a lock)."""

    def __init__(self, text):
        super().__init__(text)
        self.lock = threading.Lock()


def client_answers_are_the_models(client, name: str, input_name: str, model: torch.nn.Module,
                                  batches: tuple[int, ...], request_id: str = "") -> None:
    """Triton's client (``tritonclient.http``'s, on the server) gets exactly ``model``'s answers from the served
    model ``name`` (a CNN on 3x16x16 images) at each of ``batches``, with JSON and with binary tensors, its request's
    id echoed."""
    import numpy as np
    from tritonclient import http

    from opsched.compare import compare_outputs

    for batch in batches:
        x = np.random.rand(batch, 3, 16, 16).astype(np.float32)
        want = model(torch.from_numpy(x)).detach()
        for binary in (False, True):
            tensor = http.InferInput(input_name, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = client.infer(name, [tensor], outputs=[http.InferRequestedOutput("output_0", binary_data=binary)],
                                  request_id=request_id)
            assert result.get_response().get("id", "") == request_id
            assert compare_outputs(torch.from_numpy(result.as_numpy("output_0").copy()), want).ok, (batch, binary)
