"""Pipeline x data x tensor parallelism in the planner: the formulas of flexpipe.cost.parallel
against hand-computed values, tp = dp = 1 giving the single-pipeline planner's answer exactly,
the layout choice (fixed degrees, pp dp tp = the devices, memory forcing tp or dp > 1) and its
errors."""

from __future__ import annotations

import json

import pytest

from flexpipe.cost import parallel as par
from flexpipe.cost.transformer import TransformerSpec
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.plan import Cluster, Device, Layer, Model, Options, cluster_preset, model_preset
from flexpipe.plan import plan as plan_1d
from flexpipe.plan.choose3d import megatron_3d, plan_3d
from flexpipe.plan.parallel3d import (
    Layout,
    dp_bandwidth,
    layouts,
    node_size,
    replica_cluster,
    shard_model,
    tp_bandwidth,
)
from flexpipe.plan.presets import transformer_layers
from flexpipe.plan.problem import GBS, square

GB = 1e9
FAST = Options(refine_candidates=0, polish_sims=40, sim_budget=100)


# --- formulas -----------------------------------------------------------------------------------

def test_ring_collectives_by_hand() -> None:
    # 8 MB over 4 ranks at 1 MB/ms: all-reduce 2 * 3/4 * 8 = 12 ms, gather / scatter 6 ms
    assert par.ring_all_reduce(8e6, 4, 1e6) == pytest.approx(12.0)
    assert par.ring_gather(8e6, 4, 1e6) == pytest.approx(6.0)
    assert par.ring_all_reduce(8e6, 1, 1e6) == 0.0


def test_tensor_parallel_layer_by_hand() -> None:
    # tp = 2, output 1 MB at 1 MB/ms: one all-reduce = 2 * 1/2 * 1 = 1 ms, two per pass
    assert par.tp_times(8.0, 8.0, 4.0, 1e6, 2, 1e6) == pytest.approx((6.0, 6.0, 2.0))
    assert par.tp_comm(1e6, 2, 1e6) == pytest.approx(4.0)
    # act 34 with output 2: 10 replicated + 24 / 2; wact 32: 4 + 28 / 2; params halve
    assert par.tp_memory(34.0, 32.0, 24.0, 2.0, 2) == pytest.approx((22.0, 18.0, 12.0))
    assert par.tp_times(8.0, 8.0, 4.0, 1e6, 1, 1e6) == (8.0, 8.0, 4.0)


def test_transformer_block_activation_matches_korthikanti() -> None:
    """sbh (10 + 24 / t + 5 a s / (h t)) bytes per layer under t-way tensor parallelism."""
    block = model_preset("gpt-1.3b").layers[1]
    s, h, a, t = 2048, 2048, 16, 4
    act, _, params = par.tp_memory(block.act, block.wact, block.params, block.out_bytes, t)
    assert act == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert params == pytest.approx(16 * 12 * h * h / t)


def test_data_parallel_by_hand() -> None:
    # 160 MB static = 20 MB of fp16 weights and 20 MB of fp16 gradients, 4 replicas, 1 MB/ms
    assert par.dp_static(160e6, 4, sharded=False) == 160e6
    assert par.dp_static(160e6, 4, sharded=True) == pytest.approx(40e6 + 20e6)
    plain = par.dp_step_time(160e6, 4, 1e6, sharded=False)
    zero3 = par.dp_step_time(160e6, 4, 1e6, sharded=True)
    assert plain == pytest.approx(2 * 3 / 4 * 20)  # all-reduce of the gradients: 2 Psi
    assert zero3 == pytest.approx(3 * 3 / 4 * 20)  # 2 gathers + 1 reduce-scatter: 3 Psi
    assert zero3 / plain == pytest.approx(1.5)  # ZeRO's 1.5x
    assert par.dp_step_time(160e6, 1, 1e6, sharded=True) == 0.0


