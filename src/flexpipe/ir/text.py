"""The schedule text format. Round-trip exact; parse errors name line, column and token.

    flexpipe-schedule v1
    name: 1f1b
    ranks: 2 stages: 2 microbatches: 2
    placement: 0 1
    edges: 0>1            (optional; omitted means the chain 0>1>...>n-1)
    gangs: 0,1 2,3:F,B    (optional; stages whose ops start together, see StageGraph;
                           ":F,B" makes only those kinds collective)
    rank 0: 0F0 0F1 0BW0 0BW1
    rank 1: 1F0 1BW0 1F1 1BW1

Tokens are ``{stage}{KIND}{mb}``, or two joined by ``&`` for an overlapped pair run in one
slot (``2F5&5BW1``, ``flexpipe.ir.overlap``); blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import TypeVar

from flexpipe.errors import ConfigError, ParseError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import heads, slots
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

MAGIC = "flexpipe-schedule v1"
TOKEN = re.compile(r"([0-9]+)([A-Z][A-Z_]*)([0-9]+)\Z")
MAX_INT = 10**9
DIGITS = 9
"""The most digits a number of a schedule text has (its ranks, counts, indices)."""
LARGEST = 10**DIGITS - 1
T = TypeVar("T")


def format_schedule(schedule: Schedule) -> str:
    """Print ``schedule`` in the text format."""
    lines = [MAGIC]
    if schedule.name:
        lines.append(f"name: {schedule.name}")
    lines.append(f"ranks: {schedule.num_ranks} stages: {schedule.num_stages} "
                 f"microbatches: {schedule.microbatches}")
    lines.append("placement: " + " ".join(str(r) for r in schedule.placement.stage_rank))
    graph = schedule.graph
    if not graph.chain_edges:
        lines.append("edges: " + " ".join(f"{a}>{b}" for a, b in graph.edges))
    if graph.gangs:
        kinds = graph.gang_kinds or ((),) * len(graph.gangs)
        lines.append("gangs: " + " ".join(",".join(map(str, g)) + (":" + ",".join(ks) if ks
                                                                   else "")
                                          for g, ks in zip(graph.gangs, kinds, strict=True)))
    pairs = heads(schedule.overlaps)
    for r, ops in enumerate(schedule.ranks):
        tokens = ["&".join(map(str, slot)) for slot in slots(ops, pairs)]
        lines.append(f"rank {r}: " + " ".join(tokens))
    return "\n".join(lines) + "\n"


def parse_op(token: str, registry: KindRegistry = KINDS, line: int = 0, column: int = 0) -> Op:
    """Parse one ``{stage}{KIND}{mb}`` token."""
    m = TOKEN.match(token)
    if not m:
        raise ParseError("expected an op such as 3F1 ({stage}{KIND}{microbatch})", line, column,
                         token)
    if len(m.group(1)) > 10 or len(m.group(3)) > 10:  # before int(): no huge conversions
        raise ParseError("stage or micro-batch index is too large", line, column, token[:40])
    stage, name, mb = int(m.group(1)), m.group(2), int(m.group(3))
    if name not in registry:
        raise ParseError(f"unknown op kind {name!r}", line, column, token)
    if stage > MAX_INT or mb > MAX_INT:
        raise ParseError("stage or micro-batch index is too large", line, column, token)
    return Op(name, stage, mb)


class _Reader:
    """Line-by-line parser state."""

    def __init__(self, text: str, registry: KindRegistry) -> None:
        self.registry = registry
        self.lines = [(i + 1, ln.rstrip("\r")) for i, ln in enumerate(text.split("\n"))
                      if ln.strip() and not ln.lstrip().startswith("#")]
        self.pos = 0

    def next(self, what: str) -> tuple[int, str]:
        if self.pos >= len(self.lines):
            last = self.lines[-1][0] if self.lines else 1
            raise ParseError(f"unexpected end of text, expected {what}", last, 1)
        item = self.lines[self.pos]
        self.pos += 1
        return item

    def peek_key(self) -> str:
        if self.pos >= len(self.lines):
            return ""
        return self.lines[self.pos][1].split(":", 1)[0].strip()


def _field(line_no: int, line: str, key: str) -> str:
    head, sep, rest = line.partition(":")
    if not sep or head.strip() != key:
        raise ParseError(f"expected '{key}: ...'", line_no, 1, line.strip()[:40])
    return rest


def _ints(line_no: int, line: str, rest: str) -> list[tuple[int, int]]:
    """(value, column) for each integer token of ``rest``."""
    out = []
    offset = len(line) - len(rest)
    for m in re.finditer(r"\S+", rest):
        tok = m.group(0)
        if not (tok.isascii() and tok.isdigit()):
            col = offset + m.start() + 1
            raise ParseError("expected a non-negative integer", line_no, col, tok)
        if len(tok) > DIGITS:
            raise ParseError(f"a number must be at most {LARGEST}", line_no,
                             offset + m.start() + 1, _cut(tok))
        out.append((int(tok), offset + m.start() + 1))
    return out


def _cut(token: str, shown: int = 16) -> str:
    """A long token as its start and its length, for an error message."""
    return token if len(token) <= shown else f"{token[:shown]}... ({len(token)} digits)"


def _counts(line_no: int, line: str) -> tuple[int, int, int]:
    toks = line.split()
    keys = ["ranks:", "stages:", "microbatches:"]
    if len(toks) != 6 or toks[0::2] != keys:
        raise ParseError("expected 'ranks: R stages: S microbatches: M'", line_no, 1,
                         line.strip()[:40])
    vals = toks[1::2]
    for v in vals:
        if v.isascii() and v.isdigit() and len(v) > DIGITS:
            raise ParseError(f"a count must be at most {LARGEST}", line_no, line.find(v) + 1,
                             _cut(v))
        if not (v.isascii() and v.isdigit()) or int(v) < 1:
            raise ParseError("counts must be positive integers", line_no, line.find(v) + 1, v)
    return int(vals[0]), int(vals[1]), int(vals[2])


def _edges(line_no: int, line: str, rest: str) -> tuple[tuple[int, int], ...]:
    out = []
    offset = len(line) - len(rest)
    for m in re.finditer(r"\S+", rest):
        em = re.fullmatch(r"([0-9]{1,9})>([0-9]{1,9})", m.group(0))
        if not em:
            raise ParseError("expected an edge such as 0>1", line_no, offset + m.start() + 1,
                             m.group(0))
        out.append((int(em.group(1)), int(em.group(2))))
    return tuple(out)


Gangs = tuple[tuple[tuple[int, ...], ...], tuple[tuple[str, ...], ...]]
GANG = re.compile(r"([0-9]{1,9}(?:,[0-9]{1,9})+)(?::([A-Z][A-Z_]*(?:,[A-Z][A-Z_]*)*))?\Z")


def _gangs(line_no: int, line: str, rest: str) -> Gangs:
    """Gangs and their collective kinds (empty: all) from ``0,1,2 3,4:F,B ...``."""
    gangs, kinds = [], []
    offset = len(line) - len(rest)
    for m in re.finditer(r"\S+", rest):
        gm = GANG.match(m.group(0))
        if not gm:
            raise ParseError("expected a gang such as 0,1,2 or 0,1,2:F,B (two or more stages, "
                             "then optionally its collective kinds)", line_no,
                             offset + m.start() + 1, m.group(0))
        gangs.append(tuple(int(x) for x in gm.group(1).split(",")))
        kinds.append(tuple(gm.group(2).split(",")) if gm.group(2) else ())
    return tuple(gangs), (tuple(kinds) if any(kinds) else ())


def parse_schedule(text: str, registry: KindRegistry = KINDS) -> Schedule:
    """Parse the text format; any problem raises ``ParseError`` naming line, column and token."""
    if not isinstance(text, str):
        raise ParseError(f"schedule text must be a string, got {type(text).__name__}")
    rd = _Reader(text, registry)
    line_no, line = rd.next("the header line")
    if line.strip() != MAGIC:
        raise ParseError(f"first line must be {MAGIC!r}", line_no, 1, line.strip()[:40])
    name = ""
    if rd.peek_key() == "name":
        line_no, line = rd.next("name")
        name = _field(line_no, line, "name").strip()
        bad = next((ch for ch in name if unicodedata.category(ch) in ("Cc", "Cs")), None)
        if bad is not None:
            raise ParseError(f"the name holds the control character U+{ord(bad):04X}", line_no,
                             line.find(bad) + 1)
    line_no, line = rd.next("the counts line")
    n_ranks, n_stages, mbs = _counts(line_no, line)
    pl_no, pl_line = rd.next("the placement line")
    placed = _ints(pl_no, pl_line, _field(pl_no, pl_line, "placement"))
    if len(placed) != n_stages:
        raise ParseError(f"placement lists {len(placed)} stages, header says {n_stages}", pl_no, 1)
    for rank, col in placed:
        if rank >= n_ranks:
            raise ParseError(f"rank {rank} is outside 0..{n_ranks - 1}", pl_no, col, str(rank))
    e_no, edges = pl_no, StageGraph.chain(n_stages).edges
    if rd.peek_key() == "edges":
        e_no, e_line = rd.next("edges")
        edges = _edges(e_no, e_line, _field(e_no, e_line, "edges"))
    g_no = e_no
    gangs: Gangs = ((), ())
    if rd.peek_key() == "gangs":
        g_no, g_line = rd.next("gangs")
        gangs = _gangs(g_no, g_line, _field(g_no, g_line, "gangs"))
    lines = [_rank_line(rd, r, registry) for r in range(n_ranks)]
    ranks = [ops for ops, _ in lines]
    pairs = [pair for _, got in lines for pair in got]
    if rd.pos < len(rd.lines):
        extra_no, extra = rd.lines[rd.pos]
        raise ParseError("unexpected line after the last rank", extra_no, 1, extra.strip()[:40])
    placement = _checked(lambda: Placement(tuple(r for r, _ in placed), n_ranks), pl_no)
    _checked(lambda: StageGraph(n_stages, edges), e_no)
    graph = _checked(lambda: StageGraph(n_stages, edges, *gangs), g_no)
    sched = _checked(lambda: Schedule(tuple(ranks), placement, mbs, graph, name), g_no)
    last = rd.lines[rd.pos - 1][0]  # a pair's error: at the rank lines
    return _checked(lambda: sched.with_overlaps(pairs), last) if pairs else sched


def _checked(make: Callable[[], T], line_no: int) -> T:
    """``make()``, with a ConfigError turned into a ParseError at ``line_no``."""
    try:
        return make()
    except ConfigError as exc:
        raise ParseError(str(exc), line_no, 1) from None


def _rank_line(rd: _Reader, rank: int, registry: KindRegistry
               ) -> tuple[tuple[Op, ...], list[tuple[Op, Op]]]:
    """One rank's ops, and its overlapped pairs (``a&b`` tokens)."""
    line_no, line = rd.next(f"'rank {rank}: ...'")
    head, sep, rest = line.partition(":")
    if not sep or head.split() != ["rank", str(rank)]:
        raise ParseError(f"expected 'rank {rank}: ...'", line_no, 1, line.strip()[:40])
    offset = len(head) + 1
    ops: list[Op] = []
    pairs: list[tuple[Op, Op]] = []
    for m in re.finditer(r"\S+", rest):
        column, parts = offset + m.start() + 1, m.group(0).split("&")
        if len(parts) > 2:
            raise ParseError("an overlapped slot holds two ops (a&b)", line_no, column,
                             m.group(0)[:40])
        got = [parse_op(part, registry, line_no, column + (len(parts[0]) + 1) * k)
               for k, part in enumerate(parts)]
        ops += got
        if len(got) == 2:
            pairs.append((got[0], got[1]))
    return tuple(ops), pairs
