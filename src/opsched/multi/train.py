"""Training several models of one architecture as one (HiveMind's hyperparameter-search workload).

:class:`FusedTraining` holds the models' parameters stacked (one tensor per parameter, model ``k`` at index
``k``) and runs their forward as one program. The sum of the models' losses has, for each slice of a stacked
parameter, exactly the gradient that model's own loss gives it alone, so :meth:`FusedTraining.step` with one
learning rate per model is K independent SGD runs in one.

The program is, when the architecture allows it, the *channel-stacked* rewrite
(:mod:`opsched.multi.channels`): the models' activations live as ``(N, K*C, H, W)`` from the first layer to
the last, convolutions are grouped convolutions over views of the stacked weights, batch norm is one batch
norm over ``K*C`` channels (running statistics updated, so evaluation after training matches). Otherwise it
is ``vmap`` over the architecture's ``functional_call`` traced with ``make_fx`` (``method="vmap"``), and
``fallback`` says which node the rewrite did not know.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from opsched.compare import compare_outputs
from opsched.multi.channels import NotStackable, channel_stacked, trace
from opsched.multi.combine import MultiError
from opsched.multi.optimize import model_batch
from opsched.noise import beats, ratio_interval
from opsched.timing import interleaved_samples

METHODS = ("auto", "channels", "vmap")
MIN_ROUNDS = 3  # timed rounds below which compare_training states no interval (steps >= 7)


class FusedTraining(torch.nn.Module):
    """K models of one architecture as one trainable module: ``forward(*inputs)`` returns a tuple with each
    model's output on the shared ``inputs``; ``step(lrs)`` applies SGD to every model with its own rate.

    ``method``: ``"auto"`` runs the channel-stacked program when the rewrite knows every node of the
    architecture and its check on ``example_inputs`` (each model alone, in training mode) passes, and the vmap
    program otherwise; ``"channels"`` refuses (:class:`MultiError`) rather than fall back; ``"vmap"`` is the
    vmap program. After construction ``method`` says which runs and ``fallback`` why the rewrite was not used
    (the node it did not know), or ``None``. ``channels_last``: the channel-stacked program's memory format.
    ``train()`` / ``eval()`` choose batch norm's and dropout's mode (``eval()`` uses the running statistics
    that training updated; the vmap program does not update them).

    >>> import torch
    >>> models = [torch.nn.Linear(4, 3) for _ in range(2)]
    >>> fused = FusedTraining(models, (torch.randn(5, 4),))
    >>> x = torch.randn(5, 4)
    >>> a, b = fused(x)
    >>> torch.allclose(a, models[0](x)) and torch.allclose(b, models[1](x))
    True
    """

    def __init__(self, models: Sequence[torch.nn.Module], example_inputs: Any, method: str = "auto",
                 channels_last: bool = True):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        batch = model_batch(models, example_inputs)
        if not batch.shared_input:
            raise MultiError("fused training needs models of one architecture reading one input (a sweep)")
        self.count = len(batch.models)
        first = batch.models[0]
        aligned = [first, *(_aligned(first, m, batch.inputs, k) for k, m in enumerate(batch.models[1:], 1))]
        # each model's own name of every tensor, for state_of (a renamed copy keeps its names)
        self._own_names = [dict(zip(first.state_dict(), m.state_dict())) for m in batch.models]
        params, buffers = torch.func.stack_module_state(aligned)
        self.names = list(params)
        self.buffer_names = list(buffers)
        self.stacked = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone()) for p in params.values())
        self.buffers_ = [b.clone() for b in buffers.values()]
        self.fallback: str | None = None  # why the channel-stacked rewrite was not used, when it was not
        self._programs: dict[bool, Any] = {}
        self._rates: tuple[tuple[float, ...], torch.Tensor] | None = None  # step's learning rates, on the device
        if method != "vmap":
            try:
                self._programs = self._channel_stacked(batch, channels_last)
            except NotStackable as e:
                if method == "channels":
                    raise MultiError(f"the channel-stacked rewrite cannot run this architecture: {e}") from None
                self.fallback = str(e)
        if not self._programs:
            self._programs = {mode: self._vmap(batch, mode) for mode in (True, False)}
        self.method = "channels" if self.fallback is None and method != "vmap" else "vmap"

    @property
    def program(self) -> torch.fx.GraphModule:
        """The program the forward runs in the current mode (``train()`` / ``eval()``): its ``.code`` shows it."""
        return self._programs[self.training]

    def _channel_stacked(self, batch: Any, channels_last: bool) -> dict[bool, Any]:
        traced = trace(batch.models[0], batch.inputs)
        programs = {mode: channel_stacked(traced, self.count, self.names, self.buffer_names, training=mode,
                                          channels_last=channels_last) for mode in (True, False)}
        # a check of the rewrite on the example inputs: each model alone in training mode (batch norm's
        # batch statistics and running-statistics update; dropout off, its masks are random), exact or refused
        check = channel_stacked(traced, self.count, self.names, self.buffer_names, training=True, dropout=False,
                                channels_last=channels_last)
        single = _training_copy(batch.models[0])
        buffers = [b.clone() for b in self.buffers_]
        with torch.no_grad():
            got = check(list(self.stacked), buffers, *batch.inputs)
            for k in range(self.count):
                mine = {n: b[k].clone() for n, b in zip(self.buffer_names, self.buffers_)}
                want = torch.func.functional_call(single, {**self.parameters_of(k), **mine}, tuple(batch.inputs))
                pairs = [(got[k], want), *((buffers[j][k], mine[n]) for j, n in enumerate(self.buffer_names))]
                for a, b in pairs:
                    if not isinstance(want, torch.Tensor) or a.shape != b.shape or not _close(a, b):
                        raise NotStackable(f"the channel-stacked program differs from model {k} alone on the example "
                                           "inputs (a rewrite rule is wrong for this architecture)")
        return programs

    def _vmap(self, batch: Any, training: bool) -> Any:
        base = copy.deepcopy(batch.models[0]).to("meta").train(training)

        def one(p: dict, b: dict, *args: Any) -> Any:
            return torch.func.functional_call(base, (p, b), args)

        batched = torch.func.vmap(one, in_dims=(0, 0, *[None] * len(batch.inputs)), randomness="different")

        def forward(plist: list, blist: list, *args: Any) -> Any:
            return batched(dict(zip(self.names, plist)), dict(zip(self.buffer_names, blist)), *args)

        return make_fx(forward)(list(self.stacked), self.buffers_, *batch.inputs)

    def forward(self, *inputs: Any) -> tuple:
        out = self.stacked_forward(*inputs)
        return tuple(out[k] for k in range(self.count))

    def stacked_forward(self, *inputs: Any) -> Any:
        """The models' outputs as one tensor, model ``k``'s at index ``k`` (what the program computes)."""
        return self.program(list(self.stacked), self.buffers_, *inputs)

    def summed_loss(self, stacked: torch.Tensor, target: torch.Tensor, loss: Any = None) -> torch.Tensor:
        """The sum over the models of ``loss(output_k, target)`` averaged over the batch (cross-entropy by
        default; ``loss`` must take ``reduction="sum"``), computed as one loss over the models' outputs side by
        side: one kernel instead of K small ones, and every model's gradient the same as its own loss gives.

        >>> import torch
        >>> fused = FusedTraining([torch.nn.Linear(4, 3) for _ in range(2)], (torch.randn(5, 4),))
        >>> x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
        >>> apart = sum(torch.nn.functional.cross_entropy(o, y) for o in fused(x))
        >>> torch.allclose(fused.summed_loss(fused.stacked_forward(x), y), apart)
        True
        """
        loss = loss or torch.nn.functional.cross_entropy
        batch = target.shape[0]
        return loss(stacked.flatten(0, 1), target.repeat(self.count, *[1] * (target.dim() - 1)),
                    reduction="sum") / batch

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> None:
        """SGD on every model with its own learning rate, then the gradients cleared."""
        # made where the weights are (a CUDA kernel cannot read a host tensor of several elements), once per set of
        # rates: a tensor made from host values on a GPU waits for the device
        key = tuple(_rates(lrs, self.count))
        if self._rates is None or self._rates[0] != key:
            self._rates = (key, torch.tensor(key, dtype=self.stacked[0].dtype, device=self.stacked[0].device))
        rates = self._rates[1]
        for p in self.stacked:
            if p.grad is not None:
                p.sub_(p.grad * rates.view(-1, *[1] * (p.dim() - 1)))
                p.grad = None

    def parameters_of(self, k: int) -> dict[str, torch.Tensor]:
        """Model ``k``'s parameters by the first model's names."""
        return {name: p[k] for name, p in zip(self.names, self.stacked)}

    def buffers_of(self, k: int) -> dict[str, torch.Tensor]:
        """Model ``k``'s buffers (batch norm's running statistics, as training updated them) by the first model's
        names."""
        return {name: b[k] for name, b in zip(self.buffer_names, self.buffers_)}

    def state_of(self, k: int) -> dict[str, torch.Tensor]:
        """Model ``k``'s parameters and buffers by its own names, for its ``load_state_dict`` (copies)."""
        names = self._own_names[k]
        return {names.get(name, name): t.detach().clone()
                for name, t in {**self.parameters_of(k), **self.buffers_of(k)}.items()}


