"""Cost models: per-stage times and memory, and communication between ranks."""

from flexpipe.cost.io import cost_from_dict, cost_to_dict, load_cost, save_cost
from flexpipe.cost.model import Comm, CostModel, Edge, StageCost
from flexpipe.cost.transformer import TransformerSpec, transformer_cost

__all__ = ["Comm", "CostModel", "Edge", "StageCost", "TransformerSpec", "cost_from_dict",
           "cost_to_dict", "load_cost", "save_cost", "transformer_cost"]
