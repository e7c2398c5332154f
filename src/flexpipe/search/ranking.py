"""Ranking simulated candidates, shared by the chain search (``flexpipe.search.engine``) and the
graph search (``flexpipe.search.graphs``): the objectives, the incumbent, the memory check that
marks a trial over the limit, and the CP-SAT improvement of the winner recorded as one more
trial."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.search.result import SearchResult, Trial
from flexpipe.sim.engine import simulate
from flexpipe.sim.trace import Metrics

EPS = 1e-9
Key = Callable[[Trial], tuple[float, ...]]
Progress = Callable[[int, int, str], None]
# Ranking key of a simulated trial per objective: smaller is better.
OBJECTIVES: dict[str, Key] = {
    "span": lambda t: (t.span or 0.0, t.makespan or 0.0, t.peak or 0.0),
    "makespan": lambda t: (t.makespan or 0.0, t.span or 0.0, t.peak or 0.0),
}


def objective_key(objective: str) -> Key:
    """The ranking key of ``objective``; a ConfigError naming the known ones otherwise."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown objective {objective!r} (known: {', '.join(OBJECTIVES)})")
    return OBJECTIVES[objective]


def simulated(label: str, family: str, placement: str, bound: float | None, schedule: Schedule,
              metrics: Metrics, seconds: float) -> Trial:
    """The trial of a simulated candidate, not ranked yet."""
    return Trial(label, family, placement, "slower", "", bound, max(metrics.span),
                 metrics.makespan, metrics.bubble_rate, max(metrics.peak_activation), seconds,
                 schedule, metrics)


@dataclass
class Ranking:
    """Per-rank memory ``limits``, the objective's ``key`` and the incumbent ``best``."""

    limits: tuple[float, ...]
    key: Key
    best: Trial | None = None

    def rank(self, trial: Trial) -> None:
        """Mark ``trial`` over memory, slower, or the new best (demoting the old best)."""
        metrics = trial.metrics
        assert metrics is not None, "only simulated trials are ranked"
        over = [r for r, v in enumerate(metrics.peak_activation) if v > self.limits[r] + EPS]
        if over:
            r = over[0]
            trial.status = "over memory"
            trial.reason = (f"rank {r} peaks at {metrics.peak_activation[r]:g} > "
                            f"{self.limits[r]:g}")
            return
        best = self.best
        if best is None or self.key(trial) < self.key(best):
            if best is not None:
                best.status, best.reason = "slower", f"beaten by {trial.label}"
            trial.status, self.best = "best", trial
            return
        trial.reason = f"span {trial.span:g} vs best {best.span:g}"

    def result(self, trials: list[Trial], bound: float) -> SearchResult:
        """The search's answer so far (its time is set by the caller)."""
        best = self.best
        return SearchResult(best.schedule if best else None, best, trials, bound, 0.0,
                            self.limits)

    def improve_best(self, result: SearchResult, cost: CostModel, time_limit: float, *,
                     label: str, name: str) -> None:
        """Improve the best schedule with CP-SAT under ``cost``; record the outcome as a trial
        called ``label`` (its schedule named ``name``) and in ``result.exact``."""
        from flexpipe.search.exact import improve

        best = self.best
        assert best is not None and best.schedule is not None, "no best schedule to improve"
        t0 = time.perf_counter()
        report = improve(best.schedule, cost, self.limits, time_limit=time_limit)
        result.exact = report.as_dict()
        if report.schedule is None:
            return
        metrics = simulate(report.schedule, cost).metrics()
        trial = simulated(label, "exact", best.placement, best.bound,
                          report.schedule.renamed(name), metrics, time.perf_counter() - t0)
        self.rank(trial)
        result.trials.append(trial)
        result.best_trial = self.best
        result.best = self.best.schedule if self.best else None
