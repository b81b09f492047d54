"""``opsched serve``: load each MODEL (``NAME=`` to name it, ``@PLAN.json`` for a saved plan) and serve them all
(:func:`opsched.serving.serve`) until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError


def served_models(args: argparse.Namespace) -> tuple[dict[str, tuple[Any, tuple]], dict[str, Path]]:
    """Each MODEL loaded, by the name it is served under, and the plan files given for some."""
    from opsched.models.spec import load_model, parse_shape

    shapes = [parse_shape(s) for s in args.input_shape or []]
    models: dict[str, tuple[Any, tuple]] = {}
    plans: dict[str, Path] = {}
    for given in args.models:
        name, equals, spec = given.partition("=")
        if not equals:
            name, spec = "", given
        spec, at, plan = spec.partition("@")
        if at and not Path(plan).is_file():
            raise OpschedError(f"{plan}: no such plan file")
        loaded = load_model(spec, batch=args.batch, input_shapes=shapes or None, image_size=args.image_size)
        name = name or spec.rsplit(":", 1)[-1].removesuffix(".py").rsplit("/", 1)[-1]
        if not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise OpschedError(f"{given}: {name!r} cannot name a model in a URL; give NAME=MODEL")
        if name in models:
            raise OpschedError(f"two models would be served as {name!r}; give one NAME=MODEL")
        models[name] = (loaded.model.eval(), tuple(loaded.inputs))
        if at:
            plans[name] = Path(plan)
    return models, plans


def _exit_0(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.serving import serve

    # SIGTERM ends with exit status 0: while uvicorn serves it takes the signal, drains, and raises it again once it
    # has stopped, to this handler; before (the models loading, the socket bound) the handler ends the command
    engine = args.engine or ("ray" if args.address else None)
    if engine != "ray" and (args.address or args.replicas):
        raise OpschedError(f"{'--address' if args.address else '--replicas'} goes with --engine ray")
    if engine == "ray":  # a missing Ray Serve is said before the models load, not after
        from opsched.serving.ray_engine import import_serve

        import_serve(args.address)
    previous = signal.signal(signal.SIGTERM, _exit_0)
    try:
        models, plans = served_models(args)
        serve(models, host=args.host, port=args.port, max_delay_ms=args.max_delay_ms, max_batch=args.max_batch,
              queue_size=args.queue_size, max_body_mb=args.max_body_mb, optimize=not args.no_optimize,
              fuse=not args.no_fuse, fuse_max_batch=args.fuse_max_batch,
              optimize_options={"repeats": args.repeats, "kernels": args.kernels, "cache": not args.no_cache},
              plans=plans, engine=engine, replicas=args.replicas or 1, address=args.address)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {}
