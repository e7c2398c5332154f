"""Baselines the planner is measured against, each judged by the same simulator on the real
cluster:

- ``megatron``: equal layer counts per device, devices in index order, 1F1B (Megatron-LM's
  pipeline); the micro-batch size is the fastest allowed one that fits.
- ``pipedream``: the planner's own dynamic programming and 1F1B, but on a cluster whose links all
  have the mean bandwidth and latency and with devices in index order (PipeDream's partitioner
  assumes uniform links); its choice is then simulated on the real links.
"""

from __future__ import annotations

from flexpipe.cost.partition import uniform_cuts
from flexpipe.errors import InfeasibleError
from flexpipe.plan.evaluate import Candidate, Outcome, simulate_candidate
from flexpipe.plan.planner import Options, plan
from flexpipe.plan.problem import Cluster, Model


def _fastest(outcomes: list[Outcome | None]) -> Outcome | None:
    """The fastest that fits, else the fastest of all (reported as not fitting)."""
    done = [o for o in outcomes if o is not None]
    fitting = [o for o in done if o.fits] or done
    return min(fitting, key=lambda o: o.makespan, default=None)


def megatron(model: Model, cluster: Cluster) -> Outcome | None:
    """Uniform split, index order, 1F1B (None when 1F1B cannot run any micro-batch count)."""
    k = min(cluster.size, len(model.layers))
    cuts = uniform_cuts(len(model.layers), k)
    return _fastest([simulate_candidate(model, cluster, Candidate("1f1b", tuple(range(k)), cuts,
                                                                  b, m))
                     for b, m in model.choices()])


def pipedream(model: Model, cluster: Cluster) -> Outcome | None:
    """The uniform-bandwidth plan (1F1B, index order), simulated on the real cluster."""
    options = Options(families=("1f1b",), mapping="index", refine_seconds=0.0)
    try:
        chosen = plan(model, cluster.uniform_bandwidth(), options).best.candidate
    except InfeasibleError:  # nothing fits under PipeDream's view of the links
        return None
    return simulate_candidate(model, cluster, chosen)
