"""The model zoo and model specifiers (zoo name, torchvision:NAME, timm:NAME, path/to/file.py:factory)."""

from opsched.models.randwire import randwire
from opsched.models.spec import ZOO, LoadedModel, load_model
from opsched.models.squeezenet import squeezenet
from opsched.models.wrapped import inception_v3, nasnet

__all__ = ["ZOO", "LoadedModel", "inception_v3", "load_model", "nasnet", "randwire", "squeezenet"]