def _aligned(first: torch.nn.Module, model: torch.nn.Module, inputs: Sequence[Any], k: int) -> torch.nn.Module:
    """``model`` as the first model's architecture: itself when it is of the first model's class and their tensors
    have the same names and shapes; otherwise (a copy whose layers were renamed or wrapped, another library's
    build of the architecture) a copy of ``first`` holding ``model``'s tensors by position, kept only when the two
    hold tensors of the same shapes in the same order and compute the same in training mode on the example inputs
    (outputs, and batch norm's statistics after the step)."""
    mine, theirs = first.state_dict(), model.state_dict()
    if type(model) is type(first) and ([(n, t.shape, t.dtype) for n, t in mine.items()]
                                       == [(n, t.shape, t.dtype) for n, t in theirs.items()]):
        return model
    if [(t.shape, t.dtype) for t in mine.values()] != [(t.shape, t.dtype) for t in theirs.values()]:
        raise MultiError(f"fused training needs models of one architecture: model {k}'s weights differ from the "
                         "first model's in number, shape or order")
    clone = copy.deepcopy(first)
    clone.load_state_dict(dict(zip(mine, theirs.values())))
    tried, want = _training_copy(clone), _training_copy(model)
    with torch.no_grad():
        got, expected = tried(*inputs), want(*inputs)
    pairs = [(got, expected), *zip(tried.state_dict().values(), want.state_dict().values())]
    if not all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and _close(a, b)
               for a, b in pairs):
        raise MultiError(f"fused training needs models of one architecture: model {k} holds the first model's "
                         "weights by position but computes something else")
    return clone


