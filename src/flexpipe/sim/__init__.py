"""Simulation: schedule + cost model -> Trace, metrics, and the validator."""

from flexpipe.sim.engine import default_cost, simulate
from flexpipe.sim.trace import BUBBLE_DEFINITION, Metrics, Record, Trace

__all__ = ["BUBBLE_DEFINITION", "Metrics", "Record", "Trace", "default_cost", "simulate"]
