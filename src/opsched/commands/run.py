"""``opsched run``: execute a plan of any kind through the same evaluation every job ends with (verify against
the model, time interleaved with its baseline), by the plan's kind:

- a schedule (``opsched optimize``): MODEL loaded at the plan's batch, timed against eager;
- a model batch's plan (``opsched multi``): the batch rebuilt as the plan's ``models`` section records it,
  each model verified against its own forward, timed against ``sequential_models``;
- a mapping (``opsched map``): its devices as threads of this process (``--engine local``) or as Ray actors
  (``--engine ray``), timed against eager.

The parsed arguments are read, never changed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from opsched.commands.common import count, flat, load_and_capture, read_plan
from opsched.errors import OpschedError


def run(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.jobs import check_runs_here

    plan = read_plan(args.plan)
    devices = check_runs_here(plan, args.plan)
    engine = _engine(args, plan)
    if plan.kind != "model batch" and (len(args.models) > 1 or args.copies is not None
                                       or args.preprocess is not None):
        what = "several MODELs go" if len(args.models) > 1 else \
            "--copies goes" if args.copies is not None else "--preprocess goes"
        raise OpschedError(f"{what} with a plan made by opsched multi; {args.plan} was made for one model")
    load = None
    if plan.kind == "model batch":
        from opsched.multi.load import resolve_load

        load = resolve_load(args, plan)
    elif args.batch is not None and plan.batch and args.batch != plan.batch:
        raise OpschedError(f"{args.plan} was made for batch {plan.batch}, not {args.batch}")
    with contextlib.ExitStack() as ray_run:  # a Ray started for the run is shut down at the end, even on error
        cluster = None
        if engine == "ray":  # joined before the model is loaded: a cluster that will not do is said at once
            from opsched.runtime.ray import ray_cluster

            used = [d for d in plan.devices.devices if devices.get(d.name)]
            cluster = ray_run.enter_context(ray_cluster([d.node for d in used], sum(d.threads for d in used),
                                                        args.address))
        return _run_plan(args, plan, load, devices, ray_run, cluster)


def _run_plan(args: argparse.Namespace, plan: Any, load: argparse.Namespace | None, devices: dict[str, int] | None,
              ray_run: contextlib.ExitStack, cluster: str | None) -> dict[str, Any]:
    """``opsched run`` once the plan is read and checked: its model (or batch) loaded, its candidate and the
    baseline evaluated, on the local engine or on the Ray ``cluster`` joined (``ray_run`` holds it, and is
    given the actors to end)."""
    import torch

    from opsched.jobs import plan_choice
    from opsched.jobs import run as run_plan

    device = plan.device if plan.device in ("cpu", "cuda") else "cpu"  # a mapped plan runs on its CPU devices
    cuda_graph = args.cuda_graph or plan.run.cuda_graph
    if cuda_graph and device != "cuda":
        raise OpschedError(f"--cuda-graph needs a plan made for cuda; {args.plan} was made for {plan.device}")
    names = None
    if load is not None:  # the model is the batch (each model's forward in turn), timed against sequential_models
        from opsched.multi.load import rebuild_batch

        loaded, graph, names = rebuild_batch(load, plan, device)
    else:
        # at the plan's batch, and at the image size its call was made for unless another is asked
        at_batch = argparse.Namespace(**{**vars(args), "batch": args.batch or plan.batch,
                                         "image_size": args.image_size or _recorded_image_size(plan, args)})
        loaded, graph, _, _ = load_and_capture(at_batch, args.models[0], device)
    baseline = "eager" if load is None else "sequential_models"
    cores = args.threads or torch.get_num_threads()
    kernels = plan.run.kernels
    inputs = tuple(loaded.inputs)
    engine = "ray" if cluster else "local"
    ray_summary: dict[str, Any] = {}

    def on_ray(label: str, cores: int) -> list:
        candidates, about = _ray_candidates(ray_run, graph, plan, label, inputs, cores, cluster)
        ray_summary.update(about)
        return candidates

    outcome = run_plan(plan, loaded.model, inputs, graph=graph, baseline=baseline, threads=cores,
                       tolerance=args.tolerance, repeats=args.repeats, cuda_graph=cuda_graph,
                       engine=on_ray if engine == "ray" else None)
    ev = outcome.evaluation
    label, chosen = plan_choice(plan)
    ran = chosen["name"] if chosen["name"] in ev.measured_ms else label
    result = {"model": loaded.name, "plan": args.plan, "method": plan.method, "batch": plan.batch, "kernels": kernels,
              "chosen": ran, "measured_ms": dict(ev.measured_ms), "eager_threads": ev.threads.get("eager"),
              "predicted_ms": plan.predicted_latency if plan.costed else None, "max_error": ev.errors[ran],
              "max_abs_error": ev.abs_errors[ran],
              "tie": list(ev.tie), "noise": ev.noise(), "speedups": {"over": baseline, **ev.speedups(baseline)},
              "warnings": ev.warnings + outcome.notes, "engine": engine}
    if names is not None:  # each model's outputs under what ran, against its own forward, as opsched multi does
        from opsched.multi.optimize import model_errors

        del result["eager_threads"]
        result.update(models=names, threads={n: t for n, t in ev.threads.items() if t is not None},
                      model_errors=model_errors(lambda *_: ev.runs[ran](), loaded.model, cores))
    if devices is not None:
        result["devices"] = devices
    if engine == "ray":
        result["ray"] = ray_summary
    for warning in result["warnings"]:
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if args.trace:
        result["trace"] = _trace(args, outcome, plan, label, inputs, cores, device, cuda_graph, loaded.name)
    if not args.json:
        _print(result, ev, plan, label, baseline, cores, ray_summary if engine == "ray" else None, args)
    return result


def _recorded_image_size(plan: Any, args: argparse.Namespace) -> int | None:
    """The height and width of the one square image the plan's call was made for (``opsched optimize`` records
    its inputs), where no input shape is given."""
    shapes = [i.get("shape") for i in plan.inputs or [] if isinstance(i, dict)]
    if args.input_shape or len(shapes) != 1 or not isinstance(shapes[0], list) or len(shapes[0]) != 4:
        return None
    return shapes[0][3] if shapes[0][2] == shapes[0][3] else None


def _trace(args: argparse.Namespace, outcome: Any, plan: Any, label: str, inputs: tuple, cores: int, device: str,
           cuda_graph: bool, name: str) -> str:
    """Write a Chrome/Perfetto trace of one measured run of the plan."""
    from opsched.report.trace import write_trace
    from opsched.runtime.module import OptimizedModule
    from opsched.schedule import OpTiming

    module = outcome.modules[label]
    if cuda_graph:  # a replayed graph has no per-step timeline: trace the same program on streams
        module = OptimizedModule(outcome.graph, plan, cores, outcome.kernels, device)
    module.executor(*flat(inputs), record_timeline=True)
    ran_graph = module.program.graph  # with compiled regions, the fused graph
    ops = [OpTiming(ran_graph.nodes[u].name, stream, start * 1000.0, finish * 1000.0)
           for stream, units, start, finish in module.executor.timeline for u in units]
    write_trace(args.trace, ops, f"measured on {'this CPU' if device == 'cpu' else 'the GPU'}: {name} {plan.method}")
    return args.trace


def _print(result: dict[str, Any], ev: Any, plan: Any, label: str, baseline: str, cores: int,
           ray_summary: dict[str, Any] | None, args: argparse.Namespace) -> None:
    eager = ev.measured_ms[baseline]
    ran = result["chosen"]
    print(f"plan          {args.plan} ({plan.method}, batch {plan.batch}, {result['kernels']} kernels)")
    if "models" in result:
        names = result["models"]
        print(f"models        {len(names)}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    if "devices" in result:
        used = sum(1 for n in result["devices"].values() if n)
        if ray_summary is not None:
            actors = "1 actor for the node's " + count(used, "device") if ray_summary["actor_per"] == "node" \
                else count(used, "actor")
            how = (f"{actors} on {ray_summary['cluster']}, {count(ray_summary['calls'], 'call')} per inference"
                   + (" in a Ray Compiled Graph" if ray_summary["compiled_graph"] else ""))
        else:
            how = f"{count(used, 'device')} as threads"
        print(f"engine        {result['engine']}: {how}")
    print(f"verified      largest error {ev.errors[label]:.3g} of each output's magnitude"
          + (f"; every model within {max(result['model_errors']):.2g} of its own forward ({ran})"
             if "models" in result else ""))
    width = max(13, len(baseline), len(label), len(ran))
    print(f"{baseline:<{width}} {eager:.2f} ms  (best of 1 and {cores} threads: {ev.threads[baseline]})")
    speedups = result["speedups"]  # over the rounds both ran (a race leaves plainly slower ones out early)
    ms = ev.measured_ms[label]
    predicted = f"predicted {plan.predicted_latency:.2f} ms" if plan.costed else "measured, not costed"
    print(f"{label:<{width}} {ms:.2f} ms  ({speedups[label]:.2f}x {baseline}; {predicted})")
    if ran != label:
        ms = ev.measured_ms[ran]
        print(f"{ran:<{width}} {ms:.2f} ms  ({speedups[ran]:.2f}x {baseline}): the configuration the plan chose")
    if args.trace:
        print(f"trace         {args.trace} (measured)")


def _engine(args: argparse.Namespace, plan: Any) -> str:
    """The engine ``opsched run`` uses: ``--engine``, else ray when ``--address`` is given, else local (every
    device in this process). Ray is refused for what it cannot run, and when it is not installed."""
    from opsched.mapping.execute import cuda_devices

    engine = args.engine or ("ray" if args.address else "local")
    on_cuda = ", ".join(name for name, _ in cuda_devices(plan)) if plan.kind == "mapping" else ""
    if engine != "ray":
        if args.address:
            raise OpschedError("--address names a Ray cluster: it goes with --engine ray")
        if args.trace and on_cuda:
            raise OpschedError(f"--trace records per-unit times, which a plan on CUDA devices ({on_cuda}) does not")
        return engine
    if plan.kind != "mapping":
        raise OpschedError(f"--engine ray runs a mapped plan (made by opsched map); {args.plan} maps no devices")
    if on_cuda:
        raise OpschedError(f"--engine ray runs CPU devices; {args.plan} maps units onto CUDA device(s) {on_cuda}: "
                           "run it with --engine local")
    if args.trace:
        raise OpschedError("--trace records the local engine's threads; it cannot be used with --engine ray")
    if plan.run.kernels != "eager":
        raise OpschedError(f"--engine ray runs eager kernels; {args.plan} asks for {plan.run.kernels}")
    from opsched.runtime.ray import import_ray

    import_ray(local=args.address is None)  # a missing Ray is said before the model is loaded
    return engine


def _ray_candidates(ray_run: contextlib.ExitStack, graph: Any, plan: Any, label: str, inputs: tuple, cores: int,
                    cluster: str) -> tuple[list, dict[str, Any]]:
    """The plan on the joined Ray, as the one candidate the evaluation verifies and times (its actors end when
    ``ray_run`` closes), and what the JSON says of it. No ``expected_ms``: the plan's prediction has no Ray in
    it."""
    from opsched.evaluation import Candidate, module_runner
    from opsched.runtime.ray import RayModule

    module = ray_run.enter_context(RayModule(graph, plan))
    about = {"cluster": cluster, "compiled_graph": module.compiled, "calls": len(module.segments),
             "actors": {d.name: d.node for d in module.devices}, "actor_per": "node" if module.per_node else "device"}
    return [Candidate(label, module_runner(module, inputs, cores), module=module)], about
