"""Cost files (JSON/TOML loading, validation, saving) and the analytic transformer model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost import (
    Comm,
    CostModel,
    Edge,
    StageCost,
    TransformerSpec,
    cost_from_dict,
    cost_to_dict,
    load_cost,
    save_cost,
    transformer_cost,
)
from flexpipe.cost.transformer import layer_cost
from flexpipe.errors import ConfigError
from flexpipe.schedules.registry import build
from flexpipe.sim import simulate


def write(tmp_path: Path, data: Any, name: str = "cost.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# --- loading ----------------------------------------------------------------------------------

def test_default_and_per_stage_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, {
        "description": "two stages",
        "default": {"F": 1.0, "B": 2.0, "W": 0.5, "act": 3, "out_bytes": 100},
        "stages": [{}, {"F": 4, "BW": 2.2, "params": 7, "OFFLOAD": 0.3}],
        "comm": {"latency": 0.1, "bandwidth": 1000},
    })
    cost = load_cost(path, num_stages=2, num_ranks=2)
    assert cost.stage(0) == StageCost({"F": 1.0, "B": 2.0, "W": 0.5}, act=3, out_bytes=100)
    s1 = cost.stage(1)
    assert s1.time("F") == 4 and s1.time("BW") == 2.2 and s1.time("OFFLOAD") == 0.3
    assert s1.params == 7 and s1.wact == 1.0 and s1.time("R") == 4
    assert cost.comm.time(0, 1, 100) == pytest.approx(0.2)
    assert cost.comm.time(1, 1, 100) == 0


def test_default_only_takes_the_stage_count_from_the_file_or_the_schedule(tmp_path: Path) -> None:
    data = {"default": {"F": 1, "B": 1, "W": 1}}
    assert load_cost(write(tmp_path, data), num_stages=5).num_stages == 5
    assert cost_from_dict({**data, "num_stages": 3}).num_stages == 3
    assert cost_from_dict({**data, "num_stages": 3}).comm.num_ranks == 3


def test_toml_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
num_ranks = 2
[default]
F = 1.5
B = 1.5
W = 1.0
[comm]
latency = [[0, 0.5], [0.25, 0]]
bandwidth = "inf"
""", "cost.toml")
    cost = load_cost(path, num_stages=4, num_ranks=2)
    assert cost.num_stages == 4 and cost.stage(3).time("BW") == 2.5
    assert cost.comm.time(0, 1, 1e9) == 0.5 and cost.comm.time(1, 0, 1e9) == 0.25


def test_asymmetric_bandwidth_matrix() -> None:
    cost = cost_from_dict({"default": {"F": 1, "B": 1, "W": 1}, "num_stages": 2,
                           "comm": {"bandwidth": [[0, 10], [20, 0]]}})
    assert cost.comm.time(0, 1, 100) == 10 and cost.comm.time(1, 0, 100) == 5


def test_loaded_costs_drive_the_simulator(tmp_path: Path) -> None:
    path = write(tmp_path, {"default": {"F": 2, "B": 2, "W": 2}, "comm": {"latency": 1}})
    schedule = build("1f1b", 2, 2)
    trace = simulate(schedule, load_cost(path, schedule.num_stages, schedule.num_ranks))
    # rank 1: 1F0 3-5, 1BW0 5-9, 1F1 9-11, 1BW1 11-15; rank 0: 0BW0 10-14, 0BW1 16-20
    assert trace.metrics().makespan == pytest.approx(20)


