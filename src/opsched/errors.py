"""The exceptions opsched raises on purpose. The CLI turns each into one line on stderr: exit status 1 for
:class:`VerificationError` (a plan that does not reproduce the model), 2 for every other (bad input)."""


def first_line(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


class OpschedError(Exception):
    """Base class of every error opsched raises on purpose."""


class VerificationError(OpschedError, RuntimeError):
    """A plan whose outputs differ from the model's beyond tolerance, or that fails to run: not bad input, but
    the one failure opsched exists to prevent (exit status 1)."""


class GraphError(OpschedError, ValueError):
    """A graph that is not a DAG of uniquely named units with known inputs."""


class DagJsonError(GraphError):
    """A DAG JSON file that cannot be read or does not describe a valid graph."""


class CaptureError(OpschedError):
    """A PyTorch model that neither torch.export nor torch.fx could capture."""


class ModelSpecError(OpschedError, ValueError):
    """A model specifier (zoo name, torchvision:NAME, timm:NAME, file.py:factory) that cannot be loaded."""


class SignatureMismatch(OpschedError, ValueError):
    """A call a plan was not made for (another batch, shape, dtype, device, memory layout, autocast state, or a
    model in training mode), refused rather than answered by the wrong plan: the message names what differs."""


class StaleWeights(OpschedError, RuntimeError):
    """A plan called after the model's weights changed, where it cannot rebuild what it derived from them (a
    module from ``opsched.compile``): the message says which weight changed."""


class NoGradient(OpschedError, RuntimeError):
    """A backward pass through an output of an optimized module: its plans run in inference mode and carry no
    gradient to the model's weights, where the model's own outputs would."""
