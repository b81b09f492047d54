"""A model batch through the one runner: rewrite (:mod:`opsched.multi.fuse`), schedule every method on the
rewritten graph, compile, verify each model against its own eager forward, and time the plans interleaved
with what a user runs today (``sequential_models``, ``threads``, ``vmap``); the simplest verified one that no
other beats above the run's noise is chosen, so the plan never promises less than the best
alternative, nor a gain it cannot show."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from opsched.cost.devices import is_simulated
from opsched.multi.combine import ModelBatch, MultiError
from opsched.multi.fuse import REWRITES, CostLatencies, Fusion, fuse_graph
from opsched.schedulers.hivemind import independent_parts

MULTI_PEERS = ("sequential_models", "threads", "vmap")
# The peers that compile or export every model first, slower to make (``opsched multi --peers``): torch.compile of
# the loop, and ONNX Runtime sessions both one after another and at the same time, whichever a user would find faster.
COMPILED_PEERS = ("torch_compile", "onnxruntime_models", "onnxruntime_concurrent")
DEFAULT_METHODS = ("sequential", "ios", "lios", "hivemind")
UNBATCHED = "+unbatched"  # the suffix of the schedules of a batch's graph without batched units (see _unbatched)


def model_batch(models: Sequence[torch.nn.Module], inputs: Any,
                preprocess: torch.nn.Module | None = None, separate_inputs: bool = False) -> ModelBatch:
    """The batch of ``models`` on ``inputs``: one tuple of arguments per model (a list as long as the models,
    of tuples or lists), or arguments all the models take (given to ``preprocess`` first, if any);
    ``separate_inputs``: each model reads its own, even where they have one layout (see :class:`ModelBatch`)."""
    models = list(models)
    per_model = (isinstance(inputs, (list, tuple)) and len(inputs) == len(models)
                 and all(isinstance(i, (list, tuple)) for i in inputs))
    if separate_inputs and not per_model:
        raise MultiError("separate inputs: give one tuple of arguments per model")
    return ModelBatch(models, list(inputs) if per_model else [inputs] * len(models), preprocess, separate_inputs)


@dataclass
class MultiOutcome:
    """What :func:`optimize` made: the fusion, the runner's outcome (schedules, modules, evaluation), each
    model's largest output difference from its own eager forward under the plan, and the predicted
    milliseconds of the models run one after another."""

    fusion: Fusion
    outcome: Any
    model_errors: list[float] = field(default_factory=list)
    predicted_sequential_ms: float | None = None
    beside: Any = None  # the outcome of the batch's other graph, measured in the same run (see _unbatched)

    @property
    def schedules(self) -> dict[str, Any]:
        """Every schedule made: the plan's graph's, and the other graph's measured beside them."""
        return {**self.outcome.schedules, **(self.beside.schedules if self.beside is not None else {})}

    def plan(self):
        """The runner's plan (see :meth:`opsched.pipeline.Outcome.plan`) with its ``models`` section: the
        number of models, what the rewrites made, and what rebuilds the fused graph (the rewrites asked for
        and the batched units made, see :func:`opsched.multi.fuse.fuse_graph`)."""
        plan = self.outcome.plan()
        if plan is not None:
            plan.models = self.models_section()
        return plan

    def models_section(self) -> Any:
        """The plan's ``models`` section for this fusion (see :meth:`plan`)."""
        from opsched.schedule import ModelsSection

        return ModelsSection(len(self.fusion.batch.models), dict(self.fusion.fused), list(self.fusion.rewrites),
                             self.fusion.batched)

    @property
    def measured_ms(self) -> dict[str, float]:
        return self.outcome.measured_ms

    @property
    def chosen(self) -> str | None:
        return self.outcome.chosen

    @property
    def module(self) -> Any:
        """The chosen configuration (see :attr:`opsched.pipeline.Outcome.module`): called like the batch, it
        returns each model's outputs."""
        return self.outcome.module