def test_an_edge_carrying_part_of_the_outputs_costs_its_own_bytes() -> None:
    """Stage 0 sends 10 bytes per micro-batch over a 1 byte/ms link (10 ms); an edge whose
    consumer reads 1 byte of them, and sends 1 back, takes 1 ms each way."""
    schedule = build("1f1b", 2, 2)
    unit = StageCost({"F": 1, "B": 1, "W": 1}, out_bytes=10.0)
    comm = Comm(((0.0, 0.0), (0.0, 0.0)), ((math.inf, 1.0), (1.0, math.inf)))
    full = CostModel((unit, unit), comm)
    assert full.sent(0, 1) == full.sent(0, 1, grad=True) == 10.0
    less = CostModel((unit, unit), comm, (Edge(0, 1, 1.0, 1.0),))
    back = CostModel((unit, unit), comm, (Edge(0, 1, 1.0, 10.0),))
    spans = [simulate(schedule, c).metrics().makespan for c in (full, back, less)]
    assert spans[0] > spans[1] > spans[2]
    # rank 0: F0 0-1, F1 1-2; 0 -> 1 at 1 ms; rank 1: F0 2-3, BW0 3-5, F1 5-6, BW1 6-8;
    # back at 1 ms: rank 0 BW0 6-8, BW1 9-11
    assert spans[2] == pytest.approx(11)
    with pytest.raises(ConfigError, match="cost model describes stages 0..1, not 2"):
        CostModel((unit, unit), comm, (Edge(0, 2, 1.0, 1.0),))


def test_what_a_stage_keeps_of_a_producer_on_its_rank_is_counted_once() -> None:
    """ZB-V puts stages 1 and 2 on rank 1: stage 2's forward keeps stage 1's output (say a
    layer norm's input), which stage 1 keeps until its B anyway. Rank 1's peak is that much
    less per micro-batch in flight; rank 0 (stages 0 and 3, fed over the link) is unchanged."""
    schedule = build("zb-v", 2, 4)
    unit = StageCost({"F": 1, "B": 1, "W": 1}, act=4.0, wact=2.0, out_bytes=1.0)
    plain = CostModel((unit,) * 4, Comm.uniform(2))
    shared = CostModel((unit,) * 4, Comm.uniform(2), (Edge(1, 2, 1.0, 1.0, kept=1.0),
                                                       Edge(2, 3, 1.0, 1.0, kept=1.0)))
    assert shared.mem_on(2, "act", schedule.placement.stage_rank) == 3.0
    assert shared.mem_on(3, "act", schedule.placement.stage_rank) == 4.0  # over the link
    before = simulate(schedule, plain).metrics().peak_activation
    after = simulate(schedule, shared).metrics().peak_activation
    assert after[0] == before[0] and before[1] - after[1] >= 1.0


# --- rejected files ---------------------------------------------------------------------------

