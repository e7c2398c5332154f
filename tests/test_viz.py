"""Pictures and traces: SVG/HTML documents are well-formed and hold one box per op, colours come
from the kind registry (new kinds need no edit), later chunks are told apart, the Pareto helper
finds the frontier, predicted-vs-measured overlays, Chrome trace JSON, ``flexpipe draw``, and a
real headless-Chromium screenshot decoded with a small PNG reader (skipped without Chromium)."""

from __future__ import annotations

import json
import struct
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.ir import Need, Op, OpKind, Placement, Schedule
from flexpipe.ir.kinds import BUILTIN, KindRegistry
from flexpipe.ir.lower import lower
from flexpipe.schedules.registry import build
from flexpipe.sim import Trace, simulate
from flexpipe.viz import chrome, html, palette, svg
from flexpipe.viz.pareto import frontier
from flexpipe.viz.png import find_chromium, screenshot

NS = "{http://www.w3.org/2000/svg}"


def op_boxes(document: str) -> list[ET.Element]:
    """The op boxes of an SVG document: rects carrying a tooltip."""
    root = ET.fromstring(document)
    return [r for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]


@pytest.mark.parametrize("name,v", [("1f1b", None), ("zb-h1", None), ("zb-v", None),
                                    ("interleaved-1f1b", 2), ("1f1b-offload", None)])
def test_svg_has_one_box_per_op(name: str, v: int | None) -> None:
    schedule = lower(build(name, 4, 8, **({"v": v} if v else {})))
    doc = svg.document([simulate(schedule)])
    assert len(op_boxes(doc)) == len(schedule)
    assert svg.document_size(doc)[0] == 1200


def test_comparison_shares_one_axis() -> None:
    traces = [simulate(build(n, 4, 8)) for n in ("1f1b", "zb-h1", "zb-v")]
    doc = svg.document(traces, ["a", "b", "c"])
    assert len(op_boxes(doc)) == sum(len(t.schedule) for t in traces)
    ax = svg.Axis.over(traces, svg.Layout())
    assert ax.t1 == max(t.metrics().makespan for t in traces)
    page = html.page(traces)
    assert page.count("<svg") == 1 and "class=best" in page
    assert "<script" not in page
    assert page.count("http") == page.count("http://www.w3.org/2000/svg")  # offline


def test_new_kind_colour_comes_from_registry() -> None:
    odd = OpKind("PROBE", "a probe op", (Need(("F",)),), (), (("F", 0.5),), color="#123456",
                 glyph="p")
    reg = KindRegistry((*BUILTIN, odd))
    base = build("1f1b", 2, 2)
    ranks = [[*ops, *(Op("PROBE", s, 0) for s in base.placement.rank_stages[r])]
             for r, ops in enumerate(base.ranks)]
    trace = simulate(base.with_ranks(ranks), registry=reg)
    doc = svg.document([trace], registry=reg)
    assert "fill='#123456'" in doc and "PROBE: a probe op" in doc
    assert palette.fill(odd) == "#123456"
    assert palette.base_color("no-such-colour") == palette.FALLBACK


def test_chunks_are_distinguished() -> None:
    trace = simulate(build("interleaved-1f1b", 2, 4, v=2))
    doc = svg.document([trace])
    f_kind = BUILTIN[0]
    assert f"fill='{palette.fill(f_kind, 0, 2)}'" in doc
    assert f"fill='{palette.fill(f_kind, 1, 2)}'" in doc
    assert palette.fill(f_kind, 1, 2) != palette.fill(f_kind, 0, 2)
    assert "stroke-dasharray='3,2'" in doc


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=25))
def test_pareto_frontier(raw: list[tuple[int, int]]) -> None:
    pts = [(float(t), float(m), f"p{i}") for i, (t, m) in enumerate(raw)]
    front = frontier(pts)
    for p in pts:
        dominated = any(q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in pts)
        assert any(q[:2] == p[:2] for q in front) == (not dominated)
    ET.fromstring(svg.pareto(pts))


def test_pareto_rejects_bad_points() -> None:
    with pytest.raises(ConfigError, match="point 1"):
        svg.pareto([(1.0, 2.0, "a"), (float("nan"), 1.0, "b")])
    with pytest.raises(ConfigError, match="expected"):
        svg.pareto([(1.0, "x")])  # type: ignore[list-item]


def _measured(pred: Trace, stretch: float = 1.2) -> Trace:
    st_ = tuple(tuple(t * stretch for t in row) for row in pred.starts)
    en = tuple(tuple(t * stretch + 0.1 for t in row) for row in pred.ends)
    flat = tuple(((0.0, 0.0),) for _ in pred.starts)
    return Trace(pred.schedule, st_, en, (flat, (0.0,) * len(flat)), source="measured")


