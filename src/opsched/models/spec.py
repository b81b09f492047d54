"""Turn a model specifier into a model and its example inputs.

Specifiers: a zoo name (``inception_v3``, ``squeezenet``, ``nasnet``, ``randwire``, ``gpt-small-decode``),
``torchvision:NAME``,
``timm:NAME``, or ``path/to/file.py:factory``. A factory returns ``(model, example_inputs)`` or a model
alone, which then needs ``input_shapes``. ``batch`` rescales the first dimension of every example input.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opsched.errors import ModelSpecError
from opsched.graph.ir import Graph
from opsched.models.gpt import gpt3_decode, gpt_small_decode
from opsched.models.randwire import randwire
from opsched.models.squeezenet import squeezenet
from opsched.models.wrapped import inception_v3, nasnet

ZOO: dict[str, Callable[..., tuple[torch.nn.Module, tuple]]] = {
    "inception_v3": inception_v3, "squeezenet": squeezenet, "nasnet": nasnet, "randwire": randwire,
    "gpt-small-decode": gpt_small_decode,
}

# Graphs of units made from an architecture's sizes, without a model (too large to build here): for mapping
# onto simulated devices. ``UNIT_GRAPHS[name](batch)`` gives the Graph.
UNIT_GRAPHS: dict[str, Callable[[int], Graph]] = {"gpt3-decode": gpt3_decode}


def unit_graph(spec: str, batch: int | None = None) -> Graph | None:
    """The graph of units ``spec`` names in :data:`UNIT_GRAPHS` (at ``batch``, default 1), else None."""
    if spec not in UNIT_GRAPHS:
        return None
    if batch is not None and batch < 1:
        raise ModelSpecError(f"batch must be at least 1, got {batch}")
    return UNIT_GRAPHS[spec](batch or 1)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    inputs: tuple

    def to(self, device: str) -> LoadedModel:
        """Move the model and its example inputs to ``device``, in place; returns this LoadedModel."""
        self.model.to(device)
        self.inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in self.inputs)
        return self


def load_model(spec: str, *, batch: int | None = None, input_shapes: Sequence[Sequence[int]] | None = None,
               image_size: int | None = None) -> LoadedModel:
    """Load the model ``spec`` names, with example inputs of batch ``batch`` (default: as the model gives).

    >>> m = load_model("squeezenet", batch=2, image_size=64)
    >>> m.name, tuple(m.inputs[0].shape)
    ('squeezenet', (2, 3, 64, 64))
    """
    if batch is not None and batch < 1:
        raise ModelSpecError(f"batch must be at least 1, got {batch}")
    if spec in ZOO:
        model, inputs = ZOO[spec](batch=batch or 1, image_size=image_size)
        return LoadedModel(spec, model, inputs)
    prefix, sep, rest = spec.partition(":")
    if sep and prefix == "torchvision":
        model, inputs = _torchvision(rest, image_size)
    elif sep and prefix == "timm":
        model, inputs = _timm(rest, image_size)
    elif sep and rest and prefix.endswith(".py"):
        model, inputs = _from_file(Path(prefix), rest)
    else:
        raise ModelSpecError(f"unknown model {spec!r}: use a zoo name ({', '.join(ZOO)}), torchvision:NAME, "
                             "timm:NAME or path/to/file.py:factory")
    if inputs is None:
        if not input_shapes:
            raise ModelSpecError(f"{spec} returns a model without example inputs: give --input-shape, "
                                 "e.g. --input-shape 1x3x224x224")
        inputs = tuple(torch.randn(*shape) for shape in input_shapes)
    elif input_shapes:
        inputs = tuple(torch.randn(*shape) for shape in input_shapes)
    inputs = inputs if isinstance(inputs, tuple) else tuple(inputs) if isinstance(inputs, list) else (inputs,)
    if batch is not None:
        inputs = tuple(rebatch(t, batch) for t in inputs)
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec} gave a {type(model).__name__}, not a torch.nn.Module")
    return LoadedModel(spec, model.eval(), inputs)


def load_models(spec: str, *, batch: int | None = None, input_shapes: Sequence[Sequence[int]] | None = None,
                image_size: int | None = None) -> list[LoadedModel]:
    """The models ``spec`` names: one, or, for a model file whose factory returns a list of ``(model,
    example_inputs)`` pairs (a model batch; modules they share stay shared), one per pair, named
    ``SPEC[k]``."""
    prefix, sep, rest = spec.partition(":")
    if not (sep and rest and prefix.endswith(".py")):
        return [load_model(spec, batch=batch, input_shapes=input_shapes, image_size=image_size)]
    result, _ = _from_file(Path(prefix), rest)
    if result is None:
        raise ModelSpecError(f"{spec} returned nothing: return a model, (model, example_inputs) or a list of pairs")
    if not isinstance(result, list):
        return [load_model(spec, batch=batch, input_shapes=input_shapes, image_size=image_size)]
    if not result:
        raise ModelSpecError(f"{spec} returned an empty list: a model batch needs at least one model")
    loaded = []
    for k, pair in enumerate(result):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], torch.nn.Module)):
            raise ModelSpecError(f"{spec} returned a list whose entry {k} is not a (model, example_inputs) pair")
        model, inputs = pair
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if batch is not None:
            inputs = tuple(rebatch(t, batch) for t in inputs)
        loaded.append(LoadedModel(f"{spec}[{k}]", model.eval(), inputs))
    return loaded


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1x3x224x224"`` -> ``(1, 3, 224, 224)``."""
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ModelSpecError(f"bad input shape {text!r}: expected sizes joined by x, e.g. 1x3x224x224") from None
    if not shape or any(s < 1 for s in shape):
        raise ModelSpecError(f"bad input shape {text!r}: every size must be a positive integer")
    return shape


