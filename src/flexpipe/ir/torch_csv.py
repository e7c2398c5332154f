"""Export to and import from torch.distributed.pipelining's compute-only CSV.

torch writes one row per rank (``PipelineScheduleMulti._dump_csv``) and reads each cell with
``_Action.from_str``: a cell is ``{stage}{type}{microbatch}`` with type F (forward), I (backward
for the input), W (backward for the weights) or B (fused full backward). Empty cells are idle
slots. FlexPipe's names differ at this boundary only:

    FlexPipe  F  B  W  BW
    torch     F  I  W  B

The CSV holds no placement, stage graph or micro-batch count: on import, each stage's rank is
where it appears (a stage on two ranks is an error), the stage count is the largest stage plus
one, and the micro-batch count the largest micro-batch plus one, unless given. An overlapped
pair (``flexpipe.ir.overlap``) is torch's ``OVERLAP_F_B`` cell, ``(2F5;5B1)OVERLAP_F_B``.
"""

from __future__ import annotations

import re

from flexpipe.errors import ConfigError, ParseError
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import heads, slots
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

TO_TORCH = {"F": "F", "B": "I", "W": "W", "BW": "B"}
FROM_TORCH = {v: k for k, v in TO_TORCH.items()}
CELL = re.compile(r"([0-9]{1,9})([A-Z_]+)([0-9]{1,9})\Z")
ANY_CELL = re.compile(r"([0-9]+)([A-Za-z_]+)([0-9]*)\Z")
OVERLAP = re.compile(r"\(([^;()]*);([^;()]*)\)OVERLAP_F_B\Z")