def optimize(models: Sequence[torch.nn.Module], inputs: Any, *, methods: Sequence[str] = DEFAULT_METHODS,
             cost: str = "measured", kernels: str = "eager", rewrites: Sequence[str] = REWRITES,
             cores: int | None = None, tolerance: float | None = None, repeats: int = 15, cache: bool = True,
             peers: Sequence[str] = MULTI_PEERS, preprocess: torch.nn.Module | None = None,
             say: Callable[[str], Any] = lambda text: None, progress: Any = None,
             requested: str | None = None, cuda_graph: bool = False, device: str | None = None,
             separate_inputs: bool = False) -> MultiOutcome:
    """Fuse, schedule, verify and time a model batch against the ways users run one today (``peers``; add
    :data:`COMPILED_PEERS` for torch.compile of the loop over the models and ONNX Runtime's sessions, one after
    another and at the same time). ``preprocess`` runs once on ``inputs`` and every model reads its result (see
    :class:`ModelBatch`). The batch runs where its models and inputs are: on the CPU, or with them moved to
    ``cuda``, on the GPU's streams (costs measured there; ``device`` says so where the tensors alone do not, as on
    a stand-in of the CUDA interface); with ``cuda_graph`` each plan is replayed as one CUDA
    graph, and the models one after another captured as one CUDA graph (the ``cuda_graph`` peer) are timed
    beside it. ``separate_inputs``: each model reads its own inputs, even where they have one layout.
    With simulated costs the plan is ``requested``'s schedule (default: the last of ``methods``).

    >>> import torch
    >>> models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)]
    >>> result = optimize(models, (torch.randn(2, 8),), methods=["sequential"], repeats=3, cache=False)
    >>> sorted(result.outcome.evaluation.measured_ms), max(result.model_errors) < 1e-5
    (['sequential', 'sequential_models', 'threads', 'vmap'], True)
    """
    from opsched.pipeline import Workload, default_streams, method_options, run_workload

    batch = model_batch(models, inputs, preprocess, separate_inputs)
    for m in batch.models:
        m.eval()
    cores = cores or torch.get_num_threads()
    simulated = is_simulated(cost)
    say("combining the models and choosing the fusions that pay ...")
    device = "cpu" if simulated else device or batch.device
    # the fusions are chosen on the costs of the program that will run: on a GPU with cuda_graph, without launches
    latencies = CostLatencies(cost, batch.inputs, kernels, cores, cache, progress, device=device, replayed=cuda_graph)
    fusion = fuse_graph(batch, rewrites, latencies, whole=latencies.regions_ms)
    sequential_ms = sum(latencies(fusion.combined))
    jobs = {m: (m, method_options(m, default_streams=default_streams(simulated, device, cores))) for m in methods}
    if "hivemind" in methods and not simulated and len(independent_parts(fusion.graph)) > 1:
        # beside the streams the cost model predicts fastest, each model (independent part) on its own, as a
        # thread pool runs them: four small networks at 128 px ran 0.85x the pool of ONNX Runtime sessions on the
        # three streams predicted fastest
        jobs["hivemind_parts"] = _each_part(jobs["hivemind"])
    if cuda_graph:  # a user who replays CUDA graphs replays the models one after another as one
        peers = (*peers, "cuda_graph")

    def workload(graph: Any, methods: dict[str, tuple[str, dict[str, Any]]]) -> Workload:
        return Workload(batch, tuple(batch.inputs), graph, methods, cost=cost, device=device, kernels=kernels,
                        cores=cores, peers=peers, tolerance=tolerance, repeats=repeats, cache=cache,
                        cuda_graph=cuda_graph, say=say, profile_progress=progress,
                        costed=latencies.models.get(graph.fingerprint))

    unbatched = _unbatched(batch, fusion, jobs)
    outcome = run_workload(workload(fusion.graph, jobs), also={UNBATCHED: workload(unbatched.graph, {
        "hivemind": jobs["hivemind"], "hivemind_parts": _each_part(jobs["hivemind"])})} if unbatched is not None else None)
    beside = outcome.also.get(UNBATCHED)
    if beside is not None and _plan_graph(outcome.evaluation) in beside.schedules:
        say("the models' own graphs, on streams of their own, ran faster than their batched units")
        fusion, outcome, beside = unbatched, beside, outcome
    outcome.graph, outcome.requested = fusion.graph, requested or list(methods)[-1]
    result = MultiOutcome(fusion, outcome, predicted_sequential_ms=sequential_ms, beside=beside)
    plan = outcome.plan()
    if plan is not None and outcome.evaluation is not None:  # simulated costs: nothing was run
        module = outcome.modules[plan.measured.measured_as]
        result.model_errors = model_errors(module, batch, cores)
    return result


