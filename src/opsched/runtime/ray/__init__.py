"""The Ray engine (``opsched run --engine ray``): a mapped plan's devices as Ray actors.

A mapped plan (``opsched map``) is a stream-form Schedule whose stream d is device d. When every device with
units is on one node, this engine creates one Ray actor there that runs them all as the local engine does
(:class:`~opsched.runtime.ray.actors.NodeWorker`; an inference is one call). Otherwise it creates one
Ray actor per device that has units, pinned to the device's node through a custom resource the node declares,
``opsched_node:<node>`` (each actor takes :data:`NODE_SHARE` of it, and its device's ``threads`` CPUs). An actor
holds its device's run steps of the plan's lowered program (:mod:`opsched.runtime.lowered`), whose callables
the kernels the plan chose for them make there (:class:`opsched.runtime.kernels.ChosenKernels`), and runs them
in the plan's order with ``torch.set_num_threads(threads)``.

A device's units are cut into *segments*: a segment starts at a unit that reads a value not yet on the device
(from another device, or a graph input) and ends at a unit whose value another device or the caller reads. A
segment is one remote call: it receives the values it imports and returns the ones it exports; values read
only on its device stay inside the actor. Two ways to make the calls:

- a Ray Compiled Graph (``ray.dag``), the default where the installed Ray can compile it: the calls are bound
  once into a graph whose values pass through channels between the actors; an inference is one ``execute``;
- one remote call per segment and inference, submitted in an order that respects the data, each import passed
  as the ObjectRef of the call that exports it, so that Ray starts a segment once its imports are in the
  object store, and runs an actor's segments in the order they were submitted.

On the 2-core machine this was written on, the compiled graph took a third of the remote calls' time per value
crossing devices and less than half per inference (docs/ray.md, measured). Tensors cross as NumPy arrays, which
Ray moves as raw buffers where it would pickle a tensor.

A run that fails is one :class:`DeviceFailed` naming the device: an actor that died, a unit that raised, or a
device that did not finish within ``run_seconds``; the module is then closed. Nothing here is imported by
``import opsched``: Ray is imported when it is used, and a missing Ray is one line telling the user to install
the ``[ray]`` extra.
"""

from opsched.runtime.ray.actors import DeviceWorker, NodeWorker, RayModule, from_wire, to_wire
from opsched.runtime.ray.cluster import (
    ClusterError,
    DeviceFailed,
    RayUnavailable,
    UnitError,
    check_nodes,
    import_ray,
    probe,
    ray_cluster,
)
from opsched.runtime.ray.segments import Segment, cut_segments

__all__ = ["ClusterError", "DeviceFailed", "DeviceWorker", "NodeWorker", "RayModule", "RayUnavailable", "Segment", "UnitError",
           "check_nodes", "cut_segments", "from_wire", "import_ray", "probe", "ray_cluster", "to_wire"]
