"""Show a schedule around one position, for error messages: the rank's neighbouring ops with the
offending one marked, and the other ranks' ops at similar positions."""

from __future__ import annotations

from flexpipe.ir.schedule import Schedule


def around(schedule: Schedule, rank: int, position: int, width: int = 4) -> str:
    """A few lines of text: each rank's ops near ``position``, the op at (rank, position) in
    brackets."""
    lines = []
    lo = max(0, position - width)
    for r, ops in enumerate(schedule.ranks):
        hi = min(len(ops), position + width + 1)
        toks = []
        for i in range(lo, hi):
            tok = str(ops[i])
            toks.append(f"[{tok}]" if (r, i) == (rank, position) else tok)
        prefix = "... " if lo > 0 and toks else ""
        suffix = " ..." if hi < len(ops) else ""
        mark = ">" if r == rank else " "
        lines.append(f"{mark} rank {r}: {prefix}{' '.join(toks)}{suffix}")
    return "\n".join(lines)