def test_compare_traces() -> None:
    pred = simulate(lower(build("1f1b", 3, 4)))
    meas = _measured(pred)
    page = html.compare_traces(pred, meas)
    overlay = html.overlay_svg(pred, meas)
    assert len(op_boxes(overlay)) == 2 * len(pred.schedule)
    assert "r2 measured" in overlay and "measured / predicted" in page
    errors = {k: (c, a, b) for k, c, a, b in html.duration_errors(pred, meas)}
    assert errors["F"][0] == 12 and errors["F"][2] == pytest.approx(1.3)
    other = simulate(build("1f1b", 2, 4))
    with pytest.raises(ConfigError, match="ranks"):
        html.compare_traces(pred, other)


def test_chrome_trace_counts_and_units() -> None:
    traces = [simulate(lower(build("1f1b-offload", 3, 4))), simulate(build("zb-h1", 3, 4))]
    data = json.loads(chrome.dumps(traces, us_per_unit=1000.0))
    events = data["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(t.schedule) for t in traces)
    cs = [e for e in events if e["ph"] == "C"]
    want = sum(len({t for t, _ in c}) for tr in traces for c in tr.memory)
    assert len(cs) == want
    assert {e["pid"] for e in xs} == {0, 1, 2, 1000, 1001, 1002}
    first = traces[0]
    op, start, end = first.schedule.ranks[0][1], first.starts[0][1], first.ends[0][1]
    ev = next(e for e in xs if e["pid"] == 0 and e["name"] == str(op))
    assert ev["ts"] == start * 1000 and ev["dur"] == (end - start) * 1000
    assert ev["args"] == {"op": str(op), "kind": op.kind, "stage": op.stage, "mb": op.mb,
                          "chunk": 0}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (0, "compute") in threads and (0, "d2h") in threads and (0, "send") in threads
    with pytest.raises(ConfigError):
        chrome.chrome_trace([])


def test_cli_draw_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for suffix in (".html", ".svg", ".json"):
        out = tmp_path / f"cmp{suffix}"
        assert main(["draw", "1f1b", "zb-h1", "zb-v", "-p", "4", "-m", "8", "-o", str(out)]) == 0
        assert out.stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) == 64 + 96 + 192
    ET.fromstring((tmp_path / "cmp.svg").read_text())
    assert main(["draw", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "x.gif")]) == 2
    assert "suffix" in capsys.readouterr().err
    assert main(["draw", "nope", "-p", "2", "-m", "2", "-o", str(tmp_path / "x.svg")]) == 2


def test_png_without_chromium_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("FLEXPIPE_CHROMIUM", str(tmp_path / "no-such-browser"))
    assert find_chromium() is None
    with pytest.raises(ConfigError, match="Chromium"):
        screenshot("<p>x</p>", tmp_path / "x.png", 100, 100)


# --- a tiny PNG reader (8-bit RGB/RGBA, non-interlaced: what Chromium writes) -------------------

def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def _unfilter(kind: int, line: bytearray, prev: bytes | bytearray, bpp: int) -> bytearray:
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        c = prev[i - bpp] if i >= bpp else 0
        pred = (0, a, prev[i], (a + prev[i]) // 2, _paeth(a, prev[i], c))[kind]
        line[i] = (line[i] + pred) & 0xFF
    return line


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of raw pixel bytes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        head = body if tag == b"IHDR" else head
        idat += body if tag == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", head)
    assert depth == 8 and color in (2, 6) and interlace == 0
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        prev = bytes(line) if kind == 0 else bytes(_unfilter(kind, line, prev, bpp))
        rows.append(prev)
    return width, height, rows


def colours(width: int, rows: list[bytes]) -> set[bytes]:
    """Distinct RGB colours of decoded PNG rows."""
    bpp = len(rows[0]) // width
    return {r[i:i + 3] for r in rows for i in range(0, len(r), bpp)}


needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="Chromium/Chrome not installed (make setup installs it)")


@needs_chromium
def test_chromium_renders_html_page(tmp_path: Path) -> None:
    traces = [simulate(build(n, 4, 8)) for n in ("1f1b", "zb-v")]
    page = html.page(traces, layout=svg.Layout(width=900))
    out = screenshot(page, tmp_path / "page.png", 900, 700)
    width, height, rows = read_png(out)
    assert (width, height) == (900, 700)
    seen = colours(width, rows)
    assert len(seen) > 50, f"only {len(seen)} colours: blank page?"
    want = {bytes(palette.hex_rgb(palette.fill(BUILTIN[0])))}
    assert want <= seen, "the forward-pass colour is missing"


