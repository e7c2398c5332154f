"""What the demo's numbers say: the winner's activation peak per rank, predicted vs measured,
and its measured speed-up over 1F1B with the reason when it is not faster."""

from __future__ import annotations

from statistics import median as median_of

from flexpipe.demo.job import DemoResult
from flexpipe.viz.units import fmt_memory


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


def speedup(result: DemoResult) -> tuple[float, float] | None:
    """(predicted, measured) speed-up of the winner over 1F1B (step time ratio), or None."""
    if not result.baseline_ms or len(result.step_ms) < 2 or result.predicted is None:
        return None
    base = next(c for c in result.compared if c.name == "1f1b").trace.metrics().makespan
    predicted = base / result.predicted.metrics().makespan
    measured = median_of(result.baseline_ms[1:]) / median_of(result.step_ms[1:])
    return predicted, measured


def explain(result: DemoResult) -> str:
    """One paragraph: the measured speed-up and, when the winner is slower, why."""
    got = speedup(result)
    if got is None:
        return "1F1B was not measured; no measured speed-up."
    predicted, measured = got
    name = result.found.best.name if result.found.best else "the winner"
    text = (f"Measured: {name} runs a step in {1 / measured:.2f}x the time of 1F1B "
            f"(median step time over the steps after the first, optimizer included; "
            f"{measured:.2f}x speed-up, predicted {predicted:.2f}x).")
    if measured >= 1.0:
        return text
    if predicted < 1.0:
        return text + (" It is slower because the memory limit "
                       f"({result.cfg.mem_fraction:.0%} of 1F1B's peak) excludes every "
                       "schedule that is faster than 1F1B on these costs: the fastest one "
                       "that fits pays for the memory it saves (recompute, or fewer "
                       "micro-batches in flight).")
    return text + (" The prediction said faster: the difference is the prediction error on "
                   "this machine (a shared CPU, where the ranks' compute contends for cores "
                   "and gloo transfers are not overlapped as on a GPU).")
