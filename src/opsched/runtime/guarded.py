"""What ``opsched.optimize`` and ``opsched.load`` hand back: the model's calls served by a plan per call
signature, behind guards, and answered by the model itself wherever no plan serves.

On each call, :class:`GuardedModule`

1. looks at the model's weights (:class:`~opsched.runtime.guards.WeightWatch`): when one changed, every plan
   built from the old weights is dropped and rebuilt from the model as it is now (its schedule kept: the model is
   captured again, the same schedule compiled and verified; a plan that chose a peer is made again whole);
2. computes the call's signature (:func:`~opsched.runtime.guards.call_signature`) and runs the plan made for it;
3. for a signature no plan serves: answers with the model itself, exactly, and builds a plan for it in the
   background through the same runner as the first (captured, scheduled, verified, timed against eager, one build
   at a time, a line said when it starts and ends), used from the next matching call on. ``wait=True`` builds it
   before answering; ``strict=True`` raises :class:`~opsched.errors.SignatureMismatch` naming what differs.

A call under autocast is a signature of its own: its plan is made, measured and verified under that same
autocast, and runs in it on every stream's thread (autocast is thread-local; the executors enter the caller's).
Calls on a model in training mode are answered by the model itself (plans are made for eval mode), as are calls
that need gradients through an input (a plan runs in inference mode and gives none). Plans are kept for at most ``max_plans`` signatures, the least recently used dropped first.

Builds run on a private copy of the model (:func:`~opsched.models.sharing.build_copy`: modules and buffers of
its own, its parameters over the model's memory unless ``follow_weights=False``; shared by builds while the
weights stay the same, and made again after a build whose units torch.fx traced, which hold the copy's own
modules), so that capturing it never disturbs calls answered by the model meanwhile; for a model that cannot be
copied no new plan is made (the model answers those calls).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from opsched.errors import OpschedError, SignatureMismatch, first_line
from opsched.exiting import exiting, start_background, stop_point
from opsched.graph.fold import forget_folds
from opsched.graph.tracing import TRACING
from opsched.models.sharing import build_copy
from opsched.runtime.dynamic import served_by
from opsched.runtime.guards import (
    WeightWatch,
    attributes_set_by,
    autocast_of,
    call_signature,
    copied,
    describe,
    difference,
    flat_signature,
)
from opsched.runtime.outputs import as_the_model_gives, grad_pattern


def say_on_stderr(text: str) -> None:
    sys.stderr.write(f"opsched: {text}\n")  # one write: lines from a background build stay whole
    sys.stderr.flush()


@dataclass
class Plan:
    """What serves one call signature: ``module`` (a compiled plan or a peer's callable; None where the model
    itself answers, because eager was chosen or nothing verified, as ``note`` says), the configuration
    ``chosen`` and its ``schedule`` (the best verified one, kept to rebuild after a weight change), the
    ``measured_ms`` of every configuration, and the example ``inputs`` it was made with."""

    signature: tuple
    inputs: tuple
    module: Callable[..., Any] | None
    chosen: str
    schedule: Any = None
    measured_ms: dict[str, float] = field(default_factory=dict)
    note: str = ""
    stale: bool = False  # built from weights that have changed since: rebuilt at its signature's next call
    made: int | None = None  # the order plans were made in (the first is the plan file's head)
    # for each output, whether the model's requires gradients in grad mode (seen at the first such call)
    needs_grad: tuple[bool, ...] | None = None

    def summary(self) -> str:
        line = f"{describe(self.signature)}: {self.chosen}"
        if self.measured_ms:
            line += " (" + ", ".join(f"{n} {ms:.3g} ms" for n, ms in self.measured_ms.items()) + ")"
        return line + (f"; {self.note}" if self.note else "")


class PlanBuilder:
    """How a :class:`GuardedModule` makes plans: :meth:`build` a new one for a model (a private copy) and
    example inputs, :meth:`rebuild` one whose weights changed. See :class:`opsched.jobs.OptimizeBuilder`."""

    def build(self, model: torch.nn.Module, inputs: tuple) -> Plan:
        raise NotImplementedError

    def rebuild(self, model: torch.nn.Module, plan: Plan) -> Plan:
        raise NotImplementedError

    def resize(self, model: torch.nn.Module, plan: Plan, inputs: tuple) -> Plan:
        """The plan for ``inputs``, of other sizes along dimensions declared dynamic, from ``plan``'s schedule
        (see :mod:`opsched.runtime.dynamic`); by default a plan made as any new one."""
        return self.build(model, inputs)


# the optimized module's own public attributes; every other public one set on it is the model's
_OWN_ATTRIBUTES = frozenset({"model", "training", "builder", "strict", "wait", "max_plans", "say", "dynamic", "watch",
                             "plans"})


class GuardedModule(torch.nn.Module):
    """``model``'s calls, each served by the plan made for its signature (see the module's docstring).
    ``plans`` are those already made (from ``opsched.optimize`` or a plan file); ``builder`` makes more.

    ``follow_weights=False`` stops looking at the weights on every call (their identity, version counter and
    storage: about 0.3 µs a tensor, see docs/calls.md), and at the settings of PyTorch's layers (a convolution's
    padding, a norm's eps: about 30 ns each), which are made with the layer as its weights are: for weights that
    never change, or whose owner calls
    :meth:`refresh` after changing them. A change not announced is then answered by each plan with the weights it
    was built from, all of them (plans are then built from copies of their own, never from the model's memory;
    see :mod:`opsched.models.sharing`), except a plan of ``opsched.optimize(graph=...)``, which reads the memory
    the graph given was captured from: after a change it has not been told of, it may answer with a mix of old and
    new weights. Replaced modules, modules out of eval mode, the attributes of other modules than PyTorch's
    layers, the globals and the hooks are still seen.

    ``dynamic`` (:func:`opsched.runtime.dynamic.dynamic_dims`) names dimensions whose sizes vary: a call
    that differs from a plan's only in their sizes, within their ranges, gets its plan from that plan's
    schedule (``builder.resize``: captured, compiled, verified and timed beside the model, no search), and
    ``strict`` serves it (the plan made before answering) instead of refusing it.

    ``say`` receives the progress lines (default: stderr, prefixed ``opsched:``)."""

    def __init__(self, model: torch.nn.Module, builder: PlanBuilder, plans: Sequence[Plan] = (), *,
                 strict: bool = False, wait: bool = False, max_plans: int = 8, follow_weights: bool = True,
                 dynamic: tuple = (), own_attributes: set[str] = frozenset(),
                 say: Callable[[str], Any] = say_on_stderr):
        super().__init__()
        if max_plans < 1:
            raise OpschedError(f"max_plans must be at least 1, got {max_plans}")
        object.__setattr__(self, "model", model)  # not a submodule: its state_dict stays the model's own
        object.__setattr__(self, "training", model.training)
        self.builder, self.strict, self.wait, self.max_plans, self.say = builder, strict, wait, max_plans, say
        self.dynamic = dynamic
        self.watch = WeightWatch(model, tensors=follow_weights)
        self.watch.ignore(set(own_attributes))
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.RLock()
        self._pending: dict[tuple, Future] = {}
        # one build at a time, on a daemon thread: a build under way never holds up the interpreter's exit
        self._builder: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # the model's copy that builds capture, and the generation of weights it was copied in
        self._private: tuple[int, torch.nn.Module] | None = None
        self._generation = 0  # counts the weight changes seen: a build from older weights is not kept
        self._plans_made = 0
        self._said_keywords: set[tuple[str, ...]] = set()
        for plan in plans:
            self._keep(plan)
        # the model's own tables of submodules, parameters and buffers (see "The model's own module methods")
        # and its hooks of loading, which a module holding this one runs here, where the model would be
        for table in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set",
                      "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            object.__setattr__(self, table, getattr(model, table))

    def __setattr__(self, name: str, value: Any) -> None:
        # the wrapper's own attributes, and private ones (PyTorch's of the wrapper: its hooks, a compiled call), are
        # set on it; a module, parameter or buffer goes to the tables, which are the model's (a DataParallel
        # replica's copies of them: set on the model, they replaced the model's own submodules); any other value is
        # the model's, set as on the model: a temperature set on the optimized module stayed on the wrapper and was
        # answered with the model's old one, silently
        if name in _OWN_ATTRIBUTES or name.startswith("_"):
            if name in self.__dict__:
                object.__setattr__(self, name, value)
            else:
                super().__setattr__(name, value)
        elif isinstance(value, (torch.nn.Module, torch.nn.Parameter)) or name in self._modules \
                or name in self._parameters or name in self._buffers:
            super().__setattr__(name, value)
        else:
            setattr(self.model, name, value)

    def __getattr__(self, name: str) -> Any:
        # (only where the wrapper has no attribute of that name) the model's submodules, parameters and buffers,
        # whose tables it shares, then the model's own public attributes and methods (fast.temperature,
        # fast.reset_classifier(10)), as on the model; private names are the wrapper's, read as they are set
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("model")
            if model is None or name.startswith("_"):  # (being made or copied)
                raise
            return getattr(model, name)

    def __delattr__(self, name: str) -> None:
        if name in _OWN_ATTRIBUTES or name.startswith("_") or name in self._modules or name in self._parameters \
                or name in self._buffers:
            super().__delattr__(name)
        else:
            delattr(self.model, name)

    # torch.compile(fast) runs this as it is: the plans are compiled already, and dynamo would break its graph on
    # the locks and the watch, with a warning for each
    @torch._disable_dynamo  # (torch.compiler.disable would import dynamo with this module: 0.8 s)
    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        if keywords:  # one plan serves a call whichever way its arguments are passed
            positional = positional_call(self._forward_signature, inputs, keywords)
            if positional is None:
                return self._keywords_answered_by_model(inputs, keywords)
            inputs = positional
        changed = self.watch.changed()
        if changed:
            if self.watch.in_training():
                return self._refused(inputs, changed)
            self._weights_changed(changed)
        flat, signature = flat_signature(inputs)
        plan = self.plans.get(signature)
        if plan is not None and not plan.stale:
            return self._planned(plan, signature, inputs, flat)
        inputs_of = signature[0]
        if any(len(s) == 5 and s[4] for s in inputs_of):
            return self._refused(inputs, "an input asks for gradients, which a plan does not give (it runs in "
                                         "inference mode)")
        if signature in self._pending:
            return self._model_answers(inputs)
        like, out_of_range = self._sized_like(signature) if plan is None else (None, "")
        if plan is not None:  # stale: rebuilt from the new weights, before answering where asked to wait
            why = "the weights changed since its plan was built"
        elif like is not None:
            why = f"{difference(signature, like.signature)} (a dynamic dimension)"
        elif self.plans:
            why = out_of_range or difference(signature, next(reversed(self.plans)))
        else:
            why = "no plan yet"
        if plan is None and like is None and self.strict:
            raise SignatureMismatch(f"{why}; pass batch_sizes=[...] or dynamic_shapes to opsched.optimize, or "
                                    "strict=False")
        if self.wait or self.strict or exiting():  # no background builds once the interpreter exits
            self._build_now(signature, inputs, like)
            plan = self.plans.get(signature)
            # (the plan just made answers; what changed while it was made is seen at the next call, rather than
            # made again here, which a forward that changes a global itself would repeat without end)
            return self._model_answers(inputs) if plan is None or plan.stale else \
                self._planned(plan, signature, inputs, flat)
        self._build_later(signature, inputs, why, like)
        return self._model_answers(inputs)

    def _planned(self, plan: Plan, signature: tuple, inputs: tuple, flat: list[Any]) -> Any:
        """The answer of ``plan`` (made for ``signature``, not stale) to a call, as the model would give it."""
        if plan.module is None:  # eager chosen, or nothing verified: the model answers
            return self._model_answers(inputs)
        # (one C call, atomic under the GIL; the table is only ever iterated as a copy made by one C call)
        with contextlib.suppress(KeyError):  # dropped meanwhile by a build: it still answers
            self.plans.move_to_end(signature)
        weights = self.watch.tensors
        if plan.needs_grad is None and torch.is_grad_enabled() and any(t.requires_grad for t in weights):
            # which outputs the model's gradients reach: the model answers the plan's first such call
            answer = self._model_answers(inputs)
            plan.needs_grad = grad_pattern(answer)
            return answer
        if hasattr(plan.module, "run"):
            return as_the_model_gives(plan.module.run(flat), weights, plan.needs_grad)
        with TRACING.calling():
            return as_the_model_gives(plan.module(*inputs), weights, plan.needs_grad)

    def _sized_like(self, signature: tuple) -> tuple[Plan | None, str]:
        """The plan (the most recently used first) whose schedule serves ``signature`` through its dynamic
        dimensions, and otherwise why the nearest one does not (a size out of a declared range), or ''."""
        if not self.dynamic:
            return None, ""
        out_of_range = ""
        for plan in reversed(list(self.plans.values())):
            if plan.schedule is None:  # (a stale plan's schedule still holds: only its weights changed)
                continue
            found = served_by(signature, plan.signature, self.dynamic)
            if found == "":
                return plan, ""
            out_of_range = out_of_range or found or ""
        return None, out_of_range

    def _refused(self, inputs: tuple, why: str) -> Any:
        """A call no plan is made for (gradients, training mode): the model answers, or with
        ``strict`` the call is refused."""
        if self.strict:
            raise SignatureMismatch(f"{why}; the model itself answers such calls (strict=False)")
        return self._model_answers(inputs)

    @property
    def _forward_signature(self) -> inspect.Signature | None:
        """The parameters of the model's forward as it is now: read again where the forward was replaced (on the
        instance), whose parameters and defaults may be others (keywords were passed by the first one's)."""
        forward = self.model.forward
        function = getattr(forward, "__func__", forward)
        kept = self.__dict__.get("_signature_of")
        if kept is None or kept[0] is not function:
            try:
                signature = inspect.signature(forward)
            except (TypeError, ValueError):  # (a forward inspect cannot read: keywords go to the model itself)
                signature = None
            kept = (function, signature)
            self._signature_of = kept
        return kept[1]

    def _keywords_answered_by_model(self, inputs: tuple, keywords: dict[str, Any]) -> Any:
        """A call whose keywords cannot all be passed by position (a keyword-only parameter, ``**kwargs``): the
        model answers, or with ``strict`` the call is refused. One the forward does not take at all gets the
        model's own error."""
        names = tuple(sorted(keywords))
        signature = self._forward_signature
        try:  # (a forward inspect cannot read: refused too, where strict)
            takes = signature is None or signature.bind(*inputs, **keywords) is not None
        except TypeError:
            takes = False
        if takes:
            how = ("the forward's parameters cannot be read" if signature is None else
                   "the forward takes some of them by keyword only (or through **kwargs)")
            why = f"keyword argument(s) {', '.join(names)}: {how}, and plans are made for positional arguments"
            if self.strict:
                raise SignatureMismatch(f"{why}; the model itself answers such calls (strict=False)")
            if names not in self._said_keywords:
                self._said_keywords.add(names)
                self.say(f"{why}: the model itself answers such calls")
        return self._model_answers(inputs, keywords)

    def _model_answers(self, inputs: tuple, keywords: dict[str, Any] | None = None) -> Any:
        before = self.watch.attributes_now()  # (a few µs: the model answers every call where eager was chosen)
        with TRACING.calling():  # never while a plan's build traces (opsched.graph.tracing)
            answer = self.model(*inputs, **(keywords or {}))
        self.watch.forward_set(before)  # what its forward set is its own: not watched from now on
        return answer

    def _weights_changed(self, what: str) -> None:
        with self._lock:
            # every plan marked stale before the watch takes the new weights: a call on another thread that
            # finds no change (the watch updated) finds no plan of the old weights either
            stale = [p for p in list(self.plans.values()) if not p.stale and p.module is not None]
            for plan in stale:
                plan.stale = True
            self._generation += 1
            self._private = None
            self.watch.update()
        if stale:
            self.say(f"{what}: {len(stale)} plan(s) will be rebuilt from the model as it is now")

    def _private_model(self, generation: int) -> torch.nn.Module:
        """The copy of the model to build from, copied once the weights of ``generation`` were seen (so never
        older than those: a copy made before a change is not used after it). Raises what ``copy.deepcopy``
        raises for a model that cannot be copied: capturing the model itself would disturb its calls (torch.export
        swaps its parameters while it traces)."""
        with self._lock:
            if self._private is not None and self._private[0] == generation:
                return self._private[1]
        private = build_copy(self.model, self.watch.watches_tensors).eval()
        with self._lock:
            if generation == self._generation:
                self._private = (generation, private)
        return private

    def _make(self, signature: tuple, inputs: tuple, generation: int, like: Plan | None = None) -> Plan:
        """Build (or rebuild) the plan for ``signature`` from the weights of ``generation`` (from ``like``'s
        schedule, a plan for other sizes of the dynamic dimensions, where given)."""
        old = self.plans.get(signature)
        try:
            model = self._private_model(generation)
            # what the copy's forward sets itself while the plan is verified and timed: the model's forward sets
            # those too (by the same paths), and they are not followed
            with autocast_of(signature), attributes_set_by(model) as own:  # made, measured and verified in the
                if old is not None and old.stale:                       # call's autocast (thread-local)
                    plan = self.builder.rebuild(model, old)
                elif like is not None:
                    plan = self.builder.resize(model, like, inputs)
                else:
                    plan = self.builder.build(model, inputs)
            self.watch.ignore(own, by_build=True)
            if _traced_with_fx(plan):
                # its units hold the copy's own modules, which the next capture of the copy would swap out
                # under it: the next build copies again
                with self._lock:
                    if self._private is not None and self._private[1] is model:
                        self._private = None
        except Exception as e:  # noqa: BLE001 - the model keeps answering; said once, not retried
            plan = Plan(signature, inputs, None, "eager", note=f"no plan: {first_line(e)}")
        plan.signature = signature
        with self._lock:
            if generation == self._generation:
                self._keep(plan)
            else:  # the weights changed while it was built: keep its schedule, rebuild at the next call
                plan.stale = True
                self._keep(plan)
        return plan

    def _keep(self, plan: Plan) -> None:
        if plan.made is None:
            self._plans_made += 1
            plan.made = self._plans_made
        self.plans[plan.signature] = plan
        self.plans.move_to_end(plan.signature)
        while len(self.plans) > self.max_plans:
            _, dropped = self.plans.popitem(last=False)
            self.say(f"dropped the plan for {describe(dropped.signature)}, the least recently used "
                     f"(max_plans={self.max_plans})")

    def _build_now(self, signature: tuple, inputs: tuple, like: Plan | None = None) -> None:
        self.say(f"building a plan for {describe(signature)} ...")
        self.say(self._made(self._make(signature, copied(inputs), self._generation, like)))

    @staticmethod
    def _made(plan: Plan) -> str:
        if plan.module is None:
            return f"for {describe(plan.signature)}: the model itself answers ({plan.note})"
        return f"plan ready for {plan.summary()}"

    def _build_later(self, signature: tuple, inputs: tuple, why: str, like: Plan | None = None) -> None:
        with self._lock:
            if signature in self._pending:
                return
            if self._builder is None:
                self._builder = start_background(_build_loop, (weakref.ref(self), self._jobs), "opsched-build",
                                                 wake=functools.partial(self._jobs.put, None))
                weakref.finalize(self, self._jobs.put, None)  # the module collected: its builder ends
            self.say(f"{why}: the model answers while a plan for {describe(signature)} is built in the background")
            future: Future = Future()
            self._pending[signature] = future
            self._jobs.put((signature, copied(inputs), self._generation, like, future))

    def _background(self, signature: tuple, inputs: tuple, generation: int, like: Plan | None) -> None:
        try:
            stop_point()  # the interpreter exits: the builds still queued are not started
            self.say(self._made(self._make(signature, inputs, generation, like)))
        finally:
            with self._lock:
                self._pending.pop(signature, None)

    def prepare(self, *inputs: Any) -> Plan:
        """Build the plan for a call with ``inputs`` now (unless one serves it already) and return it."""
        signature = call_signature(inputs)
        plan = self.plans.get(signature)
        if plan is None or plan.stale:
            self._build_now(signature, inputs, self._sized_like(signature)[0] if plan is None else None)
        return self.plans[signature]

    def save(self, path: Any) -> None:
        """Write every call signature's plan to one plan file (``opsched.load`` reads it; see
        :mod:`opsched.deploy`)."""
        from opsched.deploy import save

        save(self, path)

    def wait_for_builds(self, timeout: float | None = None) -> None:
        """Wait until the plans being built in the background are ready."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            future.result(timeout)

    def refresh(self) -> None:
        """Rebuild every plan from the weights as they are now: after writes the version counters do not see
        (through ``tensor.data``)."""
        forget_folds(self.watch.tensors)  # a fold looked up by their memory would be the one of the old values
        self._weights_changed("refresh() asked")

    def close(self) -> None:
        """Wait for the builds under way, and end the builder's and the plans' worker threads (a later call
        starts them again)."""
        with self._lock:
            builder, self._builder = self._builder, None
        if builder is not None:
            self._jobs.put(None)
            builder.join()
        for plan in list(self.plans.values()):
            if hasattr(plan.module, "close"):
                plan.module.close()

    def extra_repr(self) -> str:
        return f"{type(self.model).__name__}, {len(self.plans)} plan(s), max_plans={self.max_plans}"

    # The model's own module methods. The optimized module stands in for the model: it holds the model's own tables
    # of submodules, parameters and buffers, so that what PyTorch does to one, directly or through a module holding
    # it (parameters(), modules(), load_state_dict, fast.fc), it does to the model; and these reach the model itself
    # (before, fast.train() left the model in eval mode and the plans answered without its dropout, and
    # fast.double() converted nothing). The watch sees each change at the next call.

    def train(self, mode: bool = True) -> GuardedModule:
        """Put the model in training mode (its calls are then answered by the model itself) or back in eval mode."""
        self.model.train(mode)  # (its own train(), which may keep some layers in eval mode: not undone here)
        object.__setattr__(self, "training", mode)
        return self

    def _apply(self, fn: Callable, recurse: bool = True) -> GuardedModule:
        # .to(), .double(), .half(), .float(), .cpu(), .cuda(), .type(): converts the model's tensors
        self.model._apply(fn, recurse)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's state dict, with its keys."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load ``state_dict`` into the model (the plans are rebuilt from it at the next call)."""
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # (a module holding this one loads through here: the model's own, which its class may override)
        self.model._load_from_state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> GuardedModule:
        """An optimized module over a copy of the model (``copy.deepcopy`` of it, or of a module holding it: an
        exponential moving average's copy): its plans are this one's schedules, compiled again for the copy's
        weights at their signature's next call (the model answers meanwhile, unless ``wait`` or ``strict``)."""
        model = copy.deepcopy(self.model, memo)
        plans = [dataclasses.replace(plan, module=None, stale=True) if plan.module is not None else plan
                 for plan in list(self.plans.values())]
        twin = GuardedModule(model, self.builder, plans, strict=self.strict, wait=self.wait, max_plans=self.max_plans,
                             follow_weights=self.watch.watches_tensors, dynamic=self.dynamic,
                             own_attributes=set(self.watch.own_attributes), say=self.say)
        memo[id(self)] = twin
        return twin

    def __copy__(self) -> GuardedModule:
        # copy.copy: the same model, plans and watch, as before pickling was refused below (copy.copy goes through
        # __reduce_ex__ otherwise)
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OpschedError("an optimized module is not pickled (it holds compiled plans and threads): save its plans "
                           "with fast.save(path) and load them with opsched.load(path, model), or save "
                           "fast.state_dict()")


def positional_call(signature: inspect.Signature | None, inputs: tuple,
                    keywords: dict[str, Any]) -> tuple | None:
    """A call of a forward of ``signature`` with ``inputs`` and ``keywords``, as positional arguments alone: each
    parameter left out before the last one given takes its default. The model answers both the same, and the
    plan made for one serves the other. None where the call cannot be so passed (a keyword-only parameter,
    ``**kwargs``, a name the forward does not take, no signature).

    >>> def forward(x, scale=1.0, mask=None, *, flag=False): ...
    >>> positional_call(inspect.signature(forward), ("x",), {"mask": "m"})
    ('x', 1.0, 'm')
    >>> positional_call(inspect.signature(forward), ("x",), {"scale": 1.0, "mask": None})
    ('x',)
    >>> positional_call(inspect.signature(forward), ("x",), {"flag": True}) is None
    True
    """
    if signature is None:
        return None
    try:
        bound = signature.bind(*inputs, **keywords)
    except TypeError:
        return None
    parameters = list(signature.parameters.values())
    if any(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters if p.name in bound.arguments):
        return None
    last = max(k for k, p in enumerate(parameters) if p.name in bound.arguments)
    positional: list[Any] = []
    for p in parameters[:last + 1]:
        if p.kind is p.VAR_POSITIONAL:
            positional.extend(bound.arguments.get(p.name, ()))
        else:  # (bind took the call: a parameter left out has a default)
            positional.append(bound.arguments.get(p.name, p.default))
    # a keyword at its default at the end (attention_mask=None) is the call without it: the same plan
    while len(positional) > len(inputs) and _is_default(positional[-1], parameters[len(positional) - 1].default):
        positional.pop()
    return tuple(positional)


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default`` (of a plain type, an equal value of the same type: 1 is not 1.0)."""
    return value is default or (type(value) is type(default) and type(default) in (bool, int, float, str)
                                and value == default)


def _traced_with_fx(plan: Plan) -> bool:
    """Whether ``plan``'s units were captured by torch.fx (which keeps the model's own modules in them)."""
    graph = getattr(plan.module, "graph", None)
    return getattr(graph, "traced_with", None) == "torch.fx"


def _build_loop(module: weakref.ref, jobs: queue.SimpleQueue) -> None:
    """The builder thread: each job (signature, inputs, generation, future) built in turn, until ``None``. It
    holds the module only while building, so that a module dropped by its user can be collected."""
    while (job := jobs.get()) is not None:
        signature, inputs, generation, like, future = job
        guarded = module()
        if guarded is None:
            return
        try:
            guarded._background(signature, inputs, generation, like)
            future.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            future.set_exception(e)
        del guarded, job, inputs, like