@needs_chromium
def test_cli_draw_png(tmp_path: Path) -> None:
    out = tmp_path / "v.png"
    assert main(["draw", "zb-v", "-p", "2", "-m", "4", "--width", "600", "-o", str(out)]) == 0
    width, height, rows = read_png(out)
    doc = svg.document([simulate(build("zb-v", 2, 4))], layout=svg.Layout(width=600))
    assert (width, height) == svg.document_size(doc)
    assert len(colours(width, rows)) > 20


def test_placement_only_schedule_draws() -> None:
    empty = Schedule.build([[], []], Placement.linear(2), 1)
    trace = simulate(empty)
    assert op_boxes(svg.document([trace])) == []


# --- no text clipped or overlapping, at long schedule names (real Chromium layout) ------------

LONG = ("my-team's-hand-tuned-zero-bubble-variant-with-a-rather-long-descriptive-name-that-"
        "goes-on-well-past-the-width-of-the-default-picture-and-then-some-more")
MEASURE = """<script>
const bad = [];
const page = document.documentElement;
if (page.scrollWidth > window.innerWidth + 1) bad.push('page scrolls sideways');
for (const svg of document.querySelectorAll('svg')) {
  const box = svg.getBoundingClientRect();
  const holder = svg.parentElement.getBoundingClientRect();
  const scrolls = ['auto', 'scroll'].includes(getComputedStyle(svg.parentElement).overflowX);
  if (box.right > holder.right + 0.5 && !scrolls) bad.push('cut: a chart wider than its box');
  const texts = [...svg.querySelectorAll('text')].map(t => [t.textContent, t.getBBox(),
                                                             t.getBoundingClientRect()]);
  for (const [s, , r] of texts) {
    if (r.width === 0) continue;
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 ||
        r.bottom > box.bottom + 0.5) bad.push('clipped: ' + s);
  }
  for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
    const a = texts[i][2], b = texts[j][2];
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (w > 1 && h > 3) bad.push('overlap: ' + texts[i][0] + ' | ' + texts[j][0]);
  }
}
const pre = document.createElement('pre');
pre.id = 'flexpipe-check';
pre.textContent = JSON.stringify(bad);
document.body.appendChild(pre);
</script>"""


WIDTHS = (800, 1400)
"""Window widths the pages must fit: charts scale down or scroll inside their own box."""
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")


def text_problems(page: str, tmp_path: Path, width: int = 1400, shot: bool = False
                  ) -> list[str]:
    """What Chromium lays out wrong in a ``width``-px window: a text of an SVG outside its SVG
    (clipped) or on top of another text, a chart wider than its box where the box does not
    scroll, a page that scrolls sideways. With ``shot``, the page is also screenshotted at that
    width, as a user would see it (one more Chromium run)."""
    import re
    import subprocess

    browser = find_chromium()
    assert browser is not None
    if shot:
        png = screenshot(page, tmp_path / f"shot-{width}.png", width, 1000)
        assert read_png(png)[0] == width
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    done = subprocess.run([browser, *FLAGS, f"--window-size={width},1000",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                           probe.as_uri()], capture_output=True, text=True, timeout=120,
                          check=False)
    found = re.search(r"<pre id=\"flexpipe-check\">(.*?)</pre>", done.stdout, re.S)
    assert found, f"no measurement in Chromium's DOM: {done.stderr[-500:]}"
    return list(json.loads(html_unescape(found.group(1))))


def html_unescape(text: str) -> str:
    import html as std_html

    return std_html.unescape(text)


