"""Exceptions raised for bad input; the CLI turns each into one line and exit status 2."""


class OpschedError(Exception):
    """Base class of every error opsched raises on purpose."""


class GraphError(OpschedError, ValueError):
    """A graph that is not a DAG of uniquely named units with known inputs."""


class DagJsonError(GraphError):
    """A DAG JSON file that cannot be read or does not describe a valid graph."""


class CaptureError(OpschedError):
    """A PyTorch model that neither torch.export nor torch.fx could capture."""


class ModelSpecError(OpschedError, ValueError):
    """A model specifier (zoo name, torchvision:NAME, timm:NAME, file.py:factory) that cannot be loaded."""
