"""The Open Inference Protocol's tensors (KServe v2, the protocol of Triton's HTTP endpoint): an inference request's
inputs read into tensors, and the outputs written back, as JSON or with Triton's binary tensor extension.

A request is a JSON object (``id``, ``parameters``, ``inputs``, ``outputs``); each input has ``name``, ``shape``,
``datatype`` and either ``data`` (the elements in row-major order, flat or nested) or, with the binary extension,
``parameters.binary_data_size``: its bytes then follow the JSON, in the order of the inputs, and the JSON's length
is the ``Inference-Header-Content-Length`` header. An output is written as binary when the request asks for it
(``parameters.binary_data`` on the output, or ``parameters.binary_data_output`` on the request).

JSON is strict JSON (RFC 8259): no ``NaN`` or ``Infinity``, nor a number too large for a double (which would read as
infinity); such values travel as binary data. It is read and written with orjson where it is installed (``pip install
'opsched[serve]'`` brings it: it parses a request of 12,288 numbers in a fifth of the standard library's time),
else with the standard library, held to the same rules.

>>> import torch
>>> request = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2.5]}]}
>>> read_inputs(request, b"")["x"]
tensor([[1.5000, 2.5000]])
>>> body, header_length = write_response("m", "1", None, {"y": torch.tensor([[3]])}, output_choice(request, ["y"]))
>>> json.loads(body)["outputs"][0]
{'name': 'y', 'datatype': 'INT64', 'shape': [1, 1], 'data': [3]}
"""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # the standard library's, held to the same rules
    orjson = None

import numpy as np
import torch

from opsched.errors import OpschedError

# A body or an answer of at most this many bytes (an answer as answer_size counts it), or a request's tensors as they
# cross to the models' process (opsched.serving.process_engine), is read, written or framed on the event loop: a
# hand-off to a worker thread and back costs more than reading it (a 12 KB binary request of a small CNN, or a 60 KB
# JSON one). Larger ones go to worker threads, as many at a time as the machine has cores: reading holds the
# interpreter lock, and more threads at it only take it from the thread running the models (under an overload of JSON
# requests, 40 threads parsing left the models' thread a fraction of its turns).
INLINE_BYTES = 64 << 10

DATATYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
    "INT64": torch.int64, "FP16": torch.float16, "BF16": torch.bfloat16, "FP32": torch.float32,
    "FP64": torch.float64,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(OpschedError):
    """A request the protocol, or the model's signature, does not allow: answered 400 with its one line."""


def datatype_of(dtype: torch.dtype) -> str:
    if dtype not in NAMES:
        raise OpschedError(f"tensors of {dtype} have no Open Inference Protocol datatype")
    return NAMES[dtype]


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The request's JSON object and the binary data after it (``header_length``: the header of that name)."""
    if header_length is None:
        head, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} is {header_length!r}; the body has {len(body)} bytes")
        head, rest = body[:n], body[n:]
    try:
        request = json_loads(head)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError among them, and orjson's
        raise ProtocolError(f"the request is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("the request is not JSON this server reads: it nests too deep") from None
    if not isinstance(request, dict):
        raise ProtocolError("the request is not a JSON object")
    if not isinstance(request.get("id", ""), str):
        raise ProtocolError("the request's id must be a string")
    return request, rest


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def _integer(text: str) -> int | float:
    """A JSON integer as orjson reads it: an int within 64 bits (signed or unsigned), else a double; one past a
    double's range refused."""
    if len(text) <= 21 and -(1 << 63) <= (value := int(text)) < 1 << 64:
        return value
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"the number {text[:24]}... is past a double's range")
    return number


def json_loads(text: bytes) -> Any:
    """``text`` (UTF-8) as strict JSON, read as orjson reads it: ``NaN``, ``Infinity`` and ``-Infinity`` refused,
    integers past 64 bits read as doubles; a ValueError where it is not."""
    if orjson is not None:
        return orjson.loads(text)
    return json.loads(text.decode("utf-8"), parse_constant=_no_constant, parse_int=_integer)


def json_dumps(value: Any) -> bytes:
    """``value`` as JSON (it holds no NaN or infinity: see :func:`write_response`)."""
    if orjson is not None:
        return orjson.dumps(value)
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()