BASE = {"default": {"F": 1, "B": 1, "W": 1}, "num_stages": 4}
BAD: dict[str, tuple[Any, str]] = {
    "negative": ({"stages": [{"F": 1, "B": 1, "W": 1}] * 3 + [{"F": -1, "B": 1, "W": 1}]},
                 "cost.json: stages[3].F: must be a finite non-negative number, got -1"),
    "nan": ('{"num_stages": 1, "default": {"F": NaN, "B": 1, "W": 1}}',
            "default.F: must be a finite non-negative number, got nan"),
    "inf time": ('{"num_stages": 1, "default": {"F": 1, "B": Infinity, "W": 1}}',
                 "default.B: must be a finite non-negative number, got inf"),
    "string time": ({**BASE, "stages": [{"W": "fast"}] * 4}, "stages[0].W: must be a finite"),
    "bool memory": ({**BASE, "default": {"F": 1, "B": 1, "W": 1, "act": True}},
                    "default.act: must be a finite non-negative number, got True"),
    "no stages": ({"default": {"F": 1, "B": 1, "W": 1}}, "give a 'stages' list or 'num_stages'"),
    "missing time": ({"num_stages": 2, "default": {"F": 1, "B": 1}},
                     "stages[0]: missing time 'W'"),
    "count mismatch": ({**BASE, "stages": [{}] * 3},
                       "the 'stages' list has 3 stages, 'num_stages' has 4"),
    "unknown top key": ({**BASE, "stage": []}, "cost.json: stage: unknown key; did you mean "
                        "'stages'?"),
    "unknown stage key": ({**BASE, "default": {"F": 1, "B": 1, "W": 1, "actt": 1}},
                          "default.actt: unknown key; did you mean 'act'?"),
    "lower-case time": ({**BASE, "default": {"f": 1, "B": 1, "W": 1}},
                        "default.f: unknown key; did you mean 'F'?"),
    "unknown comm key": ({**BASE, "comm": {"latncy": 1}},
                         "comm.latncy: unknown key; did you mean 'latency'?"),
    "ragged matrix": ({**BASE, "num_ranks": 2, "comm": {"latency": [[0, 1], [1]]}},
                      "comm.latency: must be a 2x2 matrix"),
    "sizes differ": ({**BASE, "comm": {"latency": [[0]], "bandwidth": [[1, 1], [1, 1]]}},
                     "comm.bandwidth: must be a 1x1 matrix"),
    "zero bandwidth": ({**BASE, "comm": {"bandwidth": 0}},
                       "comm.bandwidth[0][1]: must be positive"),
    "negative latency entry": ({**BASE, "comm": {"latency": [[0, 1, 1, 1]] * 3 + [[0, 0, -2, 0]]}},
                               "comm.latency[3][2]: must be a finite non-negative number, got -2"),
    "edge beyond the stages": ({**BASE, "edges": [{"from": 0, "to": 4, "bytes": 1}]},
                               "edges[0].to: must be an integer in 0..3, got 4"),
    "edge unknown key": ({**BASE, "edges": [{"from": 0, "to": 1, "byte": 1}]},
                         "edges[0].byte: unknown key; did you mean 'bytes'?"),
    "edge negative bytes": ({**BASE, "edges": [{"from": 0, "to": 1, "bytes": 1,
                                                 "grad_bytes": -1}]},
                            "edges[0].grad_bytes: must be a finite non-negative number, got -1"),
    "edges not a list": ({**BASE, "edges": {"from": 0}}, "edges: must be a non-empty list"),
    "stages not a list": ({**BASE, "stages": {"F": 1}}, "stages: must be a list"),
    "stage not a table": ({**BASE, "stages": [1, 2, 3, 4]}, "stages[0]: must be a table"),
    "not an object": ("[1, 2]", "cost.json: must be a table"),
    "bad num_stages": ({**BASE, "num_stages": 0}, "num_stages: must be a positive integer"),
    "invalid json": ("{not json", "cost.json: line 1, column 2: invalid JSON"),
    "transformer and stages": ({"transformer": {}, "stages": []},
                               "'transformer' cannot be combined with 'stages'"),
    "transformer missing": ({"transformer": {"layers": 4}},
                            "transformer: missing 'hidden', 'heads', 'seq'"),
    "transformer unknown": ({"transformer": {"layers": 4, "hiden": 8}},
                            "transformer.hiden: unknown key; did you mean 'hidden'?"),
    "transformer bad value": ({"transformer": {"layers": 4, "hidden": 8, "heads": 2,
                                               "seq": -5}},
                              "transformer: seq must be a positive integer, got -5"),
}
FOR_SCHEDULE: dict[str, tuple[Any, str]] = {
    "stage count": (BASE, "'num_stages' has 4 stages, the schedule has 3"),
    "matrix too small": ({**BASE, "num_stages": 3, "comm": {"latency": [[0, 1], [1, 0]]}},
                         "the links cover 2 ranks, the schedule has 3"),
    "transformer stages": ({"transformer": {"layers": 4, "hidden": 8, "heads": 2, "seq": 8,
                                            "num_stages": 2}},
                           "the model has 2 stages, the schedule has 3"),
    "transformer ranks": ({"transformer": {"layers": 3, "hidden": 8, "heads": 2, "seq": 8,
                                           "num_ranks": 2}},
                          "the links cover 2 ranks, the schedule has 3"),
}