Cell = tuple[Op, int, int]  # the op, its line and its column


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV of ``schedule``: one row per rank, cells such as ``2I0``.
    Only F, B, W and BW can be expressed, on a chain of stages (torch's reader infers one);
    any other kind or stage graph raises ``ConfigError``."""
    if not schedule.graph.chain_edges:
        edges = " ".join(f"{a}>{b}" for a, b in schedule.graph.edges)
        raise ConfigError(f"torch's compute-only CSV holds a chain of stages, and the stage graph "
                          f"of {schedule.name or 'this schedule'} is not one (edges {edges}: "
                          "e.g. DualPipe's two directions); use the text format")
    rows = []
    for r, i, op in schedule.ops():
        if op.kind not in TO_TORCH:
            raise ConfigError(
                f"rank {r}, position {i}: op {op} has kind {op.kind!r}, which torch's "
                f"compute-only CSV cannot express (only {', '.join(TO_TORCH)}); export the "
                f"schedule before lowering or use the text format")
    pairs = heads(schedule.overlaps)
    for ops in schedule.ranks:
        rows.append(",".join(f"({';'.join(map(_cell_text, slot))})OVERLAP_F_B"
                             if len(slot) == 2 else _cell_text(slot[0])
                             for slot in slots(ops, pairs)))
    return "\n".join(rows) + "\n"


def _cell_text(op: Op) -> str:
    return f"{op.stage}{TO_TORCH[op.kind]}{op.mb}"


def from_torch_csv(text: str, placement: Placement | None = None,
                   microbatches: int | None = None, name: str = "") -> Schedule:
    """Parse torch's compute-only CSV into a ``Schedule``; problems raise ``ParseError`` with the
    line, column and token. ``placement`` and ``microbatches`` are inferred when not given."""
    if not isinstance(text, str):
        raise ParseError(f"CSV text must be a string, got {type(text).__name__}")
    rows, pairs = _rows(text)
    stage_rank = _stage_ranks(rows)
    if placement is None:
        placement = _infer_placement(stage_rank, len(rows))
    else:
        _check_placement(placement, stage_rank, len(rows))
    mbs = _microbatches(rows, microbatches)
    ranks = tuple(tuple(op for op, _, _ in row) for row in rows)
    try:
        return Schedule(ranks, placement, mbs, None, name,  # type: ignore[arg-type]
                        frozenset(pairs))
    except ConfigError as exc:
        raise ParseError(str(exc)) from None


def _rows(text: str) -> tuple[list[list[Cell]], list[tuple[Op, Op]]]:
    """Cells of each line, and the overlapped pairs; the newline ending the last row does not
    start another rank."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    pairs: list[tuple[Op, Op]] = []
    return [_row(line.removesuffix("\r"), n + 1, pairs) for n, line in enumerate(lines)], pairs


def _row(line: str, line_no: int, pairs: list[tuple[Op, Op]]) -> list[Cell]:
    out: list[Cell] = []
    col = 1
    for raw in line.split(","):
        cell = raw.strip()
        column = col + (len(raw) - len(raw.lstrip()))
        col += len(raw) + 1
        if cell.startswith('"') and cell.endswith('"') and len(cell) >= 2:
            cell = cell[1:-1].strip()
        overlap = OVERLAP.match(cell)
        if overlap:
            got = [_cell(part.strip(), line_no, column) for part in overlap.groups()]
            out += [(op, line_no, column) for op in got]
            pairs.append((got[0], got[1]))
        elif cell:
            out.append((_cell(cell, line_no, column), line_no, column))
    return out


def _cell(cell: str, line_no: int, column: int) -> Op:
    m = CELL.match(cell)
    if m and m.group(2) in FROM_TORCH:
        return Op(FROM_TORCH[m.group(2)], int(m.group(1)), int(m.group(3)))
    loose = ANY_CELL.match(cell)
    if loose and loose.group(2) not in FROM_TORCH:
        reason = (f"torch action {loose.group(2)!r} is not a compute action; the compute-only "
                  f"CSV holds F, I, W and B")
    elif loose and not loose.group(3):
        reason = "the action has no micro-batch index"
    elif loose:
        reason = "stage or micro-batch index is too large"
    else:
        reason = "expected an action such as 2F0 ({stage}{F|I|W|B}{microbatch})"
    raise ParseError(reason, line_no, column, cell[:40])


def _stage_ranks(rows: list[list[Cell]]) -> dict[int, tuple[int, int, int]]:
    """stage -> (rank, line, column) of its first appearance; a stage on two ranks is an error."""
    seen: dict[int, tuple[int, int, int]] = {}
    for rank, row in enumerate(rows):
        for op, line, col in row:
            first = seen.setdefault(op.stage, (rank, line, col))
            if first[0] != rank:
                raise ParseError(f"stage {op.stage} appears on rank {rank} and on rank {first[0]} "
                                 f"(line {first[1]}); a stage must run on one rank", line, col,
                                 f"{op.stage}{TO_TORCH[op.kind]}{op.mb}")
    return seen


def _infer_placement(stage_rank: dict[int, tuple[int, int, int]], num_rows: int) -> Placement:
    if not stage_rank:
        raise ParseError("the CSV has no actions, so its stages cannot be inferred; pass a "
                         "placement")
    num_stages = max(stage_rank) + 1
    absent = next((s for s in range(num_stages) if s not in stage_rank), None)
    if absent is not None:
        raise ParseError(f"stage {absent} appears on no rank, so its rank cannot be inferred; "
                         f"pass a placement")
    return Placement(tuple(stage_rank[s][0] for s in range(num_stages)), num_rows)


def _check_placement(placement: Placement, stage_rank: dict[int, tuple[int, int, int]],
                     num_rows: int) -> None:
    if placement.num_ranks != num_rows:
        raise ParseError(f"the CSV has {num_rows} rows (ranks), the placement has "
                         f"{placement.num_ranks} ranks")
    for stage, (rank, line, col) in sorted(stage_rank.items()):
        if stage >= placement.num_stages:
            raise ParseError(f"stage {stage} is outside the placement's stages "
                             f"0..{placement.num_stages - 1}", line, col)
        if placement.rank_of(stage) != rank:
            raise ParseError(f"stage {stage} is on rank {rank}, the placement puts it on rank "
                             f"{placement.rank_of(stage)}", line, col)


def _microbatches(rows: list[list[Cell]], microbatches: int | None) -> int:
    cells = [c for row in rows for c in row]
    if microbatches is None:
        if not cells:
            raise ParseError("the CSV has no actions, so the micro-batch count cannot be "
                             "inferred; pass microbatches")
        return max(op.mb for op, _, _ in cells) + 1
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ParseError(f"microbatches must be a positive integer, got {microbatches!r}")
    for op, line, col in cells:
        if op.mb >= microbatches:
            raise ParseError(f"micro-batch {op.mb} is outside 0..{microbatches - 1}", line, col,
                             f"{op.stage}{TO_TORCH[op.kind]}{op.mb}")
    return microbatches
