"""The demo's HTML report: the comparison table, the compared schedules on one time axis, the
search's time/memory frontier, the winner's predicted vs measured timeline and the loss curve.
Self-contained (inline SVG, no script, no network)."""

from __future__ import annotations

from pathlib import Path

from flexpipe.demo.job import DemoResult, winner_name
from flexpipe.demo.story import readable, story
from flexpipe.demo.verdict import explain, makespan_check, memory_rows
from flexpipe.viz.html import chart, html_document, html_table, overlay_svg
from flexpipe.viz.palette import esc, num
from flexpipe.viz.pareto import pareto
from flexpipe.viz.svg import Layout, document
from flexpipe.viz.units import MS, bubble_note, equal_work, fmt_memory, fmt_time

REPORT = Layout(width=960)
"""The report's timelines: 960 px (wider only when a label needs it), so that they fit an
800 px window at 80% of their size."""


def comparison_rows(result: DemoResult) -> tuple[list[list[object]], int]:
    """Per compared schedule: readable name (the search's winner, last, as ``found: ...``),
    makespan (ms), bubble rate, peak, fits, speed-up over 1F1B (1F1B's makespan / the
    schedule's); and the index of the winner."""
    base = next(c for c in result.compared if c.name == "1f1b").trace.metrics().makespan
    rows: list[list[object]] = []
    for i, c in enumerate(result.compared):
        m = c.trace.metrics()
        found = "found: " if i == len(result.compared) - 1 else ""
        rows.append([found + readable(c.name), num(m.makespan), f"{m.bubble_rate:.4f}",
                     fmt_memory(max(m.peak_activation)), "yes" if c.fits else "no",
                     f"{base / m.makespan:.2f}x"])
    return rows, len(rows) - 1


def loss_svg(losses: list[float], width: int = 640, height: int = 260) -> str:
    """A line chart of the training loss per step."""
    if not losses:
        return "<p class=note>no losses recorded</p>"
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0
    x0, y0, w, h = 60.0, 20.0, width - 80.0, height - 60.0
    pts = " ".join(f"{x0 + w * i / max(1, len(losses) - 1):.1f},"
                   f"{y0 + h * (1 - (v - lo) / span):.1f}" for i, v in enumerate(losses))
    labels = [f"<text x='{x0 - 6}' y='{y0 + h * (1 - f) + 4:.1f}' font-size='11' "
              f"text-anchor='end'>{lo + f * span:.3f}</text>" for f in (0.0, 0.5, 1.0)]
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' font-family='DejaVu Sans, Arial, sans-serif'>"
            f"<rect x='{x0}' y='{y0}' width='{w}' height='{h}' fill='#fafbfc' stroke='#ccd'/>"
            f"<polyline points='{pts}' fill='none' stroke='#1f77b4' stroke-width='2'/>"
            + "".join(labels)
            + f"<text x='{x0 + w / 2}' y='{height - 12}' font-size='12' text-anchor='middle'>"
            f"step (1..{len(losses)}); loss: cross-entropy, nats per token</text></svg>")


def _summary(result: DemoResult) -> str:
    """The run in one note: limit, search effort and bound, the time of each step."""
    cfg, found = result.cfg, result.found
    return (f"<p class=note>Memory limit {fmt_memory(result.limit)} of activations per rank "
            f"({cfg.mem_fraction:.0%} of 1F1B's peak). Search: {len(found.trials)} candidates "
            f"in {found.seconds:.1f} s, lower bound {fmt_time(found.lower_bound, MS)}, gap "
            f"{(found.gap or 0.0):.1%}. Timings: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()) + ". Units: "
            "times in ms (profiled on this machine); speed-up = 1F1B's time / the schedule's "
            "(above 1 is faster); bubble rate: " + esc(_bubble(result)) + ".</p>")


def _story(result: DemoResult) -> str:
    """The verdict first (``flexpipe.demo.story``): asked, found, memory, speed, why."""
    rows = "".join(f"<tr><th>{esc(label)}</th><td>{esc(text)}</td></tr>"
                   for label, text in story(result))
    return f"<table class=story>{rows}</table>"


def _bubble(result: DemoResult) -> str:
    """Which bubble rate the table shows: the paper's only when every rank of every compared
    schedule does the same work."""
    return bubble_note(all(equal_work(c.trace.metrics().useful) for c in result.compared))


def _frontier(result: DemoResult) -> str:
    """The search's frontier with the memory limit that decided the winner."""
    found = result.found
    points = [(t.span or 0.0, t.peak or 0.0, t.label) for t in found.frontier]
    best = found.best_trial.label if found.best_trial is not None else ""
    return chart(pareto(points, title="candidates on the frontier",
                        xlabel="largest rank span (ms)", ylabel="peak activation",
                        limit=result.limit, best=best))


def _winner(result: DemoResult) -> list[str]:
    """The winner's predicted vs measured timeline and activation peaks."""
    body: list[str] = []
    if result.predicted is not None and result.measured is not None:
        body += ["<h2>Winner: predicted vs measured (last training step)</h2>",
                 f"<p class=note>{esc(makespan_check(result))}</p>",
                 chart(overlay_svg(result.predicted, result.measured, REPORT))]
    mem = memory_rows(result)
    if mem:
        body += ["<h2>Winner: activation peak per rank, predicted vs measured</h2>",
                 html_table(["rank", "predicted", "measured", "predicted vs measured"], mem),
                 "<p class=note>measured: the live tensors a rank holds for its backward "
                 "passes (saved activations, outputs kept for B, the inputs and output "
                 "gradients B keeps for W) after every op of the last step; predicted: the "
                 "simulator with the profiled M_B and M_W.</p>"]
    return body


def write_report(result: DemoResult, path: str | Path) -> Path:
    """Write the report; returns its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg, found = result.cfg, result.found
    rows, best = comparison_rows(result)
    body = [
        "<h1>FlexPipe demo: built-in GPT on "
        f"{cfg.ranks} ranks, {cfg.microbatches} micro-batches</h1>",
        _story(result),
        _summary(result),
        "<h2>Schedules with the profiled costs</h2>",
        html_table(["schedule", "makespan (ms)", "bubble rate", "peak activation", "fits",
                    "speed-up vs 1F1B"], rows, best),
        "<h2>Timelines on one time axis</h2>",
        chart(document([c.trace for c in result.compared], [c.name for c in result.compared],
                       REPORT, units=MS)),
        "<h2>Search: time vs memory</h2>",
        _frontier(result),
        *_winner(result),
        "<h2>Measured speed-up over 1F1B</h2>", f"<p>{esc(explain(result))}</p>",
        f"<h2>Training loss ({len(result.losses)} steps)</h2>",
        chart(loss_svg(result.losses)) if result.losses else loss_svg(result.losses),
        f"<p class=note>first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}</p>"
        if result.losses else "",
    ]
    title = "FlexPipe demo: " + (winner_name(found.best) if found.best else "no winner")
    out.write_text(html_document(title, body), encoding="utf-8")
    return out
