"""``opsched serve --engine ray``: the models run in Ray Serve deployments, behind the same Open Inference Protocol
front end (:mod:`opsched.serving.app`, in this process).

The models are split as the local engine batches them: all of them in one group where their requests may run as one
call of their fused graph (two models or more that batch, with ``optimize`` and ``fuse``), else a group each. Each
group is one Ray Serve deployment of ``replicas`` replicas; each replica holds the group's models as the local
engine does (:class:`~opsched.serving.served.ServedModels`: the same endpoints, bounded queues, batcher and fused
graph), on its share of the cluster's CPUs. Ray Serve routes each request to a replica of its model's group, where
it is batched with what else that replica holds.

A replica is constructed, and so takes requests, once its plans are prepared: a deployment whose replicas are still
preparing answers 503 at once ("loading"), and the server is ready when every deployment runs. A replica's
queue that is full answers 503, as the local engine does, and so does Ray Serve's own queue before the replicas
(``max_queued_requests``). The front end checks every request against the model's signature, which a replica sends
it once its deployment runs, before anything crosses to Ray.

Ray runs on a local Ray started for the server (and shut down with it), or on the cluster at ``address``, where
the server's applications are deleted when it stops and nothing else of the cluster is touched. Needs Ray Serve
(``pip install 'opsched[serve,ray]'``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from opsched.errors import OpschedError, first_line
from opsched.models.sharing import sharing_copy
from opsched.serving.batcher import Overloaded, Signature
from opsched.serving.pickling import user_code_by_value

APP_PREFIX = "opsched-serve-"


def import_serve(address: str | None = None) -> tuple[Any, Any]:
    """The ``ray`` and ``ray.serve`` modules, or :class:`~opsched.runtime.ray.cluster.RayUnavailable` in one line
    (``address``: the cluster to serve on; None, a local Ray)."""
    from opsched.runtime.ray.cluster import RayUnavailable, import_ray

    ray = import_ray(local=address is None)
    try:
        from ray import serve
    except ImportError:
        raise RayUnavailable("--engine ray needs Ray Serve, which is not installed: "
                             "pip install 'opsched[serve,ray]'") from None
    return ray, serve


class ModelGroup:
    """A replica of one group's deployment: the group's models (``[ref]``, a reference to them in Ray's object store)
    served as the local engine serves them, their plans prepared before the constructor returns (Serve routes no
    request to a replica until then, and only warns of a slow start), on ``threads`` intra-op threads."""

    def __init__(self, models: list[Any], options: dict[str, Any], threads: int):
        import ray

        from opsched.serving.served import ServedModels

        torch.set_num_threads(threads)
        # the models come through Ray's object store (``[ref]``: a reference in a list is not resolved for us), not
        # in the deployment's arguments, which Serve's controller keeps in its checkpoint
        self.served = ServedModels(ray.get(models[0]), **options)
        self.served.ready.wait()

    def signatures(self) -> dict[str, tuple[Signature, str | None]]:
        """Each model's signature, and why it answers itself rather than through its plans (None: it has them)."""
        return {name: (e.signature(), None if e.module is not e.model else e.note or "no plans were prepared")
                for name, e in self.served.endpoints.items()}

    async def infer(self, name: str, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
        outputs = await self.served.endpoints[name].infer(inputs, batch)
        return {k: self.own_storage(v) for k, v in outputs.items()}

    @staticmethod
    def own_storage(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, copied where it is a view of a larger storage: an answer is its rows of its call's outputs,
        and Ray would send the whole batch's storage with it."""
        return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor

    def __del__(self) -> None:  # Ray Serve stops a replica so: answer what it accepted, end its threads
        served = getattr(self, "served", None)
        if served is not None:
            served.close()


class RemoteEndpoint(Signature):
    """A model served by a Ray Serve deployment, as the front end sees it: its signature, ``ready`` once the
    deployment runs, and :meth:`infer` through the deployment's handle."""

    def __init__(self, signature: Signature):
        self.take(signature)
        self.handle: Any = None  # the deployment's handle to ``infer``, once it runs
        self.failed: str | None = None  # why its deployment did not start
        self.ready = threading.Event()

    async def infer(self, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
        """The request's outputs by name, from a replica; Overloaded while the deployment is preparing, when its
        queue is full, or when Ray Serve's queue before it is."""
        from ray.serve.exceptions import BackPressureError

        if self.failed:
            raise OpschedError(self.failed)
        if self.handle is None:
            raise Overloaded(f"model {self.name!r} is loading its plans; try again")
        try:
            return await self.handle.remote(self.name, inputs, batch)
        except BackPressureError:
            raise Overloaded(f"model {self.name!r} has too many requests waiting; try again") from None
        except Exception as error:  # noqa: BLE001 - Ray wraps what the replica raised (a full queue, the model's
            # own error): the cause itself, as the local engine raises it
            raise (getattr(error, "cause", None) or error).with_traceback(None) from None


class RayModels:
    """``models`` served by Ray Serve deployments (see the module docstring): ``endpoints`` by name for the front
    end, ``ready`` once every deployment runs, ``group`` (None: the fused groups live in the replicas), and
    :meth:`close`. ``options`` are :class:`~opsched.serving.served.ServedModels`'s."""

    def __init__(self, models: Mapping[str, tuple[Any, Sequence[Any]]], options: dict[str, Any], *,
                 replicas: int = 1, address: str | None = None, say: Callable[[str], Any] = lambda text: None):
        import opsched
        from opsched.runtime.ray.cluster import ClusterError, ray_cluster
        from opsched.serving.batcher import ModelEndpoint

        ray, serve = import_serve(address)
        self.serve, self.say, self.group = serve, say, None
        # the signatures and plan files are checked here, before Ray starts: a model that cannot be served, or a plan
        # that does not fit its model, fails in one line, as with the local engine (the replicas load them again)
        local = {name: ModelEndpoint(name, model, tuple(inputs), max_batch=options["max_batch"],
                                     queue_size=options["queue_size"]) for name, (model, inputs) in models.items()}
        for name, path in options["plans"].items():
            say(f"{name}: checking {path} ...")
            opsched.load(path, sharing_copy(local[name].model), max_plans=local[name].max_batch + 1).close()
        fused = options["optimize"] and options["fuse"] and sum(e.batchable for e in local.values()) > 1
        groups = [list(models)] if fused else [[name] for name in models]
        self.endpoints = {name: RemoteEndpoint(endpoint.signature()) for name, endpoint in local.items()}
        self.ready = threading.Event()
        self._stack = contextlib.ExitStack()
        self._closing = threading.Event()
        self._apps_lock = threading.Lock()
        self.apps: list[str] = []
        where = "Ray"
        try:
            where = self._stack.enter_context(ray_cluster([], os.cpu_count() or 1, address))
            serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        except ClusterError:
            self._stack.close()
            raise
        except Exception as e:  # noqa: BLE001 - Serve fails to start in many ways; one line for the user
            self._stack.close()
            raise OpschedError(f"could not start Ray Serve on {where}: {first_line(e)}") from None
        # each replica's share of the CPUs, at most a node's (a replica runs on one), rounded down as Ray counts them
        nodes = [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        cpus = ray.cluster_resources().get("CPU", 1.0)
        share = math.floor(min(cpus / (len(groups) * replicas), max(nodes, default=cpus)) * 1e4) / 1e4
        say(f"Ray Serve on {where}: {len(groups)} deployment(s) of {replicas} replica(s), {share:g} CPUs each")
        self._starting = threading.Thread(target=self._deploy, name="opsched-serve-ray-deploy", daemon=True,
                                          args=(ray, groups, models, options, replicas, share))
        self._starting.start()

    def _deploy(self, ray: Any, groups: list[list[str]], models: Mapping[str, Any], options: dict[str, Any],
                replicas: int, share: float) -> None:
        """Each group's deployment, started in turn; its models' endpoints take requests once it runs, or, where it
        fails to start (Serve gives up after three tries), answer 500 saying why. Ready once every one runs."""
        started = 0
        for k, names in enumerate(groups):
            if self._closing.is_set():
                return
            app = f"{APP_PREFIX}{k}-{os.getpid()}"
            waiting = options["queue_size"] * len(names)  # a replica's queues, summed
            deployment = self.serve.deployment(ModelGroup, name=app, num_replicas=replicas,
                                               ray_actor_options={"num_cpus": share}, max_ongoing_requests=waiting,
                                               max_queued_requests=waiting, graceful_shutdown_timeout_s=60)
            self.say(f"{', '.join(names)}: starting {replicas} replica(s), each preparing its plans ...")
            with self._apps_lock:
                self.apps.append(app)  # deleted on close, even while it starts
            try:
                from ray import cloudpickle

                user_code_by_value(cloudpickle, [models[n][0] for n in names])
                group = [ray.put({n: models[n] for n in names})]
                running = self.serve.run(deployment.bind(group, options, max(1, int(share))), name=app,
                                         route_prefix=None)
                # what the replicas run is what the front end checks requests against (their own batching check,
                # on their threads, may differ from this process's)
                signatures = running.options(method_name="signatures").remote().result()
                handle = running.options(method_name="infer")
            except Exception as e:  # noqa: BLE001 - the group's models answer 500 with the reason; the others go on
                if self._closing.is_set():
                    return
                why = self._why_failed(app) or first_line(e)
                for name in names:
                    self.endpoints[name].failed = f"its Ray Serve deployment failed to start: {why}"
                self.say(f"{', '.join(names)}: the deployment failed to start: {why}")
                continue
            for name in names:
                endpoint = self.endpoints[name]
                signature, itself = signatures[name]
                endpoint.take(signature)
                endpoint.handle = handle
                endpoint.ready.set()
                if itself and options["optimize"]:  # what the local engine says of it, which the replica cannot
                    self.say(f"{name}: the model answers itself: {itself}")
            self.say(f"{', '.join(names)}: ready")
            started += 1
        if started == len(groups):
            self.ready.set()
            self.say("ready")

    def _why_failed(self, app: str) -> str | None:
        """The last line of what Serve says of the app's deployment (the replica's exception), if anything."""
        try:
            status = self.serve.status().applications[app]
        except Exception:  # noqa: BLE001 - no status: the caller says what serve.run raised
            return None
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for d in status.deployments.values()
                 for line in d.message.splitlines()]
        lines = [line for line in lines if line]
        return lines[-1] if lines else None

    def close(self) -> None:
        """Delete the server's applications (their replicas answer what they accepted; one still starting too), and
        a local Ray with them; no deployment starts after. Once."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._starting.join(60)
        with self._apps_lock:
            apps = list(self.apps)
        for app in apps:
            with contextlib.suppress(Exception):
                self.serve.delete(app)
        self._stack.close()
