"""Slot rows of the V placement, and the reordering steps of the controllable-memory paper's
adaptive scheduler (Qi et al., NeurIPS 2024, section 3 and appendix A: repeat a building
block, squeeze it, reorder warm-up and cool-down, fill the bubbles); written from the paper and
its authors' scheduler's behaviour, standard library only.

A row is one rank's timeline in unit slots: a list of tokens, " " for an idle slot. Tokens:
"F" forward of the down chunk (stage i on rank i), "f" forward of the up chunk (stage
2p-1-i), "B" backward of the up chunk, "b" backward of the down chunk, "W" / "w" the weight
passes of "B" / "b". The k-th token of a kind on a rank is micro-batch k. Memory counts chunk
activations: F and f hold one, W and w free one.

Dependencies across ranks (the V): F and B flow from rank i-1 to rank i, f and b from rank i+1
to rank i; on the last rank f follows F and b follows B, on rank 0 B follows f.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

Rows = list[list[str]]
TOKENS = "FfBbWw"
MEM = {"F": 1, "f": 1, "W": -1, "w": -1}
WEIGHT = {"B": "W", "b": "w"}


def peaks(rows: Rows) -> list[int]:
    """Each row's peak count of chunk activations held."""
    out = []
    for row in rows:
        cur = peak = 0
        for tok in row:
            if tok == "F" or tok == "f":
                cur += 1
                peak = cur if cur > peak else peak
            elif tok == "W" or tok == "w":
                cur -= 1
        out.append(peak)
    return out


def _source(tok: str, i: int, p: int) -> tuple[int, str] | None:
    """The (rank, token) whose same micro-batch ``tok`` on rank ``i`` waits for across ranks
    (None: only its own row's order)."""
    if tok in "FB":
        return (i - 1, tok) if i > 0 else None
    if tok in "fb":
        return (i + 1, tok) if i + 1 < p else None
    return None


Times = Mapping[str, tuple[float, float]]  # token -> (duration, transfer of its input)
UNIT: Times = {tok: (1, 0) for tok in TOKENS}


def replay(orders: Sequence[Sequence[str]], times: Sequence[Times]
           ) -> list[dict[str, list[float]]] | None:
    """The start of every token (per row and token, in micro-batch order) when each row runs
    its tokens in order, each as soon as its row is free and its source's same micro-batch
    (``_source``) has ended and its input arrived (``times[i][tok]``: duration, transfer);
    None when the orders deadlock."""
    p = len(orders)
    start: list[dict[str, list[float]]] = [{tok: [] for tok in TOKENS} for _ in range(p)]
    end: list[dict[str, list[float]]] = [{tok: [] for tok in TOKENS} for _ in range(p)]
    pos, free = [0] * p, [0.0] * p
    todo = list(range(p))
    while todo:
        i = todo.pop()
        row, k, t, cost = orders[i], pos[i], free[i], times[i]
        above = end[i - 1] if i > 0 else None  # F and B come from rank i-1
        below = end[i + 1] if i + 1 < p else None  # f and b from rank i+1
        while k < len(row):
            tok = row[k]
            done, (took, xfer) = end[i][tok], cost[tok]
            src = above if tok in "FB" else below if tok in "fb" else None
            if src is not None:
                got = src[tok]
                if len(got) <= len(done):
                    break
                t = max(t, got[len(done)] + xfer)
            start[i][tok].append(t)
            t += took
            done.append(t)
            k += 1
        if k > pos[i]:
            pos[i], free[i] = k, t
            todo += [j for j in (i - 1, i + 1)
                     if 0 <= j < p and pos[j] < len(orders[j]) and j not in todo]
    if any(pos[i] < len(orders[i]) for i in range(p)):
        return None
    return start


def compact(rows: Rows) -> Rows | None:
    """Every token as early as its row's previous token and its source allow (one slot
    each), each row's order kept; None when the orders deadlock."""
    orders = [[tok for tok in row if tok != " "] for row in rows]
    start = replay(orders, [UNIT] * len(rows))
    if start is None:
        return None
    width = max(int(slots[-1]) for row in start for slots in row.values() if slots) + 1
    out = [[" "] * width for _ in rows]
    for i, row in enumerate(start):
        for tok, slots in row.items():
            for j in slots:
                out[i][int(j)] = tok
    return out


