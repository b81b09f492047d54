"""Several models at once (HiveMind): a model batch as one Graph, rewritten where it pays (shared work once,
units batched across models), scheduled by any scheduler, verified model by model. See docs/multi.md."""

from opsched.multi.combine import ModelBatch, MultiError, combine
from opsched.multi.fuse import REWRITES, Fusion, fuse_graph
from opsched.multi.optimize import MultiOutcome, fuse, model_batch, optimize

__all__ = ["REWRITES", "Fusion", "ModelBatch", "MultiError", "MultiOutcome", "combine", "fuse", "fuse_graph",
           "model_batch", "optimize"]
