"""``opsched serve --engine process``: the models run in a process of their own on this machine, behind the same
Open Inference Protocol front end (:mod:`opsched.serving.app`, in the server's process).

Why a second process: in one process, the front end's event loop (reading requests, writing answers) and the thread
that runs the models take turns at one interpreter lock. On small models the Python work between operators holds
that lock as long as the kernels run, so the server's two halves do not overlap: with the local engine, 16 small
CNNs kept the server's process at about one core of two. Each process has its own lock.

The models' process holds the models as the local engine does (:class:`~opsched.serving.served.ServedModels`: the
same endpoints, bounded queues, batcher, fused group and plans prepared in the background), and says what the local
engine says, through the server's ``say``. It is the server's Python running this module (``python -m
opsched.serving.process_engine FD``), not a fork (a fork of a process whose OpenMP threads have run may hang in
its first parallel region) nor a multiprocessing spawn (which runs the user's script again, unguarded code and all).
The models reach it through a socket pair, pickled with cloudpickle (the user's own classes by value); each request
and answer crosses that socket as one message (a pickle of plain data after its length), every tensor as its dtype,
shape and raw bytes. The server's end of the socket belongs to its event loop once it runs (an asyncio transport):
a request is written without blocking the loop, and answers are read on it, with no thread between. In the models'
process one thread reads requests into the models' queues, and the batcher's thread writes each answer as it is
made.

The front end checks every request against the signatures the models' process sends once its models are set up
(the server's constructor waits for them, so that a model or plan file that cannot be served fails in one line);
until each model's plans are prepared it answers itself, as with the local engine. Should the models' process end
while the server runs (killed for memory, a crash in a kernel), each request it held is answered 500 saying so, and
the server starts it again, sending it the models it holds: meanwhile requests are answered 503 and the
server is not ready; once the new process has its models, they answer (themselves until their plans are prepared
again, as at startup). A process that ends more than :data:`RESTARTS` times within :data:`RESTART_WINDOW` seconds
(a request that crashes it, sent again and again) is not started again: every later request is answered 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from opsched.errors import OpschedError, first_line
from opsched.serving.batcher import Overloaded, Signature
from opsched.serving.protocol import INLINE_BYTES

WireTensor = tuple[str, tuple[int, ...], bytes]  # dtype's name, shape, the elements' bytes in row-major order
HEADER = struct.Struct("!Q")  # a message's length, before it
STARTUP_SECONDS = 600.0  # for the models' process to import torch, read its models and check their signatures
RESTARTS = 3  # times the models' process is started again within RESTART_WINDOW seconds, before the server gives up
RESTART_WINDOW = 600.0


def to_wire(tensor: torch.Tensor) -> WireTensor:
    """``tensor`` as it crosses between the processes (every dtype: those NumPy lacks, bfloat16 among them, as
    their bytes), through NumPy where it can (on the front end's event loop, no torch call that would let go of
    the interpreter lock). A tensor on another device, or a lazily conjugated or negated view, is copied first."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.cpu().resolve_conj().resolve_neg()
    if _numpy_dtype(tensor.dtype) is not None:
        raw = tensor.numpy().tobytes()  # row-major, whatever the strides
    else:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw


def from_wire(wire: WireTensor) -> torch.Tensor:
    """The tensor :func:`to_wire` gave, in writable memory of its own."""
    name, shape, raw = wire
    dtype = getattr(torch, name)
    numpy_dtype = _numpy_dtype(dtype)
    if numpy_dtype is not None:
        return torch.from_numpy(np.frombuffer(bytearray(raw), numpy_dtype).reshape(shape))
    if not raw:  # no elements: nothing to view as the dtype
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(bytearray(raw), np.uint8)).view(dtype).reshape(shape)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """NumPy's dtype for ``dtype``, or None where NumPy has none."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


class CannotSend(OpschedError):
    """The models cannot be sent to a process of their own: cloudpickle is missing, or a model does not pickle."""


class Restarting(Overloaded):
    """The models' process ended and is being started again: answered 503 at once."""


def framed(data: bytes) -> list[bytes]:
    """``data`` as it crosses the socket, as the parts to write: its length, then itself (not joined: no copy)."""
    return [HEADER.pack(len(data)), data]