def rebatch(value: Any, batch: int) -> Any:
    """Repeat (or cut) a tensor along its first dimension to ``batch`` rows, in the same memory format
    (contiguous, or channels_last where ``value`` is)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    reps = math.ceil(batch / value.shape[0])
    layout = torch.channels_last if value.dim() == 4 and not value.is_contiguous() and \
        value.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return value.repeat(reps, *([1] * (value.dim() - 1)))[:batch].contiguous(memory_format=layout)


def _torchvision(name: str, image_size: int | None):
    import torchvision

    try:
        builder = torchvision.models.get_model_builder(name)
    except ValueError:
        raise ModelSpecError(f"torchvision has no model {name!r}") from None
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None  # segmentation and detection models fetch their backbone's otherwise
    if name in {"googlenet", "inception_v3"}:
        kwargs.update(aux_logits=False, init_weights=False)
    model = without_zero_weights(builder(**kwargs))
    if name in torchvision.models.list_models(module=torchvision.models.video):
        # a clip of 16 frames at the size the model's weights were made for (their transforms' crop: 112 px for
        # R3D, MC3 and R(2+1)D, 224 for S3D, MViT and Swin3D, which MViT's position encoding fixes)
        size = image_size or torchvision.models.get_model_weights(name).DEFAULT.transforms.keywords["crop_size"][0]
        return model, (torch.randn(1, 3, 16, size, size),)
    size = image_size or (299 if name == "inception_v3" else 224)
    return model, (torch.randn(1, 3, size, size),)


def _timm(name: str, image_size: int | None):
    try:
        import timm
    except ImportError:
        raise ModelSpecError("timm:NAME needs the timm package (pip install timm)") from None
    if not timm.is_model(name):
        raise ModelSpecError(f"timm has no model {name!r}")
    torch.manual_seed(0)
    model = without_zero_weights(timm.create_model(name, pretrained=False))
    c, h, w = model.pretrained_cfg.get("input_size", (3, 224, 224))
    if image_size:
        h = w = image_size
    return model, (torch.randn(1, c, h, w),)


def without_zero_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter that is all zeros, other than a bias, drawn at random instead (normal, 0.02;
    seeded). torchvision and timm zero-initialise some classifiers (torchvision's ViT heads, timm's MLP-Mixer,
    ResMLP and gMLP heads, the last norm of many timm residual blocks): untrained, their output is then a
    constant, or a branch adds nothing, and no comparison with the model could tell a wrong plan from a right
    one (ResMLP-12's plans "matched" with an error of exactly 0, as did five rows of the sweep of 2026-11-26).

    >>> head = torch.nn.Linear(4, 2)
    >>> for p in head.parameters(): _ = torch.nn.init.zeros_(p)
    >>> head = without_zero_weights(head)
    >>> bool(head.weight.abs().min() > 0), bool(head.bias.abs().max() == 0)
    (True, True)
    """
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith("bias") and parameter.is_floating_point() and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def _from_file(path: Path, factory_name: str):
    if not path.is_file():
        raise ModelSpecError(f"no such model file: {path}")
    module_spec = importlib.util.spec_from_file_location(f"opsched_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ModelSpecError(f"cannot import {path}: {type(e).__name__}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelSpecError(f"{path} has no callable {factory_name!r}")
    try:
        result = factory()
    except Exception as e:
        raise ModelSpecError(f"{path}:{factory_name}() failed: {type(e).__name__}: {e}") from e
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        return result
    return result, None
