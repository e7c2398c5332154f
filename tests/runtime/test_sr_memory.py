"""Selective recompute's memory from the model: the activations a forward marked SR keeps are
measured per stage under the ``Recompute`` policy (``sr_act``, ``sr_act_w``), and the
simulator's activation peak from them matches a real 2-rank run's (live tensors after every
op) within 10%, under 1F1B (fused backward) and ZB-H1 (split), for a module policy and a
per-op one; the cost file keeps the figures (the shared 2-process launch)."""

from __future__ import annotations

import pytest
import shared_launch
import sr_models as sm

from flexpipe.cost.io import cost_from_dict, cost_to_dict
from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.memory_check import memory_cost
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules.recompute import with_recompute
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

TOLERANCE = 0.10
CASES = [("drop MLP", "1f1b"), ("drop MLP", "zb-h1"), ("save mm (per op)", "zb-h1")]


def _job(policy: str, schedule: str) -> Job:
    return Job(with_recompute(load(schedule, 2, 4)),
               ModelSpec("user", factory=sm.factory("net", policy)),
               TrainConfig(steps=1, measure_memory=True))


shared_launch.register(2, "sr-memory",
                       lambda: shared_launch.jobs([_job(*case) for case in CASES], 2))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_sr_peak_predicted_within_ten_percent() -> None:
    for case, ranks in zip(CASES, shared_launch.job_results(2, "sr-memory"), strict=True):
        job = _job(*case)
        cost = memory_cost(job)
        assert all(st.sr_act is not None and st.sr_act < st.act for st in cost.stages)
        want = simulate(lower(job.schedule), cost).metrics().peak_activation
        got = measured_trace(job.schedule, ranks).metrics().peak_activation
        for rank, (w, g) in enumerate(zip(want, got, strict=True)):
            assert abs(w - g) / g <= TOLERANCE, (case, rank, w, g)


def test_policies_keep_what_they_save() -> None:
    """A split backward keeps W's records (more), a per-op policy its products (more)."""
    fused, split = {}, {}
    for policy in ("drop MLP", "save mm (per op)"):
        st = memory_cost(_job(policy, "zb-h1")).stages[0]
        fused[policy], split[policy] = st.sr_act, st.sr_act_w
        assert st.sr_act is not None and st.sr_act_w is not None
        assert st.sr_act < st.sr_act_w <= st.act
    assert fused["drop MLP"] < fused["save mm (per op)"]


def test_cost_file_keeps_sr_figures() -> None:
    cost = memory_cost(_job("drop MLP", "1f1b"))
    back = cost_from_dict(cost_to_dict(cost))
    assert [(s.sr_act, s.sr_act_w) for s in back.stages] == \
        [(s.sr_act, s.sr_act_w) for s in cost.stages]
    with pytest.raises(ConfigError, match=r"stages\[0\].sr_act: 3 is more than act"):
        cost_from_dict({"stages": [{"F": 1, "B": 1, "W": 1, "act": 2, "sr_act": 3}]})
