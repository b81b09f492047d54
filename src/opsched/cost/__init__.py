"""Cost models: how long a unit, and a stage of units run together, take on a device."""

from opsched.cost.base import CostModel
from opsched.cost.table import TableCost

__all__ = ["CostModel", "TableCost"]