def test_transformer_cost_model_per_tensor_parallel_rank() -> None:
    """``transformer_cost(tp=...)`` / a cost file's ``transformer.tp``: one rank's share."""
    from flexpipe.cost import cost_from_dict, transformer_cost

    shape = {"layers": 4, "hidden": 1024, "heads": 16, "seq": 512, "num_stages": 2}
    full = transformer_cost(**shape).stages[0]
    half = transformer_cost(**shape, tp=2, tp_bandwidth_gbs=100.0).stages[0]
    out = 2 * 512 * 1024  # 2 s b h bytes per layer, 2 layers per stage
    ar = 2 * (1 / 2) * out / 100e6  # one all-reduce at 100 GB/s = 1e8 bytes/ms
    assert half.time("F") == pytest.approx(full.time("F") / 2 + 2 * 2 * ar)
    assert half.time("W") == pytest.approx(full.time("W") / 2)
    assert half.act == pytest.approx(2 * 5 * out + (full.act - 2 * 5 * out) / 2)
    assert half.params == pytest.approx(full.params / 2) and half.out_bytes == full.out_bytes
    loaded = cost_from_dict({"transformer": {**shape, "tp": 2, "tp_bandwidth_gbs": 100}})
    assert loaded.stages[0] == half
    with pytest.raises(ConfigError, match="tp 3 does not divide the 16 attention heads"):
        transformer_cost(**shape, tp=3)


# --- layouts ------------------------------------------------------------------------------------

def test_node_size_from_the_links() -> None:
    assert node_size(cluster_preset("nodes", 16)) == 8
    assert node_size(cluster_preset("nodes", 8)) == 8
    assert node_size(cluster_preset("pcie", 16)) == 4
    assert node_size(cluster_preset("ring", 8)) == 1
    assert node_size(cluster_preset("random", 8)) == 1


def test_sharded_model_and_replica_cluster() -> None:
    model, cluster = model_preset("gpt-1.3b"), cluster_preset("nodes", 16)
    lay = Layout(pp=2, dp=4, tp=2)
    assert tp_bandwidth(cluster, lay) == pytest.approx(300 * GBS)  # NVLink
    assert dp_bandwidth(cluster, lay, 0) == pytest.approx(300 * GBS)  # replicas in one node
    assert dp_bandwidth(cluster, Layout(pp=1, dp=2, tp=8), 0) == pytest.approx(25 * GBS)
    sharded = shard_model(model, cluster, lay)
    assert sharded.global_batch == model.global_batch // 4
    block, one = sharded.layers[1], model.layers[1]
    ar = 2 * 2 * (1 / 2) * one.out_bytes / (300 * GBS)
    assert block.f == pytest.approx(one.f / 2 + ar) and block.w == pytest.approx(one.w / 2)
    vc = replica_cluster(cluster, lay, 1)
    assert vc.size == 2  # groups 1 and 5: devices 2-3 and 10-11, joined by InfiniBand
    assert vc.bandwidth[0][1] == pytest.approx(25 * GBS)


def test_single_pipeline_is_todays_planner_exactly() -> None:
    model, cluster = model_preset("gpt-1.3b"), cluster_preset("pcie", 4)
    one = Layout(pp=4, dp=1, tp=1)
    assert shard_model(model, cluster, one) is model
    assert replica_cluster(cluster, one, 0) is cluster
    got, ref = plan_3d(model, cluster, FAST, tp=1, dp=1), plan_1d(model, cluster, FAST)
    assert got.plan.best.makespan == ref.best.makespan
    assert got.plan.best.candidate == ref.best.candidate
    assert got.best.step_ms == ref.best.makespan and got.best.dp_ms == 0.0


def test_fixed_degrees_are_respected() -> None:
    model, cluster = model_preset("gpt-1.3b"), cluster_preset("nodes", 8)
    assert {(x.pp, x.dp, x.tp) for x in layouts(model, cluster)} == {
        (8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2),
        (2, 1, 4), (1, 2, 4), (1, 1, 8)}
    got = plan_3d(model, cluster, FAST, tp=2)
    assert {r.layout.tp for r in got.rows} == {2} and got.best.layout.tp == 2
    assert all(r.layout.pp * r.layout.dp * r.layout.tp == 8 for r in got.rows)
    got = plan_3d(model, cluster, FAST, dp=2)
    assert {r.layout.dp for r in got.rows} == {2}
    assert "fastest layout that fits memory" in got.reason


