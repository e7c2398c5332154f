"""The kind of a failure is in its type: ``InfeasibleError`` (valid inputs, constraints that
cannot all be met) is what generators and searches retry on; invalid input stays a plain
``ConfigError`` and surfaces at once; ``RunError`` is a real run failing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import greedy_block
from flexpipe.dsl.policy import ListScheduler, Policy, policy_schedule
from flexpipe.errors import ConfigError, FlexPipeError, InfeasibleError, RunError
from flexpipe.ir.placement import Placement
from flexpipe.plan import Cluster, Device, Layer, Model, plan
from flexpipe.plan.baselines import pipedream
from flexpipe.plan.problem import square
from flexpipe.runtime.processes.launch import LaunchError
from flexpipe.runtime.transport.comm import PeerError


def test_a_memory_limit_no_order_meets_is_infeasible() -> None:
    placement = Placement.linear(4)
    with pytest.raises(InfeasibleError, match="policy cannot finish"):
        policy_schedule(placement, 8, Policy(mem_limit=[0.5] * 4, reserve="all"))


def test_invalid_policy_input_is_not_taken_for_infeasible() -> None:
    placement = Placement.linear(2)
    cost = CostModel.per_rank(placement.stage_rank, 2)
    bad = replace(Policy(), reserve="sometimes")
    with pytest.raises(ConfigError, match="reserve") as info:
        ListScheduler(placement, 4, cost, bad).run()
    assert not isinstance(info.value, InfeasibleError)
    with pytest.raises(ConfigError, match="m \\(micro-batches\\)") as info:
        policy_schedule(placement, 0, Policy())
    assert not isinstance(info.value, InfeasibleError)


def test_a_block_that_does_not_fit_its_interval_is_infeasible() -> None:
    placement = Placement.vshape(2)
    cost = CostModel.per_rank(placement.stage_rank, 2)
    with pytest.raises(InfeasibleError, match="building block"):
        greedy_block(placement, cost, 0.5)
    with pytest.raises(ConfigError, match="w_delay") as info:
        greedy_block(placement, cost, 3.0, w_delay=-1.0)
    assert not isinstance(info.value, InfeasibleError)


def test_a_model_that_fits_no_device_is_infeasible_and_pipedream_says_none() -> None:
    model = Model("big", tuple(Layer(f"l{i}", 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1e9)
                              for i in range(4)), 4, (1,))
    cluster = Cluster("small", (Device(1.0), Device(1.0)), square(2, 0.0, 0.0),
                      square(2, 1e6, float("inf")))
    with pytest.raises(InfeasibleError, match="no plan of model 'big' fits"):
        plan(model, cluster)
    assert pipedream(model, cluster) is None


def test_run_failures_are_run_errors() -> None:
    assert issubclass(PeerError, RunError) and issubclass(LaunchError, RunError)
    assert issubclass(RunError, FlexPipeError) and not issubclass(RunError, ConfigError)
    assert issubclass(InfeasibleError, ConfigError)


def test_a_boundary_tensor_of_any_sent_dtype_is_described_and_others_are_named() -> None:
    """Every dtype the transport sends (complex ones too: Llama 4's rotary tables) round-trips
    through the shape message; another is refused naming it, not with a bare ValueError."""
    import torch

    from flexpipe.runtime.transport import p2p

    meta = tuple((dtype, (2, i + 1)) for i, dtype in enumerate(p2p.DTYPES))
    assert p2p._decode(p2p._encode(meta, torch.device("cpu"))) == meta
    with pytest.raises(FlexPipeError, match="float8_e4m3fnuz"):
        p2p._encode(((torch.float8_e4m3fnuz, (2,)),), torch.device("cpu"))


def test_profiling_placements_together_needs_one_rank_count() -> None:
    """Placements profiled in one launch share its processes: a mix of rank counts is refused
    with both counts named, before any process starts."""
    from flexpipe.runtime.measurement.profile import profile_together
    from flexpipe.runtime.models.spec import ModelSpec

    spec = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)
    with pytest.raises(ConfigError, match=r"one rank count.*\[2, 3\]"):
        profile_together([(spec, Placement.linear(2), None), (spec, Placement.linear(3), None)])