def _training_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in training mode with dropout off (its masks are random)."""
    trained = copy.deepcopy(model).train()
    for m in trained.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.eval()
    return trained


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to rounding, at ``b``'s own scale (:func:`opsched.compare.compare_outputs`; a wrong rewrite rule
    is off by far more). ``meta`` tensors have shapes, no values: there the check is the shapes' alone (compared
    by the caller)."""
    from opsched.compare import compare_outputs

    if a.is_meta or b.is_meta:
        return True
    return compare_outputs(a, b).ok


def _rates(lrs: Sequence[float], count: int) -> list[float]:
    if len(lrs) == 1:
        return list(lrs) * count
    if len(lrs) != count:
        raise MultiError(f"{len(lrs)} learning rates for {count} models: give one, or one per model")
    return list(lrs)


def compare_training(models: Sequence[torch.nn.Module], inputs: Sequence[Any], steps: int = 20,
                     lrs: Sequence[float] = (0.01,), cores: int | None = None, repeats: int = 15,
                     method: str = "auto", also: Sequence[str | tuple[str, dict]] = (),
                     device: str = "cpu") -> dict[str, Any]:
    """Train copies of ``models`` (SGD, each with its rate; cross-entropy against fixed seeded random labels)
    one after another and fused, timed as the runner times plans (:func:`opsched.timing.interleaved_samples`:
    interleaved rounds, each timed step after an untimed one, so that about ``steps`` steps are taken, the same
    number by each: ``steps`` reports how many): milliseconds per step (medians), the speedup with its 99%
    bootstrap interval and whether it is ``above_noise`` (both None under 7 steps, too few rounds to say); and each model trained fused checked against the same model trained alone as every job
    checks outputs (:func:`opsched.compare.compare_outputs`, its parameters as one output at their own scale):
    ``verified``, ``param_error`` (the worst scaled error), ``why`` (the first model that differs), and the
    largest difference between their parameters (``max_param_diff``). ``method`` is :class:`FusedTraining`'s;
    each of ``also`` (a method, say ``"vmap"``, or a pair ``(label, FusedTraining options)``) trains one more
    fused copy that way, timed in the same rounds as ``fused_<label>``, with its verdict in ``also``.
    ``float32_noise`` says what a ``max_param_diff`` is to be read against: how far the models trained one after
    another in float32 end from the same training in float64. ``repeats`` is accepted for the command's sake.
    ``device="cuda"``: the models and inputs are on the CUDA device of the CUDA backend's interface
    (:func:`opsched.runtime.cuda.api.current_api`), every step runs on its current stream and is timed from
    a synchronised device to a synchronised device."""
    if device == "cuda":
        from opsched.runtime.cuda.api import current_api

        api = current_api()
        with api.use_stream(api.current_stream()):
            return _compare(models, inputs, steps, lrs, cores, method, also, api)
    return _compare(models, inputs, steps, lrs, cores, method, also, None)


