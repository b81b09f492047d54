"""The commands that run models: ``optimize``, ``run``, ``show`` and ``cache`` (``cli.py`` parses the
arguments and reports errors; ``graph`` and ``schedule`` live there)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError
from opsched.progress import say

TABLE_METHODS = ("sequential", "greedy", "lios")


class VerificationFailed(RuntimeError):
    """A schedule's outputs differ from the model's beyond tolerance (exit status 1)."""


def optimize_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.cost.simulate import device_named

    model_spec = args.model or "inception_v3"
    simulated = args.cost.startswith("sim:")
    if simulated:
        device_named(args.cost)  # an unknown device is bad input: say so before loading anything
    elif args.cost != "measured":
        raise OpschedError(f"--cost takes measured or sim:NAME, got {args.cost!r}")
    plan_path, gantt_path = _output_paths(args, model_spec)
    import torch

    from opsched.pipeline import Job, method_options, run_job

    if args.device == "cuda" and not torch.cuda.is_available():
        raise OpschedError("--device cuda: PyTorch sees no CUDA device here")
    if args.cuda_graph and (simulated or args.device != "cuda"):
        raise OpschedError("--cuda-graph needs --device cuda (and measured costs)")
    from opsched.runtime.kernels import check_kernels

    check_kernels(args.kernels)
    cores = args.threads or torch.get_num_threads()
    loaded, graph, load_seconds, capture_seconds = load_and_capture(args, model_spec,
                                                                    args.device if not simulated else "cpu",
                                                                    say=say)
    # On a CPU more streams than cores only take turns; LIOS's 8 streams are for a GPU.
    default_streams = 8 if simulated or args.device == "cuda" else cores
    methods = {m: (m, method_options(m, streams=args.streams, max_group_size=args.max_group_size,
                                     max_groups=args.max_groups, max_block_size=args.max_block_size,
                                     default_streams=default_streams))
               for m in dict.fromkeys([*TABLE_METHODS, args.method])}
    peers = ("eager", "torch_compile", "onnxruntime") if args.peers or args.kernels != "eager" else ("eager",)
    outcome = run_job(Job(loaded.model, tuple(loaded.inputs), graph, methods, cost=args.cost, device=args.device,
                          kernels=args.kernels, cores=cores, peers=peers, tolerance=args.tolerance,
                          repeats=args.repeats, cache=not args.no_cache, cuda_graph=args.cuda_graph,
                          say=say,
                          profile_progress=_progress_bar))
    schedules = outcome.schedules
    requested = schedules[args.method]
    result: dict[str, Any] = {
        "model": loaded.name, "batch": requested.batch, "device": args.cost if simulated else args.device,
        "cost": args.cost, "simulated": simulated, "method": args.method, "kernels": args.kernels,
        "units": len(graph), "search_seconds": requested.stats["search_seconds"], "plan": str(plan_path),
        "predicted_ms": {m: s.predicted_latency for m, s in schedules.items()},
        "load_seconds": round(load_seconds, 3), "capture_seconds": round(capture_seconds, 3),
        "reason": explain(requested, graph, outcome.cost),
    }
    plan = requested
    if not simulated:
        plan = outcome.plan()
        ev = outcome.evaluation
        if plan is None:
            raise VerificationFailed("no schedule verified: " + "; ".join(f"{n}: {why}" for n, why in ev.dropped.items()
                                                                          if n in schedules))
        result.update(_measured_fields(outcome, plan, cores))
    plan.save(plan_path)
    result["gantt"] = str(gantt_path)
    from opsched.report.gantt import merged_units, write_gantt

    write_gantt(gantt_path, plan.ops, graph, _timeline_title(plan, loaded.name), merges=merged_units(plan))
    for warning in result.get("warnings", []):
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if not args.json:
        _print_optimize(result, schedules)
    return result


def _measured_fields(outcome, plan, cores: int) -> dict[str, Any]:
    """The measured part of optimize's JSON: every verified configuration's median, the one chosen, the
    errors, and what was dropped or left out and why."""
    ev = outcome.evaluation
    out: dict[str, Any] = {
        "measured_ms": dict(ev.measured_ms), "threads": {n: t for n, t in ev.threads.items() if t is not None},
        "chosen": ev.chosen, "plan_method": plan.options["measured_as"],
        "max_abs_error": ev.errors[plan.options["measured_as"]],
        "max_abs_errors": dict(ev.errors), "dropped": dict(ev.dropped), "warnings": ev.warnings + outcome.notes,
        "cost_model": outcome.cost.describe(),
    }
    out["eager_threads"] = ev.threads.get("eager")
    out["fastest_measured"] = ev.chosen
    if hasattr(outcome.operator, "compile_seconds"):
        out["compile_seconds"] = round(outcome.operator.compile_seconds, 1)
    eager = getattr(outcome.operator, "eager_units", None)
    if eager:
        out["warnings"].append(f"{len(eager)} unit(s) ONNX Runtime could not take ran eagerly: "
                               f"{', '.join(eager[:5])}{' ...' if len(eager) > 5 else ''}")
    return out


def explain(schedule, graph, cost) -> str:
    """Why the schedule looks as it does, in one sentence: what its stages do, and, when it runs one unit at
    a time, what concurrency and merging cost under this cost model."""
    if schedule.stages is None:
        streams = sum(1 for units in schedule.streams() if units)
        return f"{streams} stream(s); units wait only on inputs from other streams"
    concurrent = sum(1 for st in schedule.stages if st.strategy == "concurrent" and len(st.groups) > 1)
    merges = sum(1 for st in schedule.stages if st.strategy == "merge")
    if schedule.options.get("regions"):
        blocks = schedule.stats.get("region_blocks", 0)
        return (f"{blocks} of {schedule.stats.get('blocks_of_several', '?')} blocks of several units run as "
                f"compiled regions (the compiler fuses across their units), {concurrent} concurrent stage(s) and "
                f"{merges} merge(s) predicted to pay; units run back to back form one region")
    if concurrent or merges:
        return f"{concurrent} concurrent stage(s) and {merges} merge(s) predicted to pay"
    if graph.width == 1:
        return "one unit at a time: the graph is a chain, nothing can run at the same time"
    factors = []
    contention = getattr(cost, "contention", None)
    if contention:
        factors.append(f"concurrent stages cost {contention:.2f}x their units' time on the cores they share")
    merge = getattr(cost, "merge_factor", None)
    if merge:
        factors.append(f"merged convolutions {merge:.2f}x their units")
    why = "; ".join(factors) if factors else "no stage was predicted faster than running its units in turn"
    return f"one unit at a time: nothing predicted to pay ({why})"


def run_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched import schedule as schedule_module
    from opsched.mapping.execute import check_runnable, is_mapping

    plan = schedule_module.from_dict(_read_plan(args.plan), args.plan)
    devices = check_runnable(plan) if is_mapping(plan) else None  # refuses simulated devices in one line
    if plan.device.startswith("sim:"):
        raise OpschedError(f"{args.plan} was made for a simulated device ({plan.device}); it can be shown "
                           "(opsched show) but not run here")
    engine = _run_engine(args, plan, devices)
    if plan.options.get("multi"):  # a model batch's plan (opsched multi): the batch is rebuilt as it was made
        from opsched.multi.command import check_run_args

        check_run_args(args, plan)
    else:
        if len(args.models) > 1 or args.copies is not None or args.preprocess is not None:
            what = "several MODELs go" if len(args.models) > 1 else \
                "--copies goes" if args.copies is not None else "--preprocess goes"
            raise OpschedError(f"{what} with a plan made by opsched multi; {args.plan} was made for one model")
        args.model = args.models[0]
        if args.batch is None and plan.batch:
            args.batch = plan.batch
        elif args.batch is not None and plan.batch and args.batch != plan.batch:
            raise OpschedError(f"{args.plan} was made for batch {plan.batch}, not {args.batch}")
    with contextlib.ExitStack() as ray_run:  # a Ray started for the run is shut down at the end, even on error
        cluster = None
        if engine == "ray":  # joined before the model is loaded: a cluster that will not do is said at once
            from opsched.runtime.ray import plan_devices, ray_cluster

            used = [d for d in plan_devices(plan) if devices.get(d.name)]
            cluster = ray_run.enter_context(ray_cluster([d.node for d in used], sum(d.threads for d in used),
                                                        args.address))
        return _run_plan(args, plan, devices, ray_run, cluster)


def _run_plan(args: argparse.Namespace, plan, devices: dict[str, int] | None, ray_run: contextlib.ExitStack,
              cluster: str | None) -> dict[str, Any]:
    """``opsched run`` once the plan is read and checked: on the local engine, or on the Ray ``cluster`` joined
    (``ray_run`` holds it, and is given the actors to end)."""
    import torch

    from opsched import schedule as schedule_module
    from opsched.pipeline import evaluate, peer_candidates, reference_outputs, schedule_candidates

    device = plan.device if plan.device in ("cpu", "cuda") else "cpu"  # a mapped plan runs on its CPU devices
    if device == "cuda" and not torch.cuda.is_available():
        raise OpschedError(f"{args.plan} was made for cuda; PyTorch sees no CUDA device here")
    cuda_graph = args.cuda_graph or bool(plan.options.get("cuda_graph"))
    if cuda_graph and device != "cuda":
        raise OpschedError(f"--cuda-graph needs a plan made for cuda; {args.plan} was made for {plan.device}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    multi = bool(plan.options.get("multi"))
    if multi:  # the model is the batch (each model's forward in turn), timed against sequential_models
        from opsched.multi.command import rebuild_batch

        loaded, graph, names = rebuild_batch(args, plan, device)
    else:
        loaded, graph, _, _ = load_and_capture(args, args.model, device)
    baseline = "sequential_models" if multi else "eager"
    schedule_module.validate(plan, graph)
    cores = args.threads or torch.get_num_threads()
    kernels = plan.options.get("kernels", "eager")
    label = plan.options.get("measured_as", plan.method)  # "ios", or "ios+regions" for compiled regions
    chosen = plan.options.get("chosen") or {"name": label, "kind": "schedule"}
    inputs = tuple(loaded.inputs)
    operator = None
    if kernels != "eager":
        from opsched.graph.interpret import all_values
        from opsched.runtime.kernels import operator_for

        operator = operator_for(kernels, all_values(graph, _flat(inputs)).__getitem__)
    engine = "ray" if cluster else "local"
    if engine == "ray":
        candidates, ray_summary = _ray_candidates(ray_run, graph, plan, label, inputs, cores, cluster)
    else:
        candidates, modules = schedule_candidates(graph, {label: plan}, operator, inputs, cores, device, sync,
                                                  cuda_graph)
    peers = [baseline] + ([chosen["name"]] if chosen["kind"] == "peer" and chosen["name"] != baseline else [])
    found, notes = peer_candidates(loaded.model, inputs, cores, peers, sync)
    ev = evaluate(candidates + found, reference_outputs(loaded.model, inputs, cores), args.tolerance, args.repeats)
    if label not in ev.measured_ms:
        raise VerificationFailed(f"the plan does not run as it should: {ev.dropped.get(label)}")
    ran = chosen["name"] if chosen["name"] in ev.measured_ms else label
    result = {"model": loaded.name, "plan": args.plan, "method": plan.method, "batch": plan.batch, "kernels": kernels,
              "chosen": ran, "measured_ms": dict(ev.measured_ms), "eager_threads": ev.threads.get("eager"),
              "predicted_ms": plan.predicted_latency, "max_abs_error": ev.errors[ran],
              "warnings": ev.warnings + notes, "engine": engine}
    if multi:  # each model's outputs under what ran, against its own forward, as opsched multi reports them
        from opsched.multi.optimize import model_errors

        run = next(c.run for c in candidates + found if c.name == ran and c.threads == ev.threads[ran])
        del result["eager_threads"]
        result.update(models=names, threads={n: t for n, t in ev.threads.items() if t is not None},
                      model_errors=model_errors(lambda *_: run(), loaded.model, cores))
    if devices is not None:
        result["devices"] = devices
    if engine == "ray":
        result["ray"] = ray_summary
    for warning in result["warnings"]:
        print(f"opsched: warning: {warning}", file=sys.stderr)
    if args.trace:
        from opsched.report.trace import write_trace
        from opsched.runtime.kernels import unit_operator
        from opsched.runtime.module import OptimizedModule
        from opsched.schedule import OpTiming

        module = modules[label]
        if cuda_graph:  # a replayed graph has no per-step timeline: trace the same program on streams
            module = OptimizedModule(graph, plan, cores, operator or unit_operator, device)
        module.executor(*_flat(inputs), record_timeline=True)
        ran_graph = module.program.graph  # with compiled regions, the fused graph
        ops = [OpTiming(ran_graph.nodes[u].name, stream, start * 1000.0, finish * 1000.0)
               for stream, units, start, finish in module.executor.timeline for u in units]
        write_trace(args.trace, ops, f"measured on {'this CPU' if device == 'cpu' else 'the GPU'}: "
                                     f"{loaded.name} {plan.method}")
        result["trace"] = args.trace
    if not args.json:
        eager = ev.measured_ms[baseline]
        print(f"plan          {args.plan} ({plan.method}, batch {plan.batch}, {kernels} kernels)")
        if multi:
            print(f"models        {len(names)}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
        if devices is not None:
            used = sum(1 for n in devices.values() if n)
            if engine == "ray":
                how = (f"{_count(used, 'actor')} on {ray_summary['cluster']}, {_count(ray_summary['calls'], 'call')} "
                       "per inference" + (" in a Ray Compiled Graph" if ray_summary["compiled_graph"] else ""))
            else:
                how = f"{_count(used, 'device')} as threads"
            print(f"engine        {engine}: {how}")
        print(f"verified      max abs error {ev.errors[label]:.3g}"
              + (f"; every model within {max(result['model_errors']):.2g} of its own forward ({ran})"
                 if multi else ""))
        width = max(13, len(baseline), len(label), len(ran))
        print(f"{baseline:<{width}} {eager:.2f} ms  (best of 1 and {cores} threads: {ev.threads[baseline]})")
        ms = ev.measured_ms[label]
        print(f"{label:<{width}} {ms:.2f} ms  ({eager / ms:.2f}x {baseline}; predicted {plan.predicted_latency:.2f} ms)")
        if ran != label:
            ms = ev.measured_ms[ran]
            print(f"{ran:<{width}} {ms:.2f} ms  ({eager / ms:.2f}x {baseline}): the configuration the plan chose")
        if args.trace:
            print(f"trace         {args.trace} (measured)")
    return result


def _run_engine(args: argparse.Namespace, plan, devices: dict[str, int] | None) -> str:
    """The engine ``opsched run`` uses: ``--engine``, else ray when ``--address`` is given, else local (every
    device in this process). Ray is refused for what it cannot run, and when it is not installed."""
    from opsched.mapping.execute import cuda_devices

    engine = args.engine or ("ray" if args.address else "local")
    on_cuda = ", ".join(name for name, _ in cuda_devices(plan)) if devices is not None else ""
    if engine != "ray":
        if args.address:
            raise OpschedError("--address names a Ray cluster: it goes with --engine ray")
        if args.trace and on_cuda:
            raise OpschedError(f"--trace records per-unit times, which a plan on CUDA devices ({on_cuda}) does not")
        return engine
    if devices is None:
        raise OpschedError(f"--engine ray runs a mapped plan (made by opsched map); {args.plan} maps no devices")
    if on_cuda:
        raise OpschedError(f"--engine ray runs CPU devices; {args.plan} maps units onto CUDA device(s) {on_cuda}: "
                           "run it with --engine local")
    if args.trace:
        raise OpschedError("--trace records the local engine's threads; it cannot be used with --engine ray")
    if plan.options.get("kernels", "eager") != "eager":
        raise OpschedError(f"--engine ray runs eager kernels; {args.plan} asks for {plan.options['kernels']}")
    from opsched.runtime.ray import import_ray

    import_ray(local=args.address is None)  # a missing Ray is said before the model is loaded
    return engine


def _ray_candidates(ray_run: contextlib.ExitStack, graph, plan, label: str, inputs, cores: int,
                    cluster: str) -> tuple[list, dict[str, Any]]:
    """The plan on the joined Ray, as the one candidate ``evaluate`` verifies and times (its actors end when
    ``ray_run`` closes), and what the JSON says of it. No ``expected_ms``: the plan's prediction has no Ray in
    it."""
    from opsched.pipeline import Candidate, module_runner
    from opsched.runtime.ray import RayModule

    module = ray_run.enter_context(RayModule(graph, plan))
    about = {"cluster": cluster, "compiled_graph": module.compiled, "calls": len(module.segments),
             "actors": {d.name: d.node for d in module.devices}}
    return [Candidate(label, module_runner(module, inputs, cores))], about


def show_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched import schedule as schedule_module

    plan = schedule_module.from_dict(_read_plan(args.plan), args.plan)
    for path in (args.gantt, args.trace):
        if path and Path(path).exists() and not args.force:
            raise OpschedError(f"{path} exists; pass --force to overwrite it")
    label = _timeline_title(plan, plan.graph_name)
    mapping = plan.options.get("mapping")
    if args.gantt and mapping:
        from opsched.report.mapping import write_mapping_gantt

        write_mapping_gantt(args.gantt, plan)
    elif args.gantt:
        from opsched.report.gantt import merged_units, write_gantt

        write_gantt(args.gantt, plan.ops, None, label, merges=merged_units(plan))
    if args.trace:
        from opsched.report.trace import write_trace

        write_trace(args.trace, plan.ops, label)
    streams = plan.streams()
    result = {"plan": args.plan, "method": plan.method, "form": plan.form, "graph": plan.graph_name,
              "device": plan.device, "cost": plan.cost, "batch": plan.batch, "units": len(plan.ops),
              "streams": len(streams), "stages": len(plan.stages) if plan.stages is not None else None,
              "predicted_latency": plan.predicted_latency, "timeline": label,
              "gantt": args.gantt, "trace": args.trace}
    if mapping:
        result.update(devices=plan.options.get("stream_devices"), lower_bound=plan.options.get("lower_bound"),
                      optimal=plan.options.get("optimal"), transfers=len(plan.options.get("transfers") or []))
    if not args.json:
        batch = f"batch {plan.batch}, " if plan.batch else ""
        print(f"plan        {args.plan}: {plan.method} for {plan.graph_name} ({batch}{plan.device})")
        print(f"form        {plan.form}: {_count(len(plan.ops), 'unit')} on {_count(len(streams), 'stream')}"
              + (f" in {_count(len(plan.stages), 'stage')}" if plan.stages is not None else ""))
        unit = "" if plan.cost == "table" else plan.options.get("time_unit", "ms")
        print(f"predicted   {plan.predicted_latency:.4g}{' ' + unit if unit else ''}  ({label})")
        names = plan.options.get("stream_devices") if mapping else None
        for k, units in enumerate(streams):
            print(f"{'device ' + names[k] if names else f'stream {k}':<11} {_count(len(units), 'unit')}")
        if mapping:
            print(f"bound       {result['lower_bound']:.4g} (lower bound; "
                  f"{'proven optimal' if result['optimal'] else 'not proven optimal'}), "
                  f"{_count(result['transfers'], 'transfer')}")
        for what, path in (("gantt", args.gantt), ("trace", args.trace)):
            if path:
                print(f"{what:<11} {path}")
    return result


def cache_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched.cost.cache import LatencyCache, default_path

    path = default_path()
    if args.action == "clear":
        removed = LatencyCache(path).clear() if path.exists() else 0
        result = {"path": str(path), "removed": removed}
        if not args.json:
            print(f"removed {removed} measurements from {path}")
        return result
    summary = LatencyCache(path).summary() if path.exists() else {"path": str(path), "bytes": 0, "entries": 0,
                                                                  "devices": []}
    if not args.json:
        print(f"cache    {summary['path']}  ({summary['bytes'] / 1024:.0f} KiB, {summary['entries']} measurements)")
        for d in summary["devices"]:
            print(f"  {d['entries']:>6}  kernels {d['kernels']:<8}  {d['device']}")
    return summary


def bench_command(args: argparse.Namespace) -> dict[str, Any]:
    from opsched import bench
    from opsched.report.plots import write_plots

    cases = bench.preset_cases(args.preset, models=args.models, costs=args.cost, batches=args.batch,
                               methods=args.methods)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise OpschedError(f"{out} exists and is not a directory")
    started = time.perf_counter()
    rows = bench.run(cases, out, repeats=args.repeats, torch_compile=args.torch_compile,
                     progress=say)
    (out / "results.md").write_text(bench.markdown(rows) + "\n")
    plots = write_plots(rows, out)
    result = {"preset": args.preset, "out": str(out), "rows": len(rows), "seconds": time.perf_counter() - started,
              "files": [str(out / "results.csv"), str(out / "results.md")] + [str(p) for p in plots]}
    if not args.json:
        print(bench.markdown([r for r in rows if r["preset"] == args.preset]))
        print(f"{len(rows)} rows in {out / 'results.csv'}; table {out / 'results.md'}; "
              f"{len(plots)} plots ({time.perf_counter() - started:.0f} s)")
    return result


# -- helpers --

def load_and_capture(args: argparse.Namespace, spec: str, device: str | None = None,
                     say: Callable[[str], Any] = lambda text: None):
    """Load the model ``spec`` names (with ``--batch``, ``--input-shape``, ``--image-size``) and capture it:
    (loaded model, graph, seconds loading, seconds capturing). With ``device``, the model is first put in
    inference mode and moved there with its inputs, as the commands that run it need. ``say`` is told of the
    capture once the model has loaded: a model specifier that does not load is bad input, reported alone."""
    from opsched.graph.capture import capture
    from opsched.models.spec import load_model, parse_shape

    started = time.perf_counter()
    shapes = [parse_shape(s) for s in args.input_shape or []]
    loaded = load_model(spec, batch=args.batch, input_shapes=shapes or None, image_size=args.image_size)
    if device is not None:
        loaded.model.eval()
        if device != "cpu":
            loaded.to(device)
    loaded_at = time.perf_counter()
    say(f"capturing {loaded.name} ...")
    graph = capture(loaded.model, tuple(loaded.inputs), name=loaded.name)
    return loaded, graph, loaded_at - started, time.perf_counter() - loaded_at


def _flat(inputs):
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tuple(inputs))


def _read_plan(path: str) -> Any:
    from opsched.jsonfile import read_json
    from opsched.schedule import ScheduleError

    return read_json(path, ScheduleError)


def _output_paths(args, model_spec: str) -> tuple[Path, Path]:
    """The plan and Gantt paths. Nothing is overwritten without --force: a file the user names that exists
    is refused; the default names (opsched-MODEL-bB-METHOD.json and .png) take the first free number
    (``-2``, ``-3``, ...) when an earlier run left its files there."""
    if args.out:
        plan = Path(args.out)
        if plan.exists() and not args.force:
            raise OpschedError(f"{plan} exists; pass --force to overwrite it")
    else:
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in model_spec.split("/")[-1])
        stem = f"opsched-{stem}-b{args.batch or 1}-{args.method}"
        plan, number = Path(f"{stem}.json"), 1
        while not args.force and (plan.exists() or (not args.gantt and plan.with_suffix(".png").exists())):
            number += 1
            plan = Path(f"{stem}-{number}.json")
    gantt = Path(args.gantt) if args.gantt else plan.with_suffix(".png")
    if args.gantt and gantt.exists() and not args.force:
        raise OpschedError(f"{gantt} exists; pass --force to overwrite it")
    return plan, gantt


def _timeline_title(plan, name: str) -> str:
    if plan.cost.startswith("sim:"):
        what = f"SIMULATED on {plan.cost[4:]} (predicted, not measured)"
    else:
        what = f"predicted by the {plan.cost} cost model"
    # a DAG JSON file's latencies have no unit; a mapping says which it has
    unit = "" if plan.cost == "table" else plan.options.get("time_unit", "ms")
    unit = f" {unit}" if unit else ""
    batch = f", batch {plan.batch}" if plan.batch else ""
    return f"{name}, {plan.method}{batch}: {what}, {plan.predicted_latency:.3g}{unit}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _progress_bar(description: str, total: int):
    """The profiler's ``progress``: its runs, as a bar on a terminal or a few lines elsewhere (see
    :mod:`opsched.progress`)."""
    from opsched.progress import progress_bar

    return progress_bar(description, total, unit="run")


def _print_optimize(result: dict[str, Any], schedules) -> None:
    simulated = result["simulated"]
    kind = "simulated" if simulated else "predicted"
    print(f"model      {result['model']} (batch {result['batch']}, {result['units']} units)")
    print(f"cost       {result['cost']}" + ("  -- every latency below is SIMULATED, not measured" if simulated
                                              else f"  (kernels: {result['kernels']})"))
    print()
    measured = result.get("measured_ms", {})
    dropped = result.get("dropped", {})
    width = max(14, *(len(m) for m in schedules))
    header = f"  {'':<{width}} {kind + ' ms':>14}"
    if measured:
        header += f" {'measured ms':>12} {'vs eager':>9}"
    print(header)
    peers = [p for p in ("eager", "torch_compile", "onnxruntime") if p in measured or p in dropped]
    rows = [(p, None) for p in peers] + [(m, schedules[m].predicted_latency) for m in schedules]
    sequential = result["predicted_ms"]["sequential"]
    for name, predicted in rows:
        mark = "*" if name == result.get("chosen") else " "
        line = f"{mark} {name:<{width}} {f'{predicted:.3f}' if predicted is not None else '-':>14}"
        if name in measured:
            ms = measured[name]
            threads = result.get("threads", {}).get(name)
            line += f" {ms:>12.2f} {measured['eager'] / ms:>8.2f}x" + (f"  ({_count(threads, 'thread')})" if threads else "")
        elif name in dropped:
            line += f"  dropped: {dropped[name]}"
        elif predicted and not measured:
            line += f"   {sequential / predicted:.2f}x sequential"
        print(line)
    print()
    if measured:
        chosen = result["chosen"]
        peer_names = [p for p in peers if p in measured]
        best_peer = min(peer_names, key=measured.__getitem__)
        print(f"chosen     {chosen} (*): {measured[best_peer] / measured[chosen]:.2f}x the fastest peer "
              f"({best_peer}); the plan written is {result['plan_method']}'s schedule and records the choice")
    print(f"reason     {result['method']}: {result['reason']}")
    requested = schedules[result["method"]]
    stats = requested.stats
    print(f"search     {result['method']}: {stats['search_seconds']:.2f} s"
          + (f", {stats['states']} states, {stats['transitions']} transitions" if stats.get("states") else ""))
    if "max_abs_error" in result:
        print(f"verified   max abs error {result['max_abs_error']:.3g} against eager ({result['plan_method']})")
    if "cost_model" in result:
        c = result["cost_model"]
        print(f"profiling  {c['profile_seconds']:.1f} s ({c['units_measured']} unit timings measured, "
              f"{c['units_cached']} cached; {c['stages_measured']} stages measured, {c['stages_cached']} cached"
              + (f"; {c['regions_measured']} compiled regions measured, {c['regions_cached']} cached"
                 if c.get("regions_measured") or c.get("regions_cached") else "") + ")")
    if "compile_seconds" in result:
        print(f"compiling  {result['compile_seconds']:.1f} s ({result['kernels']})")
    print(f"plan       {result['plan']}")
    print(f"gantt      {result['gantt']}")
