"""Cost models: per-stage times and memory, and communication between ranks."""

from flexpipe.cost.model import Comm, CostModel, StageCost

__all__ = ["Comm", "CostModel", "StageCost"]
