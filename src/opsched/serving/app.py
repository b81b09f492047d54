"""The HTTP side of ``opsched serve``: the Open Inference Protocol's endpoints as a Starlette application (an ASGI
app that uvicorn runs), over the models' endpoints (a :class:`~opsched.serving.batcher.ModelEndpoint` each, or with the Ray engine
its stand-in in the front end, :class:`~opsched.serving.ray_engine.RemoteEndpoint`).

Endpoints (KServe v2, as Triton's HTTP endpoint has them): ``GET /v2`` (server metadata), ``/v2/health/live``,
``/v2/health/ready``, ``GET /v2/models/{name}[/versions/1]`` (metadata), ``/v2/models/{name}/ready``, ``POST
/v2/models/{name}[/versions/1]/infer`` (JSON tensors, or Triton's binary tensor extension), ``POST
/v2/repository/index``. Errors are ``{"error": "one line"}``: 400 for a request the protocol or the model's
signature does not allow (an output parameter other than ``binary_data`` among them: Triton's classification and
shared memory are not supported), 404 for an unknown model, version or endpoint, 413 for a body over the limit (as it
arrives, and once inflated: gzip and deflate bodies are taken), 415 for another Content-Encoding, 503 at once when
the model's queue is full or the server stops, 500 with the model's own message when it raised. Readiness answers 400
while the models' plans are being prepared (the models already answer requests then, themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from opsched import __version__
from opsched.errors import OpschedError, first_line
from opsched.serving.batcher import ModelEndpoint, Overloaded
from opsched.serving.protocol import (
    HEADER_LENGTH,
    INLINE_BYTES,
    ProtocolError,
    output_choice,
    read_inputs,
    split_body,
    write_response,
)

VERSION = "1"  # each model is served in one version


def answer_size(outputs: dict[str, Any], binary: dict[str, bool], request_id: str | None) -> int:
    """About how many bytes an answer takes to write: each output's elements as binary data or as JSON text (some
    20 characters a number), and the request's id (a string: split_body refuses any other), which the answer
    echoes."""
    elements = sum(t.numel() * (t.element_size() if binary.get(name) else 20) for name, t in outputs.items())
    return elements + (0 if request_id is None else len(request_id))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def application(endpoints: dict[str, ModelEndpoint], ready: threading.Event, *, max_body: int = 64 << 20,
                on_startup: Callable[[], Awaitable[Any]] | None = None,
                on_shutdown: Callable[[], Any] = lambda: None) -> Starlette:
    """The ASGI application serving ``endpoints`` by name, ready (``/v2/health/ready``) once ``ready`` is set;
    ``on_startup`` is awaited on the event loop before the first request; ``on_shutdown`` runs once uvicorn has
    stopped accepting and every request it accepted was answered."""
    readers = anyio.CapacityLimiter(os.cpu_count() or 1)

    async def off_the_loop(size: int, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, on a worker thread when ``size`` (bytes) is over INLINE_BYTES."""
        if size <= INLINE_BYTES:
            return function(*args)
        return await anyio.to_thread.run_sync(functools.partial(function, *args), limiter=readers)

    def endpoint_of(request: Request) -> ModelEndpoint | JSONResponse:
        name = request.path_params["name"]
        version = request.path_params.get("version", VERSION)
        if name not in endpoints:
            return _error(404, f"no model {name!r}; the models are {', '.join(endpoints)}")
        if version != VERSION:
            return _error(404, f"model {name!r} has version {VERSION} only, not {version!r}")
        return endpoints[name]

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "opsched", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def server_ready(request: Request) -> Response:
        return Response(status_code=200 if ready.is_set() else 400)

    async def model_metadata(request: Request) -> Response:
        endpoint = endpoint_of(request)
        return endpoint if isinstance(endpoint, Response) else JSONResponse(endpoint.metadata())

    async def model_ready(request: Request) -> Response:
        endpoint = endpoint_of(request)
        if isinstance(endpoint, Response):
            return endpoint
        return Response(status_code=200 if endpoint.ready.is_set() else 400)

    async def repository_index(request: Request) -> Response:
        return JSONResponse([{"name": name, "version": VERSION, "state": "READY" if e.ready.is_set() else "LOADING"}
                             for name, e in endpoints.items()])

    async def body_of(request: Request) -> bytes | JSONResponse:
        """The request's body, decompressed as its Content-Encoding says, refused past ``max_body`` bytes as it
        arrives (a chunked body has no length to check first)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            return _error(413, f"the body has {declared} bytes; at most {max_body} are taken")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                return _error(413, f"the body has more than {max_body} bytes; at most {max_body} are taken")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return body
        if encoding not in ("gzip", "deflate"):
            return _error(415, f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)")
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            body = inflate.decompress(body, max_body + 1)
        except zlib.error as e:
            return _error(400, f"the body is not {encoding} data: {e}")
        if len(body) > max_body or inflate.unconsumed_tail:
            return _error(413, f"the body inflates past {max_body} bytes; at most {max_body} are taken")
        return body

    def parsed(endpoint: ModelEndpoint, body: bytes, header_length: str | None) -> tuple:
        message, binary = split_body(body, header_length)
        choice = output_choice(message, [s.name for s in endpoint.outputs])
        inputs, batch = endpoint.check(read_inputs(message, binary))
        return message, choice, inputs, batch

    async def infer(request: Request) -> Response:
        endpoint = endpoint_of(request)
        if isinstance(endpoint, Response):
            return endpoint
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        try:  # a large body takes a while to read: off the event loop, which answers health probes meanwhile
            message, choice, inputs, batch = await off_the_loop(
                len(body), parsed, endpoint, body, request.headers.get(HEADER_LENGTH.lower()))
        except ProtocolError as e:
            return _error(400, str(e))
        try:
            outputs = await endpoint.infer(inputs, batch)
        except Overloaded as e:
            return _error(503, str(e))
        except ProtocolError as e:  # what the model's runner checks again (with Ray, against the replica's signature)
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001 - the model raised: its message, and every other request goes on
            return _error(500, f"model {endpoint.name!r} failed: {first_line(e)}")
        try:
            content, header_length = await off_the_loop(answer_size(outputs, choice, message.get("id")), write_response,
                                                        endpoint.name, VERSION, message.get("id"), outputs, choice)
        except OpschedError as e:
            return _error(500, str(e))
        if header_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(header_length)})

    async def http_error(request: Request, error: Exception) -> Response:
        status = getattr(error, "status_code", 500)
        detail = getattr(error, "detail", None) or "internal error"
        if status == 404:
            detail = f"no such endpoint: {request.method} {request.url.path}"
        elif status == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        return _error(status, detail)

    async def internal_error(request: Request, error: Exception) -> Response:
        return _error(500, f"internal error: {first_line(error)}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if on_startup is not None:
            await on_startup()
        yield
        await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2", server_metadata), Route("/v2/health/live", live), Route("/v2/health/ready", server_ready),
        Route("/v2/repository/index", repository_index, methods=["GET", "POST"]),
        Route(model, model_metadata), Route(versioned, model_metadata),
        Route(model + "/ready", model_ready), Route(versioned + "/ready", model_ready),
        Route(model + "/infer", infer, methods=["POST"]), Route(versioned + "/infer", infer, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})
