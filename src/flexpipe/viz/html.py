"""Self-contained HTML pages of Traces: the SVG timeline(s) inline, metrics as tables, no script
and no external resource (a page opens offline in any browser).

``page`` draws one schedule or compares several on one time axis; ``compare_traces`` overlays a
predicted and a measured Trace of the same schedule (paired lanes per rank, memory curves on one
scale, metrics and per-kind duration error side by side); ``svg_page`` wraps a bare SVG for a
pixel-exact screenshot.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.sim.trace import Metrics, Trace
from flexpipe.viz.palette import esc, num
from flexpipe.viz.svg import (
    PAD,
    Axis,
    Lane,
    Layout,
    document,
    document_size,
    fit,
    lanes,
    legend,
    memory_curve,
    memory_peak,
    memory_rows,
    memory_title,
    peak_label,
    summary_line,
    svg_root,
    text,
    time_axis,
    time_label,
    time_suffix,
)
from flexpipe.viz.units import (
    MS,
    UNIT_COST,
    Units,
    bubble_note,
    equal_work,
    fmt_memory,
    memory_note,
)

CSS = """
body { font-family: 'DejaVu Sans', Arial, Helvetica, sans-serif; margin: 16px; color: #222; }
h1, h2, p { overflow-wrap: anywhere; }
.chart, .wide { max-width: 100%; overflow-x: auto; margin: 8px 0; }
.chart svg { display: block; max-width: 100%; height: auto; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 24px; }
table { border-collapse: collapse; margin: 8px 0 16px 0; font-size: 13px; }
th, td { border: 1px solid #ccd; padding: 3px 9px; text-align: right; }
th { background: #eef1f5; } td.name, th.name { text-align: left; }
tr.best td { background: #e9f7ea; font-weight: bold; }
.note { color: #555; font-size: 12px; }
table.story { font-size: 14px; } table.story th, table.story td { text-align: left; border: 0; }
table.story th { background: none; padding-left: 0; vertical-align: top; }
""".strip()
PREDICTED = "#d9534f"
MIN_SCALE = 0.75
"""A chart shrinks with the window down to this fraction of its size (text 11 px -> 8 px);
below that it keeps this size and scrolls sideways inside its own box."""


def chart(svg: str) -> str:
    """``svg`` in its own box: scaled down to the page's width (never up), and scrolling
    sideways inside the box when the window is so narrow that its text would shrink below
    ``MIN_SCALE``; the page itself never scrolls sideways."""
    width = document_size(svg)[0]
    sized = svg.replace("<svg ", f"<svg style='min-width:{MIN_SCALE * width:.0f}px' ", 1)
    return f"<div class=chart>{sized}</div>"


def html_document(title: str, body: Sequence[str]) -> str:
    """A complete self-contained page: the shared style and the given body fragments."""
    return ("<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
            f"<title>{esc(title)}</title>\n<style>\n{CSS}\n</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def html_table(head: Sequence[str], rows: Sequence[Sequence[object]],
               best: int | None = None) -> str:
    """An HTML table; the first column is a name, row ``best`` is highlighted."""
    cells = "".join(f"<th{' class=name' if i == 0 else ''}>{esc(h)}</th>"
                    for i, h in enumerate(head))
    out = [f"<table><tr>{cells}</tr>"]
    for k, row in enumerate(rows):
        tds = "".join(f"<td{' class=name' if i == 0 else ''}>{esc(v)}</td>"
                      for i, v in enumerate(row))
        out.append(f"<tr{' class=best' if k == best else ''}>{tds}</tr>")
    return "<div class=wide>" + "\n".join(out) + "</table></div>"


def rank_table(metrics: Metrics, unit: str = UNIT_COST.time) -> str:
    """Per-rank span, busy time (in ``unit``), idle share, peak activation and peak memory."""
    cost = max(metrics.span, default=0.0)
    rows = []
    for r, span in enumerate(metrics.span):
        idle = 100.0 * (1 - metrics.useful[r] / cost) if cost > 0 else 0.0
        rows.append((f"rank {r}", num(span), num(metrics.busy[r]), f"{idle:.1f}",
                     fmt_memory(metrics.peak_activation[r]), fmt_memory(metrics.peak_memory[r])))
    return html_table(("rank", f"span ({unit})", f"busy ({unit})", "idle %", "peak activation",
                       "peak memory"), rows)


def summary_table(traces: Sequence[Trace], titles: Sequence[str],
                  registry: KindRegistry = KINDS, units: Units | None = None) -> str:
    """One row per trace; the fastest is highlighted."""
    rows, spans = [], []
    for title, trace in zip(titles, traces, strict=True):
        m = trace.metrics(registry)
        spans.append(m.makespan)
        rows.append((title, len(trace.schedule), num(m.makespan), f"{100 * m.bubble_rate:.2f}",
                     fmt_memory(max(m.peak_activation, default=0.0)),
                     fmt_memory(max(m.peak_memory, default=0.0)), trace.source))
    best = spans.index(min(spans)) if spans else None
    unit = time_suffix(traces[0], units) if traces else ""
    head = ("schedule", "ops", f"makespan ({unit})", "bubble %", "peak activation",
            "peak memory", "source")
    return html_table(head, rows, best)


def _titles(traces: Sequence[Trace], titles: Sequence[str] | None) -> list[str]:
    if titles is not None and len(titles) != len(traces):
        raise ConfigError(f"{len(titles)} titles for {len(traces)} traces")
    return list(titles) if titles else [t.schedule.name or f"schedule {i + 1}"
                                        for i, t in enumerate(traces)]


def page(traces: Sequence[Trace], titles: Sequence[str] | None = None, title: str = "",
         layout: Layout | None = None, registry: KindRegistry = KINDS,
         units: Units | None = None) -> str:
    """An HTML page with the traces on one time axis, their memory and their metrics; the
    simulated traces' times are in ``units`` (default: unit costs)."""
    if not traces:
        raise ConfigError("nothing to draw: no traces given")
    names = _titles(traces, titles)
    heading = title or ("FlexPipe: " + " vs ".join(names))
    body = [f"<h1>{esc(heading)}</h1>", f"<p class=note>{esc(units_note(traces, units))}</p>"]
    if len(traces) > 1:
        body += ["<p class=note>Compared on one time axis and one memory scale.</p>",
                 summary_table(traces, names, registry, units)]
    body.append(chart(document(traces, names, layout, registry, units)))
    for name, trace in zip(names, traces, strict=True):
        line = summary_line(trace, registry, units)
        body += [f"<h2>{esc(name)}</h2>", f"<p class=note>{esc(line)}</p>",
                 rank_table(trace.metrics(registry), time_suffix(trace, units))]
    return html_document(heading, body)


def units_note(traces: Sequence[Trace], units: Units | None = None) -> str:
    """What the page's figures are in, and which bubble rate it shows."""
    measured = all(t.source == "measured" for t in traces)
    time = MS.note if measured else (units or UNIT_COST).note
    peak = max((v for t in traces for c in t.memory for _, v in c), default=0.0)
    even = all(equal_work(t.metrics().useful) for t in traces)
    return f"Units: {time}; {memory_note(peak)}. Bubble rate: {bubble_note(even)}."


def svg_page(svg: str) -> str:
    """A bare page holding only ``svg`` at the top left, for a screenshot of exactly its size."""
    style = "html, body { margin: 0; padding: 0; overflow: hidden; background: #fff; }"
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><style>{style}</style></head>"
            f"<body>{svg}</body></html>\n")


# --- predicted vs measured --------------------------------------------------------------------

def _check_pair(predicted: Trace, measured: Trace) -> None:
    n, k = predicted.schedule.num_ranks, measured.schedule.num_ranks
    if n != k:
        raise ConfigError(f"cannot overlay: the predicted trace has {n} ranks, the measured "
                          f"trace {k}")


def overlay_svg(predicted: Trace, measured: Trace, layout: Layout | None = None,
                registry: KindRegistry = KINDS) -> str:
    """Paired lanes per rank (predicted above measured) on one time axis, then each rank's
    memory: measured filled, predicted as a dashed red line."""
    _check_pair(predicted, measured)
    pair = [predicted, measured]
    n = predicted.schedule.num_ranks
    mem = [(f"mem {r}", [memory_curve(measured, r, name=f"rank {r} measured"),
                         memory_curve(predicted, r, color=PREDICTED, filled=False,
                                      name=f"rank {r} predicted")]) for r in range(n)]
    vmax = memory_peak(pair)
    heads = ["predicted vs measured: " + (predicted.schedule.name or "schedule"),
             "predicted: " + summary_line(predicted, registry, MS),
             "measured: " + summary_line(measured, registry, MS),
             memory_title(vmax, "memory per rank: measured filled, predicted dashed red")]
    peaks = [peak_label([None if c.missing else max((v for _, v in c.points), default=0.0)
                         for c in curves]) for _, curves in mem]
    layout = fit(layout or Layout(), zip(heads, (14, 11, 11, 10), strict=True), peaks,
                 [f"r{n - 1} predicted"])
    ax = Axis.over(pair, layout)
    x = PAD
    body = [text(x, 25, heads[0], 14, weight="bold"), text(x, 42, heads[1], 11, color="#444"),
            text(x, 58, heads[2], 11, color="#444")]
    rows = [Lane(f"r{r} {tag}", tr, r) for r in range(predicted.schedule.num_ranks)
            for tag, tr in (("predicted", predicted), ("measured", measured))]
    elems, h = lanes(rows, 70, ax, layout, registry)
    y = 70 + h + 2
    axis_elems, dh = time_axis(y, ax, time_label(pair, MS))
    y += dh + 6
    body += elems + axis_elems
    body.append(text(x, y + 10, heads[3], 10, color="#555"))
    elems, dh = memory_rows(mem, y + 16, ax, layout, vmax)
    y += 16 + dh + 14
    leg, dh = legend(pair, y, layout, registry)
    return svg_root(layout.width, y + dh, body + elems + leg)


def duration_errors(predicted: Trace, measured: Trace) -> list[tuple[str, int, float, float]]:
    """Per op kind over the ops both traces ran on the same rank: (kind, count, mean predicted
    duration, mean measured duration)."""
    _check_pair(predicted, measured)
    pred = {(r.rank, r.op): r.end - r.start for r in predicted.records()}
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for rec in measured.records():
        p = pred.get((rec.rank, rec.op))
        if p is not None:
            acc = sums[rec.op.kind]
            acc[0] += 1
            acc[1] += p
            acc[2] += rec.end - rec.start
    return [(k, int(c), a / c, b / c) for k, (c, a, b) in sorted(sums.items())]


def _metric_rows(predicted: Metrics, measured: Metrics) -> list[tuple[str, str, str, str]]:
    def row(name: str, a: float, b: float) -> tuple[str, str, str, str]:
        err = f"{100 * (b - a) / a:+.1f}" if a else "-"
        return name, num(a), num(b), err

    out = [row("makespan (ms)", predicted.makespan, measured.makespan),
           row("bubble rate", predicted.bubble_rate, measured.bubble_rate)]
    out += [row(f"rank {r} span (ms)", a, b)
            for r, (a, b) in enumerate(zip(predicted.span, measured.span, strict=False))]
    return out


def compare_traces(predicted: Trace, measured: Trace, title: str = "",
                   layout: Layout | None = None, registry: KindRegistry = KINDS) -> str:
    """An HTML page overlaying a predicted and a measured Trace of the same schedule. Times of
    the two traces must be in the same unit (the runtime's measured traces are in ms)."""
    _check_pair(predicted, measured)
    name = predicted.schedule.name or measured.schedule.name or "schedule"
    heading = title or f"FlexPipe: {name}, predicted vs measured"
    errors = [(k, c, num(a), num(b), f"{b / a:.3f}" if a else "-")
              for k, c, a, b in duration_errors(predicted, measured)]
    body = [f"<h1>{esc(heading)}</h1>",
            chart(overlay_svg(predicted, measured, layout, registry)),
            "<h2>metrics</h2>",
            html_table(("metric", "predicted", "measured", "error %"),
                   _metric_rows(predicted.metrics(registry), measured.metrics(registry))),
            "<h2>op durations (ops both traces ran)</h2>",
            html_table(("kind", "ops", "mean predicted (ms)", "mean measured (ms)",
                        "measured / predicted"),
                   errors)]
    return html_document(heading, body)