def parameters_of(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """An object's ``parameters`` (a JSON object, or absent)."""
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError(f"{where}: parameters must be an object")
    return parameters


MAX_ELEMENTS = 1 << 34  # no request holds more; a larger shape is a mistake, not data


def read_inputs(request: dict[str, Any], binary: bytes) -> dict[str, torch.Tensor]:
    """Each input of ``request`` as a tensor, by name (binary inputs read from ``binary`` in order)."""
    parameters_of(request, "the request")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request has no inputs (a list of tensors)")
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for entry in inputs:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError("each input is an object with a name")
        name = entry["name"]
        if name in tensors:
            raise ProtocolError(f"input {name!r} is given twice")
        shape, datatype = entry.get("shape"), entry.get("datatype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ProtocolError(f"input {name!r}: shape must be a list of sizes, got {shape!r}")
        if datatype not in DATATYPES:
            raise ProtocolError(f"input {name!r}: datatype {datatype!r} is not one of {', '.join(DATATYPES)}")
        dtype, count = DATATYPES[datatype], math.prod(shape)
        if count > MAX_ELEMENTS:
            raise ProtocolError(f"input {name!r}: shape {shape} holds more than {MAX_ELEMENTS} elements")
        parameters = parameters_of(entry, f"input {name!r}")
        if "shared_memory_region" in parameters:
            raise ProtocolError(f"input {name!r}: shared memory is not supported; send the data in the request")
        size = parameters.get("binary_data_size")
        if size is not None:
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not isinstance(size, int) or size != count * itemsize or offset + size > len(binary):
                raise ProtocolError(f"input {name!r}: binary_data_size {size!r} does not hold {count} {datatype} "
                                    f"elements, or the body is shorter")
            raw = bytearray(binary[offset:offset + size])  # writable: the tensor owns its memory
            offset += size
            tensor = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
            if dtype == torch.bool and size and max(raw) > 1:
                raise ProtocolError(f"input {name!r}: BOOL bytes must be 0 or 1")
        else:
            if "data" not in entry:
                raise ProtocolError(f"input {name!r} has neither data nor binary_data_size")
            tensor = _from_json(name, entry["data"], dtype, datatype)
        if tensor.numel() != count:
            raise ProtocolError(f"input {name!r}: shape {shape} holds {count} elements, the data {tensor.numel()}")
        tensors[name] = tensor.reshape(shape)
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes after the JSON belong to no input")
    return tensors


def _from_json(name: str, data: Any, dtype: torch.dtype, datatype: str) -> torch.Tensor:
    """JSON data as ``datatype`` says, refused rather than converted where it holds other kinds of values: strings,
    fractions for an integer type, numbers for BOOL, values out of the type's range."""
    try:
        array = np.asarray(data)
    except ValueError:  # ragged nesting
        raise ProtocolError(f"input {name!r}: data must be a flat or evenly nested list") from None
    kinds = {"BOOL": "b"}.get(datatype, "iu" if not dtype.is_floating_point else "iuf")
    if array.size and array.dtype.kind not in kinds:
        expected = {"b": "true or false", "iu": "integers"}.get(kinds, "numbers")
        raise ProtocolError(f"input {name!r}: {datatype} data must be {expected}")
    if dtype == torch.bool:
        return torch.from_numpy(array.astype(np.bool_).reshape(-1))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ProtocolError(f"input {name!r}: a value is out of {datatype}'s range")
        return torch.from_numpy(array.astype(np.int64).reshape(-1)).to(dtype)
    values = array.astype(np.float64).reshape(-1)
    if not np.isfinite(values).all():  # strict JSON has no NaN nor infinity: a number past a double's range
        raise ProtocolError(f"input {name!r}: a number is past a double's range; NaN and infinity travel as binary "
                            "data")
    # in NumPy where it has the type: each torch call on the event loop lets go of the interpreter lock and waits to
    # take it back from the thread running the models (half the time of reading a request of a small CNN)
    numpy_type = _NUMPY_FLOATS.get(dtype)
    if numpy_type is None:
        tensor = torch.from_numpy(values).to(dtype)
        out_of_range = bool(torch.isinf(tensor).any())
    else:
        with np.errstate(over="ignore"):
            cast = values.astype(numpy_type)
        tensor, out_of_range = torch.from_numpy(cast), bool(np.isinf(cast).any())
    if out_of_range:  # (every value was finite as a double)
        raise ProtocolError(f"input {name!r}: a value is out of {datatype}'s range")
    return tensor


_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def output_choice(request: dict[str, Any], names: list[str]) -> dict[str, bool]:
    """The outputs a request asks for (all of ``names`` when it names none), each with whether it is written as
    binary data. An output parameter other than ``binary_data`` (Triton's ``classification``, shared memory) is
    refused: answering without it would be a wrong answer."""
    wanted = request.get("outputs")
    everything_binary = bool(parameters_of(request, "the request").get("binary_data_output"))
    if not wanted:
        return dict.fromkeys(names, everything_binary)
    if not isinstance(wanted, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in wanted):
        raise ProtocolError("outputs must be a list of objects with a name")
    choice = {}
    for o in wanted:
        if o["name"] not in names:
            raise ProtocolError(f"the model has no output {o['name']!r}; it has {', '.join(names)}")
        parameters = parameters_of(o, f"output {o['name']!r}")
        other = sorted(set(parameters) - {"binary_data"})
        if other:
            raise ProtocolError(f"output {o['name']!r}: {', '.join(other)} is not supported")
        choice[o["name"]] = bool(parameters.get("binary_data", everything_binary))
    return choice


def write_response(model: str, version: str, request_id: Any, outputs: dict[str, torch.Tensor],
                   choice: dict[str, bool]) -> tuple[bytes, int | None]:
    """The response's body for the outputs of ``choice`` (:func:`output_choice`), and the length of its JSON part
    when binary data follows it (else None)."""
    entries, blobs = [], []
    for name, binary in choice.items():
        tensor = outputs[name]
        if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().cpu().contiguous()
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(tensor.dtype), "shape": list(tensor.shape)}
        # read through NumPy where it has the type, with no torch call on the event loop (see _from_json)
        array = tensor.numpy() if tensor.dtype != torch.bfloat16 else None
        if binary:
            if array is None:
                array = tensor.reshape(-1).view(torch.uint8).numpy()
            blob = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            if array is None:
                array = tensor.float().numpy()
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise OpschedError(f"output {name!r} holds NaN or infinity, which JSON cannot carry: ask for it as "
                                   "binary data")
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request_id is not None:
        response["id"] = request_id
    head = json_dumps(response)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)

