"""Mapping a network onto several heterogeneous devices (DiviML / MILP-SPLIT).

A :class:`~opsched.mapping.platform.Platform` is devices and links; a
:class:`~opsched.mapping.problem.Problem` is a graph with each unit's cost on each device; an algorithm
(one per module: best-device, MET, Greedy, HEFT, SA, (1+1) EA, the MILP, MILP-SPLIT) returns a
:class:`~opsched.mapping.plan.Mapping`, which the event-driven simulator (``replay.py``) times. A mapping
becomes a stream-form :class:`~opsched.schedule.Schedule` (one stream per device) for ``opsched run`` and
``opsched show``.
"""

from opsched.errors import OpschedError


class MappingError(OpschedError, ValueError):
    """A platform, mapping graph or mapped plan that cannot be used (one line, exit status 2)."""