def _compare(models: Sequence[torch.nn.Module], inputs: Sequence[Any], steps: int, lrs: Sequence[float],
             cores: int | None, method: str, also: Sequence[str | tuple[str, dict]], api: Any) -> dict[str, Any]:
    torch.set_num_threads(cores or torch.get_num_threads())
    rates = _rates(lrs, len(models))
    apart = [copy.deepcopy(m).train() for m in models]
    fused = {"fused": FusedTraining([copy.deepcopy(m).train() for m in models], inputs, method=method)}
    for other in also:
        label, options = (other, {"method": other}) if isinstance(other, str) else other
        fused[f"fused_{label}"] = FusedTraining([copy.deepcopy(m).train() for m in models], inputs, **options)
    batch = model_batch(apart, inputs)
    args = batch.inputs
    if api is not None and not all(a.device.type == api.device.type for a in args if isinstance(a, torch.Tensor)):
        raise MultiError(f"training on the CUDA backend needs the models and inputs on {api.device.type}")
    with torch.no_grad():
        classes = copy.deepcopy(apart[0])(*args).shape[-1]
    labels = torch.randint(classes, (args[0].shape[0],), generator=torch.Generator().manual_seed(0))
    if api is not None:
        labels = api.to(labels, args[0].device.index or 0)
    optimizers = [torch.optim.SGD(m.parameters(), lr=r) for m, r in zip(apart, rates)]
    loss = torch.nn.functional.cross_entropy

    def step_apart() -> None:
        for m, opt in zip(apart, optimizers):
            opt.zero_grad()
            loss(m(*args), labels).backward()
            opt.step()

    def stepper(trainer: FusedTraining) -> Any:
        def step_fused() -> None:
            trainer.summed_loss(trainer.stacked_forward(*args), labels).backward()
            trainer.step(rates)
        return step_fused

    names = ["sequential_models", *fused]
    taken = dict.fromkeys(names, 0)
    synchronize = api.synchronize if api is not None else (lambda: None)

    def timed(name: str, step: Any) -> Any:
        def run() -> None:
            step()
            synchronize()  # the device's work is part of the step's time
            taken[name] += 1
        return run

    # the one runner's timing: interleaved rounds, each sample after an untimed lead-in step (so every training
    # takes 1 + 2 * rounds steps, the same number), from a synchronised device on
    rounds = max(1, (steps - 1) // 2)
    samples = dict(zip(names, interleaved_samples(
        [timed(name, step) for name, step in zip(names, [step_apart, *map(stepper, fused.values())])], rounds,
        around=[(synchronize, None)] * len(names))))
    if len(set(taken.values())) != 1:
        raise MultiError(f"the trainings took different numbers of steps ({taken})")
    taken_steps = taken["sequential_models"]

    drawing = _draws_in_training(models)

    def agreement(trainer: FusedTraining) -> dict[str, Any]:
        """Each model trained fused against the same model trained alone, as every job verifies outputs: all
        its parameters as one output, at their own scale (opsched.compare). With dropout active the two draw
        other masks and agree in distribution only: no verdict (None)."""
        verdicts = []
        for k, m in enumerate(apart):
            state = trainer.state_of(k)
            names = [name for name, _ in m.named_parameters()]
            verdicts.append(compare_outputs(torch.cat([state[n].detach().flatten() for n in names]),
                                            torch.cat([p.detach().flatten() for _, p in m.named_parameters()])))
        worst = max(range(len(verdicts)), key=lambda k: (not verdicts[k].ok, verdicts[k].error))
        if drawing:
            return {"verified": None, "param_error": verdicts[worst].error,
                    "max_param_diff": max(v.abs_error for v in verdicts),
                    "why": f"{drawing} draws other numbers fused than alone: the two agree in distribution, not "
                           "number for number"}
        return {"verified": all(v.ok for v in verdicts), "param_error": verdicts[worst].error,
                "max_param_diff": max(v.abs_error for v in verdicts),
                "why": f"model {worst}: {verdicts[worst].why}" if not verdicts[worst].ok else ""}

    ms = {name: statistics.median(s) for name, s in samples.items()}
    ratio, low, high = ratio_interval(samples["sequential_models"], samples["fused"])
    # a bootstrap over fewer than MIN_ROUNDS rounds says nothing: no interval, no verdict on the noise
    judged = rounds >= MIN_ROUNDS
    main = fused["fused"]
    return {"steps": taken_steps, "rounds": rounds, "models": len(models), **agreement(main),
            "float32_noise": _float32_noise(models, args, labels, rates, taken_steps, apart), "ms_per_step": ms,
            "speedup": ratio, "speedup_interval_99": [low, high] if judged else None,
            "above_noise": beats(samples["fused"], samples["sequential_models"]) if judged else None,
            "method": main.method, "fallback": main.fallback,
            "also": {name: {"method": t.method, **agreement(t), "fused_speedup": ms[name] / ms["fused"]}
                     for name, t in fused.items() if name != "fused"}}


def _draws_in_training(models: Sequence[torch.nn.Module]) -> str | None:
    """The first dropout module of ``models`` that draws in training mode (its path), or None."""
    for k, model in enumerate(models):
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
                return f"model {k}'s {path or type(module).__name__}"
    return None


def _float32_noise(models: Sequence[torch.nn.Module], args: Sequence[Any], labels: torch.Tensor,
                   rates: Sequence[float], steps: int, trained: Sequence[torch.nn.Module]) -> float:
    """The largest difference between the parameters of ``trained`` (``models`` after ``steps`` SGD steps in
    float32, one after another) and the same training in float64: float32's own noise on this training, which
    depends on the CPU's kernels (the same fused step was 1e-5 from one model's own on one x86 machine and
    1.09e-5 on another)."""
    exact = [copy.deepcopy(m).double().train() for m in models]
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    for model, rate in zip(exact, rates):
        optimizer = torch.optim.SGD(model.parameters(), lr=rate)
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(*args64), labels).backward()
            optimizer.step()
    return max((p.double() - p64).abs().max().item() for m, m64 in zip(trained, exact)
               for p, p64 in zip(m.parameters(), m64.parameters(), strict=True))