def _big_model() -> tuple[Model, Cluster]:
    """Two 60 GB layers on four 40 GB devices of one node: no stage split fits."""
    layer = Layer("big", 10.0, 10.0, 5.0, 1e8, 5e7, 1e7, 60 * GB)
    cluster = Cluster("box-4", tuple(Device(40 * GB) for _ in range(4)),
                      square(4, 0.005, 0.0), square(4, 300 * GBS, float("inf")))
    return Model("big", (layer, layer), 8, (1, 2), 8), cluster


def test_memory_forces_tensor_or_sharded_data_parallelism() -> None:
    model, cluster = _big_model()
    with pytest.raises(InfeasibleError):
        plan_3d(model, cluster, FAST, tp=1, dp=1)
    got = plan_3d(model, cluster, FAST)
    assert got.best.fits and got.best.peak <= 40 * GB
    assert got.best.layout.tp > 1 or got.best.layout.sharded
    assert any(not r.fits for r in got.rows)
    assert "do not fit memory" in got.reason
    zero = plan_3d(model, cluster, FAST, tp=1, dp=2)  # FSDP rescues plain data parallelism
    assert zero.best.layout.sharded and zero.best.dp_ms > 0


def test_the_slowest_replica_sets_the_step() -> None:
    """Two nodes of two devices, the second half as fast: replica 1 (the second node) decides."""
    bw = tuple(tuple(float("inf") if a == b else (300 if a // 2 == b // 2 else 25) * GBS
                     for b in range(4)) for a in range(4))
    cluster = Cluster("two-speeds", (Device(80 * GB), Device(80 * GB), Device(80 * GB, 0.5),
                                     Device(80 * GB, 0.5)), square(4, 0.005, 0.0), bw)
    assert node_size(cluster) == 2
    model = Model("m", tuple(Layer(f"l{i}", 1.0, 1.0, 1.0, 1e6, 1e6, 1e6, 1e8)
                             for i in range(4)), 8, (1, 2))
    row = plan_3d(model, cluster, FAST, tp=2, dp=2).best
    assert row.outcome is not None and row.layout.pp == 1
    assert row.pipeline_ms > 1.9 * row.outcome.makespan  # replica 0 runs at full speed


def test_megatron_default_is_a_node_of_tensor_parallelism() -> None:
    row = megatron_3d(model_preset("gpt-6.7b"), cluster_preset("nodes", 16))
    assert row is not None and row.fits
    assert row.layout.tp == 8 and row.layout.pp * row.layout.dp == 2


@pytest.mark.parametrize(("tp", "dp", "says"), [
    (3, None, "--tp 3 does not divide the 8 devices"),
    (None, 3, "--dp 3 does not divide the 8 devices"),
    (0, None, "--tp must be a positive integer"),
])
def test_bad_degrees_name_the_value(tp: int | None, dp: int | None, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        plan_3d(model_preset("gpt-1.3b"), cluster_preset("nodes", 8), FAST, tp=tp, dp=dp)


def test_bad_degrees_heads_node_and_batch() -> None:
    model, cluster = model_preset("gpt-1.3b"), cluster_preset("nodes", 16)
    with pytest.raises(ConfigError, match="--tp 16 does not fit in one node"):
        layouts(model, cluster, tp=16)
    spec = TransformerSpec(layers=2, hidden=384, heads=6, seq=128)
    odd = Model("odd", transformer_layers(spec), 64, (1,), spec.heads)
    with pytest.raises(ConfigError, match="--tp 4 does not divide the 6 attention heads"):
        layouts(odd, cluster_preset("nodes", 8), tp=4)
    small = Model("small", model.layers, 6, (1, 2), 16)
    with pytest.raises(ConfigError, match="--dp 4: no micro-batch size"):
        layouts(small, cluster_preset("nodes", 8), dp=4)


def test_cli_plan_fixes_degrees_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    from flexpipe.cli.main import main

    assert main(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:8", "--tp", "2", "--dp",
                 "2", "--json", "--no-search", "--no-baselines"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parallel"]["pp"], data["parallel"]["dp"], data["parallel"]["tp"]) == (2, 2, 2)
    assert data["step_ms"] >= data["time_ms"] and data["reason"]
    assert main(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:8", "--tp", "3"]) == 2
    assert "--tp 3 does not divide the 8 devices" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:4", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "layouts considered" in out and "chosen" in out and "why:" in out
    assert "megatron default" in out
