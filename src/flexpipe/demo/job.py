"""The demo's steps: profile -> search -> compare -> train (1F1B in turn with the winner) ->
report. Each step is a function of the previous steps' results, so tests can run them one at a
time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from flexpipe.cost.model import CostModel
from flexpipe.errors import FlexPipeError
from flexpipe.ir.lower import lower
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.search import SearchResult, fit_cost, search
from flexpipe.sim.engine import simulate
from flexpipe.sim.trace import Trace

COMPARE = ("1f1b", "zb-h1", "zb-v", "v-min", "v-half", "v-zb")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and how hard it searches."""

    ranks: int = 2
    """Pipeline ranks (local processes over gloo)."""
    microbatches: int = 8
    """Micro-batches per step."""
    steps: int = 30
    """Optimizer steps with the winning schedule."""
    baseline_steps: int = 8
    """Steps of 1F1B measured for the speed-up of the winner."""
    layers: int = 6
    """Transformer blocks of the built-in GPT (plus embedding and head layers)."""
    hidden: int = 128
    """Hidden size."""
    seq: int = 64
    """Sequence length."""
    mem_fraction: float = 0.75
    """Activation memory limit per rank, as a fraction of 1F1B's peak."""
    out: str = "flexpipe-demo"
    """Folder for the report and the cost model."""
    search_candidates: int | None = None
    """Effort budget of the search: candidates tried in its fixed order (None: all). A count,
    so that the search's answer for the profiled costs does not depend on the machine's load
    (the profiled costs themselves still do)."""
    search_seconds: float | None = None
    """Optional wall-clock limit on the search (None: none)."""


@dataclass
class Compared:
    """One schedule simulated with the profiled costs."""

    name: str
    trace: Trace
    fits: bool


@dataclass
class DemoResult:
    """Everything the report shows."""

    cfg: DemoConfig
    cost: CostModel
    limit: float
    found: SearchResult
    compared: list[Compared] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    predicted: Trace | None = None
    measured: Trace | None = None
    baseline_ms: list[float] = field(default_factory=list)
    """Measured step times (ms) of 1F1B on the same model, for the measured speed-up."""
    seconds: dict[str, float] = field(default_factory=dict)


def model_spec(cfg: DemoConfig):  # type: ignore[no-untyped-def]
    """The built-in GPT at the demo size."""
    from flexpipe.runtime.models.spec import ModelSpec

    return ModelSpec("gpt", layers=cfg.layers, hidden=cfg.hidden, heads=4, vocab=256,
                     seq=cfg.seq, micro_batch=4, dtype="float32")


def profile_cost(cfg: DemoConfig) -> CostModel:
    """Measured costs of the model cut into 2 chunks per rank (merged or split as needed)."""
    from flexpipe.runtime.measurement.profile import profile

    return profile(model_spec(cfg), Placement.interleaved(cfg.ranks, 2))


def memory_limit(cfg: DemoConfig, cost: CostModel) -> float:
    """``mem_fraction`` of 1F1B's simulated peak activation on the linear cut."""
    one_f_one_b = registry.build("1f1b", cfg.ranks, cfg.microbatches)
    peak = max(simulate(one_f_one_b, fit_cost(cost, cfg.ranks)).metrics().peak_activation)
    return cfg.mem_fraction * peak


def compare(cfg: DemoConfig, cost: CostModel, limit: float, best: Schedule) -> list[Compared]:
    """The library's headline schedules and the search's winner, simulated with the costs."""
    out = []
    for name in COMPARE:
        try:
            sched = registry.build(name, cfg.ranks, cfg.microbatches)
            fitted = fit_cost(cost, sched.num_stages)
            if registry.library()[name].cost_aware:
                sched = registry.build(name, cfg.ranks, cfg.microbatches, cost=fitted)
            trace = simulate(sched, fitted)
        except FlexPipeError:
            continue
        out.append(Compared(name, trace, max(trace.metrics().peak_activation) <= limit + 1e-9))
    fitted = fit_cost(cost, best.num_stages)
    trace = simulate(best, fitted)
    out.append(Compared(winner_name(best), trace, True))
    return out


def winner_name(best: Schedule) -> str:
    """The search's winner as the report and the terminal name it, once: ``search winner:
    policy[interleaved] ...`` (the schedule's own name without its ``search:`` prefix)."""
    return f"search winner: {best.name.removeprefix('search:').strip() or 'unnamed'}"


def train(cfg: DemoConfig, schedule: Schedule
          ) -> tuple[list[float], list[float], Trace, list[float]]:
    """Train with ``schedule`` for the demo's steps and, in the same launch, 1F1B for
    ``baseline_steps``, step k of each in turn (so the machine's drift reaches both alike);
    the winner's losses, step times (ms) and measured trace of its last step with its live
    activation memory per rank, and 1F1B's step times (ms)."""
    from flexpipe.runtime.measurement.measure import measured_trace
    from flexpipe.runtime.processes.launch import launch
    from flexpipe.runtime.processes.train import Job, TrainConfig

    config = TrainConfig(steps=cfg.steps, optimizer="adamw", lr=3e-3, timeout_s=120.0,
                         measure_memory=True)
    baseline = registry.build("1f1b", cfg.ranks, cfg.microbatches)
    jobs = [Job(schedule, model_spec(cfg), config),
            Job(baseline, model_spec(cfg), replace(config, steps=cfg.baseline_steps,
                                                   measure_memory=False))]
    ranks, base = launch(jobs, cfg.ranks, timeout_s=120.0, deadline_s=900.0, interleave=True)
    losses = next(r.losses for r in ranks if r.losses and r.losses[0] is not None)
    return ([float(x) for x in losses if x is not None], _step_ms(ranks),
            measured_trace(schedule, ranks), _step_ms(base))


def _step_ms(ranks: list[Any]) -> list[float]:
    """A launch's step times (ms): the slowest rank's, step by step."""
    return [1e3 * max(r.step_times[k] for r in ranks) for k in range(len(ranks[0].step_times))]


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> DemoResult:
    """Run every step, reporting progress through ``say``."""
    clock = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    say(f"profiling the built-in GPT on {cfg.ranks} ranks")
    cost = profile_cost(cfg)
    lap("profile")
    limit = memory_limit(cfg, cost)
    say(f"searching the best schedule under {limit:,.0f} bytes of activations per rank")
    found = search(cost, cfg.ranks, cfg.microbatches, limit, max_seconds=cfg.search_seconds,
                   max_candidates=cfg.search_candidates)
    lap("search")
    if found.best is None:
        raise FlexPipeError("no schedule fits the demo's memory limit; raise --mem-fraction")
    result = DemoResult(cfg, cost, limit, found, seconds=seconds)
    result.compared = compare(cfg, cost, limit, found.best)
    lap("compare")
    say(f"training {cfg.steps} steps with the {winner_name(found.best)}, and 1F1B for "
        f"{cfg.baseline_steps} in turn with it (the measured speed-up)")
    result.losses, result.step_ms, result.measured, result.baseline_ms = train(cfg, found.best)
    result.predicted = simulate(lower(found.best), fit_cost(cost, found.best.num_stages))
    lap("train")
    return result
