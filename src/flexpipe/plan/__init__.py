"""The planner: cut a model's layers into stages, map the stages onto devices over arbitrary
links, and choose the schedule and micro-batch size, judged by the simulator (docs/plan.md)."""

from flexpipe.plan.baselines import megatron, pipedream
from flexpipe.plan.inputs import cluster_from_dict, load_cluster, load_model, model_from_dict
from flexpipe.plan.planner import Options, Plan, plan
from flexpipe.plan.presets import cluster_preset, model_preset
from flexpipe.plan.problem import Cluster, Device, Layer, Model

__all__ = ["Cluster", "Device", "Layer", "Model", "Options", "Plan", "cluster_from_dict",
           "cluster_preset", "load_cluster", "load_model", "megatron", "model_from_dict",
           "model_preset", "pipedream", "plan"]
