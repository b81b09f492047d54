"""Loading a model batch as the command line names it (MODELs, ``--copies``, ``--preprocess``, ``--batch``,
``--input-shape``, ``--image-size``), as ``opsched multi`` loads it and ``opsched run`` rebuilds it from the
``models`` section of a plan."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from opsched.errors import OpschedError
from opsched.runtime.cuda import tensor_device
from opsched.schedule import LOAD_OPTIONS, ScheduleError


def load_batch(args: argparse.Namespace) -> tuple[list[str], list[Any]]:
    """The models the command line names (each ``--copies`` times, every copy with its own seeded random
    weights): their names and LoadedModels."""
    import torch

    from opsched.models.spec import LoadedModel, load_models, parse_shape

    shapes = [parse_shape(s) for s in args.input_shape or []]
    loaded: list[LoadedModel] = []
    for spec in args.models:
        group = load_models(spec, batch=args.batch, input_shapes=shapes or None, image_size=args.image_size)
        for k in range(args.copies):
            if k == 0:
                loaded += group
                continue
            models = copy.deepcopy([g.model for g in group])  # one deepcopy: modules shared stay shared
            torch.manual_seed(k)
            for model in models:
                for module in model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
            loaded += [LoadedModel(f"{g.name}#{k}", m.eval(), g.inputs) for g, m in zip(group, models)]
    return [m.name for m in loaded], loaded


def _load_preprocessing(args: argparse.Namespace, device: str = "cpu") -> tuple[Any, tuple]:
    """``--preprocess``: the module every model's input goes through once, and its example (raw) inputs, on
    ``device``."""
    from opsched.models.spec import load_models

    found = load_models(args.preprocess, batch=args.batch, image_size=args.image_size)
    if len(found) != 1:
        raise OpschedError(f"--preprocess {args.preprocess}: expected one module, found {len(found)}")
    found[0].to(tensor_device(device))
    return found[0].model.eval(), found[0].inputs


def load_command_batch(args: argparse.Namespace, device: str = "cpu") -> tuple[list[str], list[Any], Any, Any]:
    """The model batch the command line names (MODELs, ``--copies``, ``--preprocess``, ``--batch``,
    ``--input-shape``, ``--image-size``), as ``opsched multi`` loads it and ``opsched run`` rebuilds it from a
    plan, on ``device``: the models' names and LoadedModels, the inputs
    :func:`opsched.multi.optimize.model_batch` takes (each model's own, or the raw inputs the preprocessing
    reads) and the preprocessing module (or None)."""
    names, loaded = load_batch(args)
    for m in loaded:
        m.to(tensor_device(device))
    inputs, preprocess = [m.inputs for m in loaded], None
    if args.preprocess:
        preprocess, inputs = _load_preprocessing(args, device)
    return names, loaded, inputs, preprocess


def load_record(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's MODELs and the options that load the batch, as a plan's ``models`` section records
    them."""
    return {key: getattr(args, key) for key in LOAD_OPTIONS}


def resolve_load(args: argparse.Namespace, plan: Any) -> argparse.Namespace:
    """What ``opsched run`` loads for a model batch's plan: the options the command line gives, those it does
    not taken from the plan; a command line that names another batch than the plan was made for (other
    models, copies, preprocessing, batch or input shapes) is refused in one line. ``args`` is left as it is."""
    from opsched.models.spec import parse_shape

    load = plan.models.load
    if load is None:
        raise ScheduleError(f"{args.plan} was made by an opsched multi that did not record how to rebuild its "
                            "batch; make it again with opsched multi ... --out")
    models = load["models"]
    if len(args.models) != len(models) or not all(map(same_spec, args.models, models)):
        raise OpschedError(f"{args.plan} was made for the models {' '.join(models)}, not {' '.join(args.models)}")
    resolved = dict(load, models=list(args.models))
    for key, flag in (("copies", "--copies"), ("preprocess", "--preprocess"), ("input_shape", "--input-shape"),
                      ("image_size", "--image-size")):
        recorded, given = load.get(key), getattr(args, key)
        if given is None:
            continue
        if key == "input_shape" and recorded is not None:
            same = [parse_shape(s) for s in given] == [parse_shape(s) for s in recorded]
        else:
            same = given == recorded or (key == "preprocess" and recorded is not None and same_spec(given, recorded))
        if same:
            resolved[key] = given
            continue
        if recorded is None:
            raise OpschedError(f"{args.plan} was made without {flag}; leave it out")
        if key == "input_shape":
            recorded, given = " ".join(recorded), " ".join(given)
        raise OpschedError(f"{args.plan} was made for {flag} {recorded}, not {given}")
    if args.batch is not None and args.batch not in (load.get("batch"), plan.batch):
        raise OpschedError(f"{args.plan} was made for batch {load.get('batch') or plan.batch}, not {args.batch}")
    if args.batch is not None:
        resolved["batch"] = args.batch
    return argparse.Namespace(**resolved)


def same_spec(given: str, recorded: str) -> bool:
    """Two model (or preprocessing) specifiers name the same thing: equal, or the same factory of one file."""
    from pathlib import Path

    if given == recorded:
        return True
    path, sep, factory = given.rpartition(":")
    other, other_sep, other_factory = recorded.rpartition(":")
    return bool(sep and other_sep and path.endswith(".py") and factory == other_factory
                and Path(path).resolve() == Path(other).resolve())


def rebuild_batch(load: argparse.Namespace, plan: Any, device: str = "cpu") -> tuple[Any, Any, list[str]]:
    """The model batch a plan's ``models`` section was made for, loaded as ``opsched multi`` loads it (``load``:
    see :func:`resolve_load`) onto ``device``, and its graph with the plan's rewrites made: (a LoadedModel
    whose model is the :class:`opsched.multi.ModelBatch` and whose inputs are the batch's, the graph, the
    models' names)."""
    from opsched.models.spec import LoadedModel
    from opsched.multi.fuse import fuse_graph
    from opsched.multi.optimize import model_batch

    record = plan.models
    names, loaded, inputs, preprocess = load_command_batch(load, device)
    batch = model_batch([m.model for m in loaded], inputs, preprocess)
    for m in batch.models:
        m.eval()
    try:
        fusion = fuse_graph(batch, record.rewrites, made=record.batched)
    except ValueError as e:  # an unknown rewrite: a hand edit
        raise ScheduleError(f"the plan's models section: {e}") from None
    name = " ".join(load.models) + (f" x{load.copies}" if load.copies > 1 else "")
    return LoadedModel(name, batch, tuple(batch.inputs)), fusion.graph, names