def named(schedule: Schedule, name: str) -> Schedule:
    """``schedule`` under another name (through its text form)."""
    from flexpipe.ir import parse_schedule

    lines = [f"name: {name}" if x.startswith("name:") else x
             for x in schedule.to_text().splitlines()]
    return parse_schedule("\n".join(lines))


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("names", [("zb-v", "interleaved-1f1b"), ("1f1b",)])
def test_draw_has_no_clipped_text_at_long_names(tmp_path: Path, names: tuple[str, ...],
                                                width: int) -> None:
    params = {"interleaved-1f1b": {"v": 2}}
    traces = [simulate(named(build(n, 4, 8, **params.get(n, {})), f"{LONG}-{n}"))
              for n in names]
    page = html.page(traces)
    assert text_problems(page, tmp_path, width) == []


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_draw_page_fits_the_window(tmp_path: Path, width: int) -> None:
    """``flexpipe draw``'s page at its default 1200 px charts, in an 800 and a 1400 px window."""
    out = tmp_path / "cmp.html"
    assert main(["draw", "1f1b", "zb-h1", "zb-v", "-p", "4", "-m", "8", "-o", str(out)]) == 0
    assert text_problems(out.read_text(encoding="utf-8"), tmp_path, width, shot=True) == []


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_demo_report_has_no_clipped_text_at_long_names(tmp_path: Path, width: int) -> None:
    from dataclasses import replace

    from flexpipe.cost.model import CostModel
    from flexpipe.demo.job import Compared, DemoConfig, DemoResult
    from flexpipe.demo.report import write_report
    from flexpipe.search import search

    cost = CostModel.uniform(2, 2, f=1.5, b=1.6, w=0.9, act=2.5e8, wact=1.2e8)
    found = search(cost, 2, 4, 4 * 2.5e8)
    found.trials = [replace(t, label=f"{t.label}-{LONG}") for t in found.trials]
    compared = [Compared(n, simulate(build(n.split(" ")[0], 2, 4), cost), True)
                for n in ("1f1b", f"zb-h1 {LONG}")]
    predicted = compared[1].trace
    measured = Trace(predicted.schedule, predicted.starts, predicted.ends,
                     (tuple(((0.0, 0.0),) for _ in range(2)), (0.0, 0.0)), source="measured")
    result = DemoResult(DemoConfig(), cost, 4 * 2.5e8, found, compared, [5.5, 5.2, 4.9],
                        [10.0, 9.0, 9.5], predicted, measured)
    page = write_report(result, tmp_path / "report.html").read_text(encoding="utf-8")
    figures = page
    for t in found.trials:  # the search's own labels may spell a limit as 1e+08
        figures = figures.replace(palette.esc(t.label), "")
    assert "not measured" in page and "MiB" in page and "e+0" not in figures
    assert text_problems(page, tmp_path, width) == []


# --- units, tiny cells, the frontier --------------------------------------------------------

def test_axis_and_summary_name_the_time_unit() -> None:
    from flexpipe.viz.units import MS

    trace = simulate(build("1f1b", 2, 4))
    unit = svg.document([trace])
    assert "time (unit cost: F = B = W = 1 per rank)" in unit and "(ms)" not in unit
    assert "makespan 15 units" in unit and "peak activation 2 M_B" in unit
    timed = svg.document([trace], units=MS)
    assert "time (ms)" in timed and "makespan 15 ms" in timed and "unit cost" not in timed
    page = html.page([trace])
    assert "span (units)" in page and "Bubble rate: the zero-bubble paper&#x27;s" in page


def test_cli_draw_of_a_unit_cost_run_has_no_ms(tmp_path: Path) -> None:
    out = tmp_path / "u.svg"
    assert main(["draw", "zb-h1", "-p", "2", "-m", "4", "-o", str(out)]) == 0
    assert "(ms)" not in out.read_text() and "unit cost" in out.read_text()


@pytest.mark.parametrize("width, labelled", [(1.0, False), (5.0, False), (7.9, False),
                                             (12.0, True)])
def test_tiny_cells_carry_no_label(width: float, labelled: bool) -> None:
    box = "".join(svg._op_box(10.0, 10.0 + width, 0.0, 18.0, "#3f7fd0", False, "3", "tip"))
    assert ("<text" in box) == labelled


def test_frontier_draws_the_limit_and_rings_the_winner() -> None:
    pts = [(100.0 + 10 * i, 9.0 - i, f"candidate-with-a-long-name-{i}") for i in range(6)]
    doc = svg.pareto(pts, limit=5.5, best=pts[-1][2])
    root = ET.fromstring(doc)
    texts = {t.text or "" for t in root.iter(f"{NS}text")}
    assert "memory limit 5.5 M_B" in texts and f"winner: {pts[-1][2]}" in texts
    plot = next(r for r in root.iter(f"{NS}rect") if r.get("fill") == "#fafbfc")
    left, width = float(plot.get("x", 0)), float(plot.get("width", 0))
    for t in root.iter(f"{NS}text"):
        if (t.text or "").startswith("candidate") or (t.text or "").startswith("winner"):
            x, size = float(t.get("x", 0)), float(t.get("font-size", 10))
            w = palette.text_width(t.text or "", size)
            lo = x - w if t.get("text-anchor") == "end" else x
            assert left <= lo and lo + w <= left + width, f"label out of the plot: {t.text}"


def test_terminal_and_pictures_share_one_chunk_table() -> None:
    from flexpipe.viz import terminal

    sched = build("zb-v", 2, 4)
    assert not hasattr(terminal, "_chunks")
    cells = terminal.rank_cells(simulate(sched), 0, 200, color=False)
    lower = {c.label[0] for c in cells if c.label[0].islower()}
    assert lower, "odd chunks are lower-case (palette.chunk_of)"