def warm_up(rows: Rows, m: int) -> Rows:
    """The warm-up (each row's tokens before its first "b") laid out again without raising the
    peak M: rank i first runs up to M - min(i+1, M//2) forwards of the down chunk and
    min(i+1, M//2) of the up chunk, interleaved from its (2(p-1-i)+1)-th slot on, then repeats
    B, W, one forward (up chunk first). Returns the new orders (compact them)."""
    p = len(rows)
    mem = min(max(peaks(rows)), 2 * p)
    out = []
    for i, row in enumerate(rows):
        toks = [tok for tok in row if tok != " "]
        cut = toks.index("b") if "b" in toks else len(toks)
        out.append(_warm_row(toks[:cut], i, p, min(i + 1, mem // 2, m), m, mem) + toks[cut:])
    return out


def _warm_row(head: list[str], i: int, p: int, up: int, m: int, mem: int) -> list[str]:
    """Rank i's warm-up tokens ``head`` in ``warm_up``'s order (``up`` up-chunk forwards
    first)."""
    have = {tok: head.count(tok) for tok in "FfBW"}
    cap = {"F": min(mem - up, m), "f": up, "B": have["B"], "W": have["W"]}
    used = dict.fromkeys("FfBW", 0)
    seq: list[str] = []
    plan = ["F"] * (2 * (p - 1 - i)) + ["F", "f"] * (i + 1)
    for tok in plan:
        if used[tok] < min(have[tok], cap[tok]):
            seq.append(tok)
            used[tok] += 1
    while any(used[t] < have[t] for t in used):
        for tok in ("B", "W", "f" if used["f"] < have["f"] else "F"):
            if used[tok] < have[tok]:
                seq.append(tok)
                used[tok] += 1
    return seq


def cool_down(rows: Rows, m: int) -> Rows | None:
    """The cool-down laid out again (rows compacted first): after rank 0's last "f", each rank
    runs its last (M+1)//2 "b" and its last min(i+1, M - (M+1)//2) "B" two slots apart, every
    dependency as tight as the layout allows, and the weight passes it took out in the first
    free slots after its last remaining one. None when a pass would land on another."""
    p = len(rows)
    mem = max(peaks(rows))
    n_down = min((mem + 1) // 2, m)  # "b" passes laid out again
    n_up = min(mem - n_down, m)  # "B" passes, at most i + 1 on rank i
    rows = [list(row) for row in rows]
    start = max(j for j, tok in enumerate(rows[0]) if tok == "f")
    for i, row in enumerate(rows):
        took = {"B": _take_last(row, "B", min(i + 1, n_up)), "b": _take_last(row, "b", n_down)}
        _take_tail_weights(row, took, mem)
        need = max(start - i + 2 * p, start + 1 + i) + 1
        row.extend([" "] * max(0, need - len(row)))
        spots = [(start - i + 2 * p - 2 * k, "b") for k in range(took["b"])]
        spots += [(start + 1 + i - 2 * k, "B") for k in range(took["B"])]
        for j, tok in spots:
            if j < 0 or row[j] != " ":
                return None
            row[j] = tok
        _refill_weights(row)
    width = max(map(len, rows))
    return compact([row + [" "] * (width - len(row)) for row in rows])


def _take_last(row: list[str], tok: str, count: int) -> int:
    """Blank the last ``count`` tokens ``tok`` of ``row``; returns how many were taken."""
    taken = 0
    for j in range(len(row) - 1, -1, -1):
        if taken == count:
            break
        if row[j] == tok:
            row[j], taken = " ", taken + 1
    return taken


def _take_tail_weights(row: list[str], took: dict[str, int], mem: int) -> None:
    """Blank weight passes from the end until at least as many W as taken B, w as taken b,
    and ``mem`` in all are out."""
    w = ww = 0
    for j in range(len(row) - 1, -1, -1):
        if w >= took["B"] and ww >= took["b"] and w + ww >= mem:
            return
        if row[j] == "W":
            row[j], w = " ", w + 1
        elif row[j] == "w":
            row[j], ww = " ", ww + 1


def _refill_weights(row: list[str]) -> None:
    """Each backward's missing weight pass into the first free slot after the row's last
    weight pass (W before w), the rest appended."""
    last_w = max((j for j, tok in enumerate(row) if tok in "Ww"), default=-1)
    owed = {"W": 0, "w": 0}
    for j, tok in enumerate(row):
        if tok in WEIGHT:
            owed[WEIGHT[tok]] += 1
        elif tok in owed:
            owed[tok] -= 1
        elif tok == " " and j > last_w:
            kind = "W" if owed["W"] > 0 else "w" if owed["w"] > 0 else None
            if kind:
                row[j], owed[kind] = kind, owed[kind] - 1
    row.extend(["W"] * owed["W"] + ["w"] * owed["w"])


def fill_bubbles(rows: Rows) -> Rows:
    """Fill each idle slot, left to right, with the first later pass of its row (the first
    of each kind) that may move there: its source already ran in an earlier slot, its own
    input (f before B on rank 0, F before f and B before b on the last rank, B before W) ran,
    and a forward only when the row stays within its peak."""
    p = len(rows)
    rows = [list(row) for row in rows]
    width = max(map(len, rows))
    for row in rows:
        row.extend([" "] * (width - len(row)))
    limit = max(peaks(rows))
    last = [{tok: j for j, tok in enumerate(row) if tok != " "} for row in rows]
    ends = [max(row_last.values(), default=-1) for row_last in last]
    at: list[dict[str, list[int]]] = [{tok: [] for tok in TOKENS} for _ in range(p)]
    held = [0] * p
    for j in range(width):
        for i, row in enumerate(rows):
            if row[j] == " " and j < ends[i]:
                _fill_one(rows, i, j, limit - held[i], last[i], at)
            tok = row[j]
            if tok != " ":
                at[i][tok].append(j)
                held[i] += MEM.get(tok, 0)
    return rows


OWN_INPUT = {("B", "first"): "f", ("f", "last"): "F", ("b", "last"): "B",
             ("W", "any"): "B", ("w", "any"): "b"}


def _may_move(tok: str, i: int, j: int, at: list[dict[str, list[int]]]) -> bool:
    """Whether the next ``tok`` of row i may run in slot j (see ``fill_bubbles``)."""
    p, k = len(at), len(at[i][tok])
    src = _source(tok, i, p)
    if src is not None:
        got = at[src[0]][tok]
        return k < len(got) and got[k] < j
    where = "any" if tok in "Ww" else "first" if i == 0 and tok == "B" else "last"
    own = OWN_INPUT.get((tok, where))
    return own is None or len(at[i][own]) > k


def _fill_one(rows: Rows, i: int, j: int, room: int, last: dict[str, int],
              at: list[dict[str, list[int]]]) -> None:
    """Move the first movable later pass of row i into its idle slot j (``fill_bubbles``;
    ``room``: chunk activations the row may still add)."""
    row = rows[i]
    open_kinds = {tok for tok, j2 in last.items() if j2 > j}
    delta = rise = 0
    for k in range(j + 1, len(row)):
        if not open_kinds:
            return
        tok = row[k]
        if tok == " ":
            continue
        before = rise
        delta += MEM.get(tok, 0)
        rise = max(rise, delta)
        if tok not in open_kinds:
            continue
        open_kinds.discard(tok)
        if tok in "Ff" and before >= room:
            continue
        if _may_move(tok, i, j, at):
            row[j], row[k] = tok, " "
            return


def relabel_weights(rows: Rows) -> Rows:
    """Each weight pass given to the oldest backward of its row still without one (W or w)."""
    out = []
    for row in rows:
        queue: deque[str] = deque()
        new = []
        for tok in row:
            if tok in WEIGHT:
                queue.append(WEIGHT[tok])
            elif tok in "Ww":
                tok = queue.popleft() if queue else tok
            new.append(tok)
        out.append(new)
    return out


def complete(rows: Rows, m: int) -> bool:
    """Whether every row runs m tokens of each kind and every pass after its inputs."""
    p = len(rows)
    at: dict[tuple[int, str, int], int] = {}
    for i, row in enumerate(rows):
        seen = dict.fromkeys(TOKENS, 0)
        for j, tok in enumerate(row):
            if tok != " ":
                at[(i, tok, seen[tok])] = j
                seen[tok] += 1
        if any(seen[t] != m for t in TOKENS):
            return False
    for (i, tok, k), j in at.items():
        src = _source(tok, i, p)
        if src is not None and not at[(*src, k)] < j:
            return False
        own = _own_input(tok, i, p)
        if own is not None and not at[(i, own, k)] < j:
            return False
    return True


def _own_input(tok: str, i: int, p: int) -> str | None:
    """The token of the same row and micro-batch that ``tok`` waits for, if any."""
    if tok in "Ww":
        return {"W": "B", "w": "b"}[tok]
    if i == 0 and tok == "B":
        return "f"
    if i == p - 1 and tok in "fb":
        return {"f": "F", "b": "B"}[tok]
    return None
