"""What a search returns: the best schedule, every candidate tried with why it lost, the Pareto
frontier of time against peak memory, the lower bound and the gap to it, and the search time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.ir.schedule import Schedule
from flexpipe.sim.trace import BUBBLE_DEFINITION, Metrics

# Why a candidate is not the answer (``Trial.status``).
STATUSES = {
    "best": "the schedule returned",
    "slower": "fits the memory limit but is slower than the best",
    "over memory": "simulated peak activation exceeds the limit on some rank",
    "pruned (bound)": "its makespan lower bound is no better than the incumbent, before or "
                      "while it was built (dsl.cutoff): not simulated",
    "pruned (memory)": "a closed form says it cannot fit the limit: not built",
    "pruned (dominated)": "a family built for far less memory than the limit, which never wins "
                          "there (search.bounds): not built",
    "invalid": "the generator or scheduler could not produce a schedule for these inputs",
    "skipped (effort)": "the search's effort budget (candidates tried) ran out before it",
    "skipped (time)": "the search's optional wall-clock limit ran out before it",
}


def over_budget(done: int, t0: float, max_candidates: int | None,
                max_seconds: float | None) -> str:
    """The skip status when ``done`` candidates tried (since ``time.perf_counter()`` was
    ``t0``) exhaust the effort budget or the optional time limit, else ""."""
    if max_candidates is not None and done >= max_candidates:
        return "skipped (effort)"
    if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
        return "skipped (time)"
    return ""


@dataclass(frozen=True)
class RecomputeNote:
    """How a trial trades recompute for memory (``flexpipe.search.recompute``): ``plan``, the
    (stage, SR or R) pairs it recomputes; ``base``, the candidate's label without them;
    ``needed``, the candidate's largest peak without recompute on the ranks that recompute;
    ``limit``, their smallest limit; ``extra``, the recompute passes' time priced from the cost
    model (micro-batches x SR's or R's time, summed over the plan's stages);
    ``base_makespan`` and ``makespan``, the step time without and with them."""

    base: str
    plan: tuple[tuple[int, str], ...]
    needed: float
    limit: float
    extra: float
    base_makespan: float
    makespan: float

    @property
    def step_change(self) -> float:
        """The step time's relative change (0.06: 6% longer)."""
        return self.makespan / self.base_makespan - 1.0 if self.base_makespan > 0 else 0.0

    def stages_text(self) -> str:
        """``SR on stages 0-1, R on stage 3``."""
        parts = []
        for kind in ("SR", "R"):
            stages = [s for s, k in self.plan if k == kind]
            if stages:
                noun = "stage" if len(stages) == 1 else "stages"
                parts.append(f"{kind} on {noun} {stage_ranges(stages)}")
        return ", ".join(parts)

    def line(self, memory: Callable[[float], str]) -> str:
        """One readable line, memory written by ``memory`` (the views' ``fmt_memory``):
        ``recompute: SR on stages 0-1 (1f1b needs 3.1 GiB there without it; limit 2.5 GiB),
        +6.0% step time``."""
        return (f"recompute: {self.stages_text()} ({self.base} needs {memory(self.needed)} "
                f"there without it; limit {memory(self.limit)}), "
                f"{100 * self.step_change:+.1f}% step time")

    def as_dict(self) -> dict[str, object]:
        """JSON-ready dictionary."""
        return {"base": self.base, "stages": {k: [s for s, x in self.plan if x == k]
                                              for k in ("SR", "R")},
                "needed": self.needed, "limit": self.limit, "extra_time": self.extra,
                "base_makespan": self.base_makespan, "makespan": self.makespan,
                "step_change": self.step_change}


def stage_ranges(stages: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for s in sorted(stages):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass
class Trial:
    """One candidate's outcome. ``span`` is the largest per-rank span (the bubble rate's
    ``cost``), ``peak`` the largest per-rank peak activation; both None when not simulated."""

    label: str
    family: str
    placement: str
    status: str
    reason: str = ""
    bound: float | None = None
    span: float | None = None
    makespan: float | None = None
    bubble_rate: float | None = None
    peak: float | None = None
    seconds: float = 0.0
    schedule: Schedule | None = field(default=None, repr=False)
    metrics: Metrics | None = field(default=None, repr=False)
    recompute: RecomputeNote | None = None
    """Set on a candidate's recompute variant (``flexpipe.search.recompute``)."""

    def as_dict(self) -> dict[str, object]:
        """JSON-ready dictionary (without the schedule)."""
        keys = ("label", "family", "placement", "status", "reason", "bound", "span",
                "makespan", "bubble_rate", "peak", "seconds")
        out: dict[str, object] = {k: getattr(self, k) for k in keys}
        out["recompute"] = self.recompute.as_dict() if self.recompute else None
        return out


@dataclass
class SearchResult:
    """The answer of ``flexpipe.search.search``.

    ``best``: the fastest schedule that fits (None when nothing fits); ``trials``: every
    candidate with its status; ``frontier``: simulated trials not dominated in (span, peak);
    ``lower_bound``: no schedule in the searched placements has a smaller largest rank span;
    ``gap``: best span / lower bound - 1; ``exact``: the CP-SAT step's report, if it ran.
    ``bubble_definition``: what the trials' bubble rates measure (``sim.trace``)."""

    best: Schedule | None
    best_trial: Trial | None
    trials: list[Trial]
    lower_bound: float
    seconds: float
    limits: tuple[float, ...]
    exact: dict[str, object] | None = None

    @property
    def bubble_definition(self) -> str:
        """What the trials' ``bubble_rate`` measures, in words (print it beside the rates)."""
        return BUBBLE_DEFINITION

    @property
    def gap(self) -> float | None:
        """Relative gap of the best span to the lower bound."""
        if self.best_trial is None or self.best_trial.span is None or self.lower_bound <= 0:
            return None
        return self.best_trial.span / self.lower_bound - 1.0

    @property
    def frontier(self) -> list[Trial]:
        """Simulated trials not dominated in (span, peak), fastest first."""
        done = sorted((t for t in self.trials if t.span is not None and t.peak is not None),
                      key=lambda t: (t.span, t.peak))
        out: list[Trial] = []
        for t in done:
            if not out or t.peak < out[-1].peak - 1e-9:  # type: ignore[operator]
                out.append(t)
        return out

    @property
    def least_peak(self) -> Trial | None:
        """The simulated trial with the smallest largest-rank peak (recompute variants
        included): what the search could reach when nothing fits."""
        done = [t for t in self.trials if t.peak is not None]
        return min(done, key=lambda t: (t.peak, t.makespan or 0.0), default=None)

    def counts(self) -> dict[str, int]:
        """Trials per status."""
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out

    def as_dict(self) -> dict[str, object]:
        """JSON-ready summary: best schedule as text, frontier, trials, bound, gap, time."""
        best = self.best_trial
        return {
            "best": best.as_dict() if best else None,
            "schedule": self.best.to_text() if self.best else None,
            "lower_bound": self.lower_bound, "gap": self.gap, "seconds": self.seconds,
            "bubble_definition": BUBBLE_DEFINITION,
            "units": "times and spans in the cost model's time unit, memory in its act unit",
            "limits": list(self.limits), "counts": self.counts(),
            "recompute": best.recompute.as_dict() if best and best.recompute else None,
            "least_peak": _least(self.least_peak),
            "frontier": [t.as_dict() for t in self.frontier],
            "trials": [t.as_dict() for t in self.trials],
            "exact": self.exact,
        }


def _least(trial: Trial | None) -> dict[str, object] | None:
    """The least-peak trial in brief (``SearchResult.least_peak``)."""
    return None if trial is None else {"label": trial.label, "peak": trial.peak}
