"""What the demo's numbers say: the winner's activation peak per rank, predicted vs measured,
its speed-up over 1F1B (one ratio throughout: 1F1B's step time / the winner's, above 1 is
faster), predicted and measured, and whether the prediction held (within 10%) and, when it did
not, why, from the ops' own measured times."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median as median_of

from flexpipe.demo.job import DemoResult, fit_cost
from flexpipe.sim.replay import split
from flexpipe.sim.trace import Trace
from flexpipe.viz.html import duration_errors
from flexpipe.viz.units import fmt_memory, fmt_ms

TOLERANCE = 0.10
"""A prediction further off than this (relative) is flagged, with its reason."""
COMPUTE = ("F", "B", "W", "BW", "R")


@dataclass(frozen=True)
class Speedup:
    """1F1B's step time / the winner's: ``predicted`` from the simulator with the profiled
    costs, ``measured`` from median step times."""

    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """How far the measured speed-up is from the predicted one (relative)."""
        return self.measured / self.predicted - 1.0


def memory_rows(result: DemoResult) -> list[list[str]]:
    """Per rank of the winner: predicted and measured activation peak and their difference
    (empty when the run did not measure memory)."""
    if result.predicted is None or result.measured is None:
        return []
    pred = result.predicted.metrics().peak_activation
    meas = result.measured.metrics().peak_activation
    if not any(meas):
        return []
    return [[str(r), fmt_memory(p), fmt_memory(m), f"{100.0 * (p - m) / m:+.1f}%" if m else "-"]
            for r, (p, m) in enumerate(zip(pred, meas, strict=True))]


def speedup(result: DemoResult) -> Speedup | None:
    """The winner's predicted and measured speed-up over 1F1B, or None when 1F1B was not
    measured."""
    if not result.baseline_ms or len(result.step_ms) < 2 or result.predicted is None:
        return None
    base = next(c for c in result.compared if c.name == "1f1b").trace.metrics().makespan
    predicted = base / result.predicted.metrics().makespan
    measured = median_of(result.baseline_ms[1:]) / median_of(result.step_ms[1:])
    return Speedup(predicted, measured)


def op_time_ratio(predicted: Trace, measured: Trace) -> float | None:
    """Measured / predicted time of the compute ops both traces ran (summed), or None."""
    rows = [(c * a, c * b) for k, c, a, b in duration_errors(predicted, measured)
            if k in COMPUTE]
    pred = sum(a for a, _ in rows)
    return sum(b for _, b in rows) / pred if pred > 0 else None


def makespan_error(result: DemoResult) -> tuple[float, float] | None:
    """The winner's last step: (predicted, measured) makespan in ms, or None."""
    if result.predicted is None or result.measured is None:
        return None
    pred = result.predicted.metrics().makespan
    meas = result.measured.metrics().makespan
    return (pred, meas) if pred > 0 and meas > 0 else None


def makespan_check(result: DemoResult) -> str:
    """The winner's last step, predicted vs measured makespan; past ``TOLERANCE``, flagged
    with the reason."""
    got = makespan_error(result)
    if got is None:
        return ""
    pred, meas = got
    err = meas / pred - 1.0
    head = (f"The winner's last step took {fmt_ms(meas)} (first op start to last op end) "
            f"against {fmt_ms(pred)} predicted ({err:+.0%}).")
    if abs(err) <= TOLERANCE:
        return head + " The prediction held (within 10%)."
    return head + " Off by more than 10%: " + _why(result) + "."


def _why(result: DemoResult) -> str:
    """Where the difference comes from: the ops' own times, or the time between them (the
    measured step replayed with its ops' measured durations: ``flexpipe.sim.replay``)."""
    if result.predicted is None or result.measured is None:
        return "no measured step to compare"
    ratio = op_time_ratio(result.predicted, result.measured)
    shown = "" if ratio is None else f" ({ratio:.2f}x their profiled time)"
    cost = fit_cost(result.cost, result.predicted.schedule.num_stages)
    got = split(result.predicted, result.measured, cost)
    parts = (f"replayed with the ops' measured durations the step takes {fmt_ms(got.replayed)}: "
             f"the ops' own times account for {fmt_ms(got.op_times)}{shown} and the time "
             f"between them for {fmt_ms(got.between)}")
    if abs(got.op_times) >= abs(got.between):
        return (parts + " (the profile times each pass by itself while the other ranks time "
                "theirs; in the step a pass shares this machine's cores with whatever the "
                "schedule and any other load run beside it)")
    return (parts + " (waiting on the transfers and on the other rank, which the simulator "
            "does not see on a shared CPU)")


def explain(result: DemoResult) -> str:
    """One paragraph: the winner's speed-up over 1F1B, predicted and measured (one ratio), the
    winner's last step predicted vs measured, a flag with the reason when either is off by
    more than 10%, and why a winner is slower than 1F1B."""
    got = speedup(result)
    if got is None:
        return "1F1B was not measured; no measured speed-up. " + makespan_check(result)
    text = (f"Speed-up of the winner over 1F1B (1F1B's step time / the winner's; above 1 is "
            f"faster): predicted {got.predicted:.2f}x, measured {got.measured:.2f}x (median "
            f"step time over the steps after the first, optimizer included).")
    flags = [f"the measured speed-up is {got.error:+.0%} off the predicted one"] \
        if abs(got.error) > TOLERANCE else []
    step = makespan_error(result)
    if step is not None:
        pred, meas = step
        text += (f" The winner's last step took {fmt_ms(meas)} (first op start to last op end) "
                 f"against {fmt_ms(pred)} predicted ({meas / pred - 1:+.0%}).")
        if abs(meas / pred - 1) > TOLERANCE:
            flags.append("the winner's step time is off by more than 10%")
    if flags:
        text += f" Prediction off: {' and '.join(flags)}, because {_why(result)}."
    else:
        text += " The predictions held (within 10%)."
    if got.predicted < 1.0:
        text += (" The winner is predicted slower than 1F1B because the memory limit "
                 f"({result.cfg.mem_fraction:.0%} of 1F1B's peak, {fmt_memory(result.limit)} "
                 "per rank) excludes every schedule that is faster than 1F1B on these costs: "
                 "the fastest one that fits pays for the memory it saves (fewer micro-batches "
                 "in flight, or recompute).")
    return text