@pytest.mark.parametrize("data, message", BAD.values(), ids=BAD.keys())
def test_bad_cost_files(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_cost(write(tmp_path, data))
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("data, message", FOR_SCHEDULE.values(), ids=FOR_SCHEDULE.keys())
def test_cost_files_that_do_not_fit_the_schedule(tmp_path: Path, data: Any,
                                                 message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_cost(write(tmp_path, data), num_stages=3, num_ranks=3)
    assert message in str(exc.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cost file"):
        load_cost(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="unknown cost file type '.yaml'"):
        load_cost(write(tmp_path, "{}", "cost.yaml"))
    with pytest.raises(ConfigError, match=r"cost.toml: invalid TOML"):
        load_cost(write(tmp_path, "F = = 1", "cost.toml"))
    with pytest.raises(ConfigError, match="writes JSON"):
        save_cost(CostModel.uniform(1, 1), tmp_path / "x.toml")


# --- saving -----------------------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path: Path) -> None:
    lat = ((0.0, 0.5, 1.0), (0.25, 0.0, 2.0), (1.5, 1.0, 0.0))
    bw = ((math.inf, 10.0, 5.0), (10.0, math.inf, 7.5), (3.0, 4.0, math.inf))
    stages = (StageCost({"F": 1.25, "B": 2.0, "W": 0.75, "R": 1.0}, act=3.0, wact=1.5),
              StageCost({"F": 1.0, "B": 1.0, "W": 1.0, "BW": 1.8}, params=9.0, out_bytes=64.0))
    routed = CostModel(stages, Comm(lat, bw), (Edge(0, 1, 16.0, 0.0),))
    for cost in (CostModel(stages, Comm(lat, bw)), routed, CostModel.uniform(4, 3, comm=0.5),
                 transformer_cost(layers=4, hidden=64, heads=4, seq=32, num_stages=2,
                                  bandwidth_gbs=25.0)):
        path = tmp_path / "saved.json"
        save_cost(cost, path)
        assert load_cost(path, num_stages=cost.num_stages, num_ranks=cost.comm.num_ranks) == cost
        assert cost_from_dict(json.loads(json.dumps(cost_to_dict(cost)))) == cost


# --- transformer ------------------------------------------------------------------------------

def test_transformer_numbers_by_hand() -> None:
    # s = 2048, b = 1, h = 1024, a = 16, V = 50000, 4 layers over 2 stages, 1e14 FLOP/s at 50 %.
    cost = transformer_cost(layers=4, hidden=1024, heads=16, seq=2048, micro_batch=1,
                            vocab=50000, device_flops=1e14, efficiency=0.5, num_stages=2,
                            latency_ms=0.01, bandwidth_gbs=100.0)
    f_layer = 2048 * 1024 * (24 * 1024 + 4 * 2048)    # 68_719_476_736 FLOPs
    b_layer = 2048 * 1024 * (24 * 1024 + 8 * 2048)    # 85_899_345_920
    w_layer = 24 * 2048 * 1024 * 1024                 # 51_539_607_552
    assert (f_layer, b_layer, w_layer) == (68_719_476_736, 85_899_345_920, 51_539_607_552)
    head = 2 * 2048 * 1024 * 50000                    # 209_715_200_000, each of F, B, W
    ms = 1e3 / 5e13                                   # milliseconds per FLOP
    first, last = cost.stage(0), cost.stage(1)
    assert first.time("F") == pytest.approx(2.74877906944)        # 2 f_layer ms
    assert first.time("B") == pytest.approx(2 * b_layer * ms)     # 3.4359738368
    assert first.time("W") == pytest.approx(2.06158430208)
    assert last.time("F") == pytest.approx(6.94308306944)         # (2 f_layer + head) ms
    assert last.time("W") == pytest.approx((2 * w_layer + head) * ms)
    assert first.act == 2 * 2048 * (34 * 1024 + 5 * 16 * 2048) == 813_694_976
    assert last.act == 813_694_976 + 4 * 2048 * 50000 == 1_223_294_976
    assert first.wact == last.wact == 2 * 32 * 2048 * 1024 == 134_217_728
    assert first.params == last.params == 2 * 12 * 1024**2 * 2 + 50000 * 1024 * 2 == 152_731_648
    assert first.out_bytes == first.input == 2 * 2048 * 1024
    # 4 MiB at 100 GB/s = 1e8 bytes/ms, plus 0.01 ms latency
    assert cost.comm.time(0, 1, first.out_bytes) == pytest.approx(0.01 + 4194304 / 1e8)


def test_transformer_splits_and_layer_formulas() -> None:
    spec = TransformerSpec(layers=10, hidden=16, heads=2, seq=8, num_stages=4)
    assert spec.split() == (3, 3, 2, 2)
    lc = layer_cost(spec)
    assert lc.b_flops + lc.w_flops == 2 * lc.f_flops  # the s^2 terms cancel too
    cost = transformer_cost(layers=10, hidden=16, heads=2, seq=8, layers_per_stage=(1, 9))
    assert cost.stage(1).time("F") == pytest.approx(9 * cost.stage(0).time("F"))
    assert cost.comm.num_ranks == 2 and cost.comm.time(0, 1, 1e9) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": 0}, "layers must be a positive integer"),
    ({"efficiency": 1.5}, "efficiency must be in (0, 1]"),
    ({"device_flops": -1.0}, "device_flops must be a finite positive number"),
    ({"num_stages": 9}, "cannot split 8 layers over 9 stages"),
    ({"layers_per_stage": (4, 3)}, "sums to 7, not layers = 8"),
    ({"layers_per_stage": (4, 4), "num_stages": 3}, "lists 2 stages, num_stages is 3"),
    ({"bandwidth_gbs": 0.0}, "bandwidth_gbs must be a positive number"),
    ({"vocab": 2.5}, "vocab must be a positive integer"),
])
def test_transformer_rejects_bad_specs(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"layers": 8, "hidden": 16, "heads": 2, "seq": 8, **kwargs}
    with pytest.raises(ConfigError) as exc:
        transformer_cost(**args)
    assert message in str(exc.value)


def test_transformer_table_in_a_cost_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
[transformer]
layers = 8
hidden = 64
heads = 4
seq = 128
layers_per_stage = [2, 2, 2, 2]
bandwidth_gbs = "inf"
[comm]
latency = 0.5
""", "model.toml")
    cost = load_cost(path, num_stages=4, num_ranks=4)
    assert cost == transformer_cost(layers=8, hidden=64, heads=4, seq=128,
                                    num_stages=4).with_comm(Comm.uniform(4, 0.5))
    from_file = cost_from_dict({"transformer": {"layers": 8, "hidden": 64, "heads": 4,
                                                "seq": 128}}, num_stages=2, num_ranks=2)
    assert from_file.num_stages == 2 and from_file.comm.num_ranks == 2


# --- fuzz: any JSON-like data gives a cost model or a ConfigError -----------------------------

KEYS = st.sampled_from(["default", "stages", "num_stages", "num_ranks", "comm", "transformer",
                        "F", "B", "W", "BW", "act", "latency", "bandwidth", "layers", "hidden",
                        "heads", "seq", "layers_per_stage", "vocab", "bandwidth_gbs", "x"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(10**300),
                    st.floats(), st.sampled_from(["inf", "", "F"]))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, JSONISH, max_size=5), st.sampled_from([None, 1, 2]))
def test_random_cost_data_gives_only_config_errors(data: dict[str, Any], n: int | None) -> None:
    try:
        cost = cost_from_dict(data, num_stages=n, num_ranks=n)
    except ConfigError:
        return
    assert isinstance(cost, CostModel)