def frame(*message: Any) -> bytes:
    """A message (a tuple of plain data) as it crosses the socket, in one piece: its pickle's length, then the
    pickle."""
    return b"".join(framed(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))


class Channel:
    """A blocking end of the socket: the models' process's (read by one thread, written by several, each message
    whole under a lock), and the server's until its event loop takes it over (:meth:`ProcessModels.start`). It
    reads exactly the bytes of each message, never ahead: what follows is the event loop's to read.
    ``waiting``, called whenever a read has waited ``poll`` seconds, may raise to give up."""

    def __init__(self, sock: socket.socket, waiting: Callable[[], None] | None = None, poll: float = 1.0):
        self.socket = sock
        self._waiting = waiting
        self.poll = poll if waiting is not None else None
        sock.settimeout(self.poll)
        self._sending = threading.Lock()

    def send(self, *message: Any) -> None:
        data = frame(*message)
        with self._sending:
            self.socket.sendall(data)

    def receive(self) -> tuple:
        """The next message; EOFError once the other end has closed."""
        return pickle.loads(self._exactly(HEADER.unpack(self._exactly(HEADER.size))[0]))

    def _exactly(self, size: int) -> bytearray:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            try:
                n = self.socket.recv_into(view[got:])
            except TimeoutError:
                self._waiting()
                continue
            if n == 0:
                raise EOFError
            got += n
        return data


