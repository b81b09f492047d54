"""The unit graph: IR (ir), capture from PyTorch (capture), DAG JSON (dagjson), blocks (blocks) and a
reference interpreter (interpret)."""

from opsched.graph.ir import Graph, Node, bit, can_merge, indices, mask_of

__all__ = ["Graph", "Node", "bit", "can_merge", "indices", "mask_of"]
