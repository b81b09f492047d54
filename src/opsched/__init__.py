"""opsched: inter-operator scheduling for PyTorch inference.

One call per job: ``optimize`` (one model), ``optimize_batch`` (a model batch), ``map`` (several devices),
``run`` (a saved plan of any kind on its model); see :mod:`opsched.jobs`. ``load`` makes ``optimize``'s module again from its plan file (:mod:`opsched.deploy`); ``serve`` puts models
behind the Open Inference Protocol (:mod:`opsched.serving`). The names that need PyTorch (these, ``capture``, ``run_graph``, ``compile``, ``verify``,
``OptimizedModule``) are
imported on first use, so that working with DAG JSON graphs (and ``opsched schedule``) does not pay for
importing torch; ``Graph`` and ``Node`` too, so that importing the package itself is quick (the ``opsched``
executable installs its Ctrl-C handler only once the package is imported).
"""

from typing import Any

from opsched.errors import (
    CaptureError,
    DagJsonError,
    GraphError,
    ModelSpecError,
    NoGradient,
    OpschedError,
    SignatureMismatch,
    StaleWeights,
    VerificationError,
)

__version__ = "0.1.0"

_LAZY = {"Graph": "opsched.graph.ir", "Node": "opsched.graph.ir",
         "capture": "opsched.graph.capture", "run_graph": "opsched.graph.interpret", "compile": "opsched.runtime.module", "verify": "opsched.evaluation",
         "OptimizedModule": "opsched.runtime.module",
         "GuardedModule": "opsched.runtime.guarded", "load": "opsched.deploy",
         "optimize": "opsched.jobs", "optimize_batch": "opsched.jobs", "map": "opsched.jobs", "run": "opsched.jobs",
         "serve": "opsched.serving"}

__all__ = [
    "CaptureError",
    "DagJsonError",
    "Graph",
    "GraphError",
    "GuardedModule",
    "ModelSpecError",
    "NoGradient",
    "Node",
    "OpschedError",
    "OptimizedModule",
    "SignatureMismatch",
    "StaleWeights",
    "VerificationError",
    "__version__",
    "capture",
    "compile",
    "load",
    "map",
    "optimize",
    "optimize_batch",
    "run",
    "run_graph",
    "serve",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'opsched' has no attribute {name!r}")