class ProcessEndpoint(Signature):
    """A model served by the models' process, as the front end sees it: its signature, ``ready`` once its plans
    are prepared there, and :meth:`infer` through the socket."""

    def __init__(self, signature: Signature, models: ProcessModels):
        self.take(signature)
        self.models = models
        self.ready = threading.Event()

    async def infer(self, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
        return await self.models.infer(self.name, inputs, batch)


class ProcessModels:
    """``models`` (name -> ``(model, example_inputs)``) served by a process of their own (see the module docstring):
    ``endpoints`` by name for the front end, ``ready`` once every plan is prepared there, ``group`` (None: the fused
    group lives in the models' process), :meth:`start` (awaited on the server's event loop before the first
    request) and :meth:`close`. ``options`` are :class:`~opsched.serving.served.ServedModels`'s."""

    def __init__(self, models: Mapping[str, tuple[Any, Sequence[Any]]], options: dict[str, Any], *,
                 say: Callable[[str], Any] = lambda text: None):
        try:
            import cloudpickle
        except ImportError:
            raise CannotSend("--engine process needs cloudpickle: pip install 'opsched[serve]'") from None
        from opsched.serving.pickling import user_code_by_value

        user_code_by_value(cloudpickle, [model for model, _ in models.values()])
        # pickled again for each start of the models' process rather than kept as bytes: a second copy of every
        # weight in the server's memory otherwise (the server holds the models themselves anyway)
        self._pickle_models = functools.partial(cloudpickle.dumps, (dict(models), options))
        if os.name != "posix":  # the socket is handed down as an inherited descriptor
            raise CannotSend("--engine process needs a POSIX system")
        self.say, self.group = say, None
        self.ready = threading.Event()
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}  # touched on the event loop only
        self._ended: str | None = None  # why the models' process does not answer now
        self._restarting = False  # (then requests are answered 503)
        self._restarts: list[float] = []  # when it was started again (time.monotonic)
        self._restarter: asyncio.Task | None = None  # (a reference: the loop keeps none to a task)
        self._connection = 0  # which socket the event loop reads: a closed one's end is not the current one's
        self._closing = False
        self._gone = threading.Event()  # the socket has closed, and the models' process will not be started again
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.Transport | None = None
        self.endpoints = {name: ProcessEndpoint(signature, self) for name, signature in self._spawn().items()}

    def _spawn(self) -> dict[str, Signature]:
        """Start the models' process (``process``, ``channel``) and send it the models, pickled now; their
        signatures once it has set them up, otherwise the error it met there (CannotSend where the models cannot
        be pickled here or read there). Gives up once the server is closing."""
        try:
            payload = self._pickle_models()
        except Exception as e:  # noqa: BLE001 - what cannot be pickled, in one line
            raise CannotSend(f"--engine process sends the models to their process, and they cannot be pickled: "
                             f"{first_line(e)}") from None
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen([sys.executable, "-m", "opsched.serving.process_engine", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            raise CannotSend(f"--engine process cannot start {sys.executable}: {e}") from None
        finally:
            theirs.close()
        started = time.monotonic()

        def waiting() -> None:
            if process.poll() is not None:
                raise EOFError
            if self._closing:
                raise OpschedError("the server is stopping")
            if time.monotonic() - started > STARTUP_SECONDS:
                raise OpschedError(f"the models' process did not start within {STARTUP_SECONDS:.0f} s")

        channel = Channel(ours, waiting)
        try:
            signatures = self._started(channel, process, payload)
            if self._closing:  # since it was started: nobody would end this process
                raise OpschedError("the server is stopping")
        except BaseException:
            process.kill()
            process.wait()
            ours.close()
            raise
        self.process, self.channel = process, channel
        return signatures

    def _started(self, channel: Channel, process: subprocess.Popen, payload: bytes) -> dict[str, Signature]:
        try:
            channel.socket.settimeout(None)  # the models' process reads them once it has imported torch
            for part in framed(payload):
                channel.socket.sendall(part)
            channel.socket.settimeout(channel.poll)
            while True:
                message = channel.receive()
                if message[0] == "say":
                    self.say(message[1])
                elif message[0] == "unreadable":
                    raise CannotSend(f"the models' process cannot read the models: {message[1]}")
                elif message[0] == "failed":  # what the local engine raises there
                    raise _rebuilt(*message[1:])
                else:  # started
                    return message[1]
        except (EOFError, OSError):
            raise OpschedError(f"the models' process ended as it started (exit status "
                               f"{_exit_status(process)})") from None

    async def start(self) -> None:
        """From now on the socket is the event loop's: each request written without blocking the loop (a blocking
        write waits whenever the models' process is slow to read), each answer read on it (no thread between, and
        no hand-off to the loop for each answer)."""
        self._loop = asyncio.get_running_loop()
        await self._connect()

    async def _connect(self) -> None:
        self._connection += 1
        self.channel.socket.setblocking(False)  # (no timeout either)
        self._transport, _ = await self._loop.connect_accepted_socket(
            functools.partial(_Answers, self, self._connection), self.channel.socket)

    async def infer(self, name: str, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
        """The request's outputs by name, from the models' process; its Overloaded, ProtocolError or the model's
        error as the local engine raises them."""
        if self._ended or self._transport is None:
            raise self._refusal()
        key = next(self._ids)
        future = self._loop.create_future()
        self._waiting[key] = future
        message = functools.partial(_request, key, name, inputs, batch)
        # copying a large request takes a while: off the event loop, which answers health probes meanwhile
        framed = message() if sum(t.nbytes for t in inputs) <= INLINE_BYTES else \
            await self._loop.run_in_executor(None, message)
        if future.done():  # failed while it was framed: the process that was to run it ended
            return future.result()
        if self._ended or self._transport is None:
            self._waiting.pop(key, None)
            raise self._refusal()
        self._transport.writelines(framed)
        return await future

    def received(self, data: memoryview) -> None:
        """A message of the models' process (on the event loop): an answer to its request's future, progress to
        ``say``, readiness to the endpoints. (A message is plain data, an error's pickle a message of its own
        inside it: an error whose class cannot be imported here fails its request by its name and message, see
        :func:`_rebuilt`; an answer that cannot be made here fails its request alone.)"""
        try:
            message = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - not one of ours (which request it answered cannot be known): said
            self.say(f"a message of the models' process could not be read: {first_line(e)}")
            return
        kind = message[0]
        if kind == "answer" or kind == "error":
            future = self._waiting.pop(message[1], None)
            if future is None or future.done():  # its request was cancelled meanwhile
                return
            try:
                if kind == "answer":
                    future.set_result({name: from_wire(wire) for name, wire in message[2].items()})
                else:
                    future.set_exception(_rebuilt(*message[2:]))
            except Exception as e:  # noqa: BLE001 - an answer that cannot be made here fails alone
                future.set_exception(OpschedError(f"its answer could not be read: {first_line(e)}"))
        elif kind == "say":
            self.say(message[1])
        elif kind == "model-ready":
            self.endpoints[message[1]].ready.set()
        elif kind == "ready":
            self.ready.set()

    def _refusal(self) -> OpschedError:
        """Why a request cannot be sent now: 503 while the models' process is started again, else 500."""
        if self._restarting:
            return Restarting(self._ended)
        return OpschedError(self._ended or "the models' process is not connected yet")

    def ended(self, connection: int) -> None:
        """The socket ``connection`` has closed (on the event loop): the server is no longer ready, every request
        waiting gets why, and the models' process is started again unless it ended too often (see the module
        docstring)."""
        if connection != self._connection:
            return
        self._transport = None
        if self._closing:
            self._ended = "the server is stopping"
            self._fail_waiting()
            self._gone.set()
            return
        self.ready.clear()
        for endpoint in self.endpoints.values():
            endpoint.ready.clear()
        now = time.monotonic()
        self._restarts = [at for at in self._restarts if now - at < RESTART_WINDOW]
        if len(self._restarts) >= RESTARTS:
            self._ended = (f"the models' process ended, {RESTARTS + 1} times within {RESTART_WINDOW:.0f} s; it is "
                           "not started again: restart the server")
        else:
            self._ended, self._restarting = "the models' process ended; it is being started again", True
            self._restarts.append(now)
        self._restarter = self._loop.create_task(self._restart())

    async def _restart(self) -> None:
        try:
            # its socket closes as it dies, a moment before it can be waited for: off the loop
            status = await self._loop.run_in_executor(None, _exit_status, self.process)
            self._ended = self._ended.replace("ended", f"ended (exit status {status})", 1)
            self._fail_waiting()
            if self._closing:  # meanwhile: the stop goes on without a new process
                return
            self.say(self._ended)
            if not self._restarting:
                return
            try:
                await self._loop.run_in_executor(None, self._spawn)
            except Exception as e:  # noqa: BLE001 - said, and every later request answered 500 with it
                if not self._closing:
                    self._ended = self._ended.replace("; it is being started again",
                                                      f", and could not be started again ({first_line(e)}): restart "
                                                      "the server")
                    self.say(self._ended)
                return
            await self._connect()
            self._ended = None
            if self._closing:  # while it started (close() found a restart under way): answers what it has, ends
                self._transport.write(frame("close"))
                return
            self.say("the models' process was started again; its models answer, themselves until their plans are "
                     "prepared again")
        except BaseException as e:
            if self._transport is None:  # (a say that raised, a socket that could not be taken over, cancelled)
                self._ended = "the server is stopping" if self._closing else \
                    f"the models' process could not be started again ({first_line(e)}): restart the server"
                self._fail_waiting()
            raise
        finally:
            self._restarting = False
            if self._transport is None:
                self._gone.set()

    def _fail_waiting(self) -> None:
        waiting, self._waiting = list(self._waiting.values()), {}
        for future in waiting:
            if not future.done():
                future.set_exception(OpschedError(self._ended))

    def close(self) -> None:
        """Have the models' process answer what it accepted, close its modules and end; once. From a thread other
        than the event loop's, which still runs (uvicorn's shutdown), or before the loop took the socket."""
        if self._closing:
            return
        self._closing = True
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._close_on_the_loop)
            self._gone.wait(60)
        else:  # the event loop never took the socket, or has stopped: closing it tells the models' process to end
            self.channel.socket.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.channel.socket.close()

    def _close_on_the_loop(self) -> None:
        if self._transport is not None:  # the models' process answers what it accepted, then closes its end
            self._transport.write(frame("close"))
        elif not self._restarting:  # never connected, or not started again: nothing comes back to wait for
            self.channel.socket.close()
            self._gone.set()
        # (else the restart under way sees that the server is closing, and ends)


class _Answers(asyncio.Protocol):
    """The server's end of the socket on its event loop: each whole message to :meth:`ProcessModels.received`."""

    def __init__(self, models: ProcessModels, connection: int):
        self.models, self.connection = models, connection
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        start = 0
        while len(self.buffer) - start >= HEADER.size:
            size = HEADER.unpack_from(self.buffer, start)[0]
            begin = start + HEADER.size
            if len(self.buffer) - begin < size:
                break
            self.models.received(memoryview(self.buffer)[begin:begin + size])
            start = begin + size
        del self.buffer[:start]

    def connection_lost(self, error: Exception | None) -> None:
        self.models.ended(self.connection)


def _portable(error: BaseException) -> tuple[bytes | None, str, str]:
    """``error`` as it crosses to the server's process, which raises it as the local engine would (a full queue, a
    request the model takes no batch of, the model's own error): its pickle where it pickles both ways here, and
    always its type's name and message, for the server's process to make one of where it cannot read the pickle
    (a class of the user's script that came here by value, an exception holding a lock, a module only this process
    imports). The pickle is a message of its own inside the message: one the server cannot read fails its request
    alone."""
    error = error.with_traceback(None)
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - pickle cannot rebuild it
        blob = None
    return blob, type(error).__name__, str(error)


def _rebuilt(blob: bytes | None, kind: str, text: str) -> BaseException:
    """What :func:`_portable` sent, as an exception: itself, or an OpschedError named as the original (the front
    end's message gives the name, as it gives any error's)."""
    if blob is not None:
        with contextlib.suppress(Exception):  # its class cannot be imported here
            return pickle.loads(blob)
    return _named_error(kind)(text)


@functools.cache
def _named_error(name: str) -> type[OpschedError]:
    return type(name, (OpschedError,), {})


def _request(key: int, name: str, inputs: tuple[torch.Tensor, ...], batch: int) -> list[bytes]:
    """A request's message, as the parts to write."""
    return framed(pickle.dumps(("infer", key, name, [to_wire(t) for t in inputs], batch),
                               protocol=pickle.HIGHEST_PROTOCOL))


def _exit_status(process: subprocess.Popen) -> int | str:
    try:
        return process.wait(5)
    except subprocess.TimeoutExpired:
        return "unknown"


def _answer(channel: Channel, key: int, future: Any) -> None:
    """A request's answer sent back (in the thread that answered it: the models' batcher)."""
    try:
        error = future.exception()
        if error is None:
            channel.send("answer", key, {name: to_wire(t) for name, t in future.result().items()})
        else:
            channel.send("error", key, *_portable(error))
    except OSError:  # the server's process is gone; the main thread ends this process
        pass
    except Exception as e:  # noqa: BLE001 - an answer that cannot be sent: its error instead, never a silent wait
        with contextlib.suppress(OSError):
            channel.send("error", key, *_portable(e))


def _report_ready(channel: Channel, served: Any) -> None:
    """Each model's readiness as its plans are prepared, then the server's."""
    try:
        for name, endpoint in served.endpoints.items():
            endpoint.ready.wait()
            channel.send("model-ready", name)
        served.ready.wait()
        channel.send("ready")
    except OSError:  # the server's process is gone
        pass


def main(descriptor: int) -> int:
    """The models' process: read the models and options, serve them as the local engine does, answer each request
    the server's process sends, until it says close (or is gone)."""
    # the server's process says when to stop (Ctrl-C reaches the whole process group, a supervisor's SIGTERM may):
    # it drains its requests first, and this process ends with it, or when its socket closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.set_inheritable(descriptor, False)  # what the models start does not keep the socket open after this process
    channel = Channel(socket.socket(fileno=descriptor))
    try:
        models, options = channel.receive()
    except Exception as e:  # noqa: BLE001 - a class this process cannot import: the server may serve them itself
        channel.send("unreadable", first_line(e))
        return 1
    try:
        from opsched.serving.served import ServedModels

        served = ServedModels(models, **options, say=functools.partial(channel.send, "say"))
    except Exception as e:  # noqa: BLE001 - the server's process says it in one line
        channel.send("failed", *_portable(e))
        return 1
    channel.send("started", {name: e.signature() for name, e in served.endpoints.items()})
    threading.Thread(target=_report_ready, args=(channel, served), name="opsched-serve-ready", daemon=True).start()
    while True:
        try:
            message = channel.receive()
        except (EOFError, OSError):
            break
        if message[0] == "close":
            break
        _, key, name, inputs, batch = message
        try:
            future = served.endpoints[name].submit(tuple(from_wire(w) for w in inputs), batch)
        except Exception as e:  # noqa: BLE001 - a full queue, or a request the model takes no batch of
            channel.send("error", key, *_portable(e))
            continue
        future.add_done_callback(functools.partial(_answer, channel, key))
    served.close()
    try:
        channel.send("closed")
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