def _each_part(hivemind_job: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The hivemind job with every independent part (each model) on a stream of its own."""
    return "hivemind", {**hivemind_job[1], "each_part": True}


def _unbatched(batch: ModelBatch, fusion: Fusion, jobs: dict[str, Any]) -> Fusion | None:
    """The batch's graph without batched units, to be measured beside ``fusion``'s, where ``fusion`` batched
    units on a comparison of compiled regions run one after another (``Fusion.whole``) and a stream schedule is
    asked for: the models apart may still run faster, each on its own stream, where a stream's regions run at
    the same time as the others'. Measured here: ResNet-18 x4 at batch 1 and 64 px, its convolutions batched
    across models, ran 0.86x ONNX Runtime's sessions run at the same time. None where nothing was batched so."""
    if fusion.whole is None or not fusion.batched or "hivemind" not in jobs:
        return None
    unbatched = fuse_graph(batch, fusion.rewrites, made=())
    if len(independent_parts(unbatched.graph)) < 2:  # one part: no model has a stream of its own
        return None
    unbatched.decisions = [dict(d, made=False) for d in fusion.decisions]
    unbatched.whole = fusion.whole
    return unbatched


def _plan_graph(ev: Any) -> str | None:
    """The schedule the plan will be: the configuration chosen where it is a schedule, else the fastest
    schedule."""
    if ev.chosen is not None and ev.kinds[ev.chosen] == "schedule":
        return ev.chosen
    return ev.fastest("schedule")


def model_comparisons(module: Callable[..., Any], batch: ModelBatch, cores: int,
                      tolerance: float | None = None) -> list[Any]:
    """Each model's outputs from ``module`` compared with the model's own forward
    (:func:`opsched.compare.compare_outputs`, each output at its own scale)."""
    from opsched.compare import compare_outputs

    torch.set_num_threads(cores)
    with torch.inference_mode():
        got = module(*batch.inputs)
        want = [m(*args) for m, args in zip(batch.models, batch.per_model)]
    return [compare_outputs(g, w, tolerance) for g, w in zip(got, want)]


def model_errors(module: Callable[..., Any], batch: ModelBatch, cores: int) -> list[float]:
    """Each model's largest output error between ``module`` and the model's own forward, scaled to each
    output's magnitude (see :mod:`opsched.compare`)."""
    return [c.error for c in model_comparisons(module, batch, cores)]


def fuse(models: Sequence[torch.nn.Module], inputs: Any, *, method: str = "sequential", cost: str = "measured",
         rewrites: Sequence[str] = REWRITES, cores: int | None = None, tolerance: float | None = None,
         cache: bool = True, preprocess: torch.nn.Module | None = None, repeats: int = 15) -> torch.nn.Module:
    """One module running every model of the batch, fused where it pays and scheduled with ``method``:
    called like the batch (the shared inputs, or every model's inputs in order, with the signature of
    ``inputs``), it returns a tuple with each model's outputs; ``preprocess`` runs once on the shared inputs and
    every model reads its result. With measured costs it goes through the one runner (:func:`optimize`, the
    models one after another as the baseline): verified against every model's own forward and timed beside
    them, its ``measured_ms`` holding the figures (the module refuses a call after a model's weights changed:
    :class:`~opsched.errors.StaleWeights`; :func:`opsched.optimize_batch`'s module rebuilds instead). Raises :class:`MultiError` when some model's outputs differ from
    its own forward by more than ``tolerance`` (scaled to each output's magnitude; default: the output dtype's,
    see :mod:`opsched.compare`).

    >>> import torch
    >>> models = [torch.nn.Conv2d(3, 4, 3) for _ in range(4)]
    >>> x = torch.randn(1, 3, 8, 8)
    >>> fused = fuse(models, (x,), cache=False)
    >>> outputs = fused(x)
    >>> len(outputs), all(torch.allclose(o, m(x), atol=1e-5) for o, m in zip(outputs, models))
    (4, True)
    """
    from opsched.pipeline import cost_model, default_streams, method_options, search
    from opsched.runtime.module import OptimizedModule

    if not is_simulated(cost):
        result = optimize(models, inputs, methods=[method], cost=cost, rewrites=rewrites, cores=cores,
                          tolerance=tolerance, repeats=repeats, cache=cache, peers=("sequential_models",),
                          preprocess=preprocess)
        ev = result.outcome.evaluation
        if method not in ev.measured_ms:
            raise MultiError(f"the fused plan does not reproduce the models: {ev.dropped.get(method)}")
        module = result.outcome.modules[method]
        module.fusion, module.measured_ms = result.fusion, dict(ev.measured_ms)
        return module
    # simulated costs: nothing can be timed here, the plan is verified on the example inputs
    batch = model_batch(models, inputs, preprocess)
    for m in batch.models:
        m.eval()
    cores = cores or torch.get_num_threads()
    device = batch.device
    fusion = fuse_graph(batch, rewrites, CostLatencies(cost, batch.inputs, cores=cores, cache=cache, device=device))
    model, kernels = cost_model(fusion.graph, pytree.tree_leaves(tuple(batch.inputs)), cost, device=device,
                                cores=cores, cache=cache)
    # the streams of where the module runs, whatever the costs it was scheduled with
    schedule = search(fusion.graph, model, method, **method_options(
        method, default_streams=default_streams(False, device, cores)))
    module = OptimizedModule(fusion.graph, schedule, cores, kernels, device=device)
    for k, verdict in enumerate(model_comparisons(module, batch, cores, tolerance)):
        if not verdict.ok:
            raise MultiError(f"model {k}'s outputs differ from its own forward: {verdict.why}")
    module.fusion = fusion
    return module
