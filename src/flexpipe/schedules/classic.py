"""Classic schedules in the explicit-order DSL: GPipe, 1F1B (plain, with full recompute, with
activation offload), interleaved 1F1B and looped breadth-first."""

from __future__ import annotations

from flexpipe.dsl.order import Passes, alternate
from flexpipe.dsl.program import Program
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al., 2019): every forward, then every fused backward. Unit-cost bubble
    (p-1)/(m+p-1); peak activation m micro-batches on every rank."""
    prog = Program(Placement.linear(p), m, name="gpipe")
    for r in prog.ranks:
        prog.order(r, prog.queue(r, "F"), prog.queue(r, "BW"))
    return prog.build()


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al., 2021): rank r warms up with p-1-r forwards, then
    alternates one forward and one fused backward. Bubble as GPipe, (p-1)/(m+p-1); peak
    activation min(p, m) micro-batches (rank 0)."""
    prog = Program(Placement.linear(p), m, name="1f1b")
    for r in prog.ranks:
        fs, bs = prog.queue(r, "F"), prog.queue(r, "BW")
        prog.order(r, fs.take(p - 1 - r), alternate(fs, bs), bs)
    return prog.build()


def one_f_one_b_recompute(p: int, m: int, selective: bool = False) -> Schedule:
    """1F1B with activation recompute (Chen et al., 2016; Korthikanti et al., 2022). Full: each
    forward keeps only its stage input and R recomputes the activations just before the backward
    (peak about one micro-batch plus p stage inputs, bubble grows by the recompute time).
    ``selective``: only the attention core is dropped and recomputed by SR (about 30% of the
    activations for 10% of the forward time)."""
    prog = Program(Placement.linear(p), m, name="1f1b-recompute")
    redo = "SR" if selective else "R"
    for r in prog.ranks:
        fs = prog.queue(r, "F")
        backs = Passes(op for j in range(m) for op in (Op(redo, r, j), Op("BW", r, j)))
        prog.order(r, fs.take(p - 1 - r), alternate(fs, backs, counts=(1, 2)), backs)
    return prog.build()


def one_f_one_b_offload(p: int, m: int) -> Schedule:
    """1F1B with activation offload (as in ZeRO-Offload / TorchTitan's CPU offload): each
    forward's activations go to host memory on a copy stream and come back on another just
    before the backward that needs them. Same bubble as 1F1B when the copies hide behind
    compute; device activation peak about 2 micro-batches instead of p."""
    prog = Program(Placement.linear(p), m, name="1f1b-offload")
    for r in prog.ranks:
        if r == p - 1:  # the last rank needs each activation at once: nothing to offload
            fs, bs = prog.queue(r, "F"), prog.queue(r, "BW")
            prog.order(r, alternate(fs, bs), bs)
            continue
        fs = Passes(op for j in range(m) for op in (Op("F", r, j), Op("OFFLOAD", r, j)))
        order = fs.take(2 * (p - 1 - r))
        for j in range(m):
            order += [Op("RELOAD", r, j)] + fs.take(2) + [Op("BW", r, j)]
        prog.order(r, order)
    return prog.build()


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): v chunks per rank on a looped
    placement, forwards in rounds of about p micro-batches chunk by chunk (m // p rounds, so any
    m works; torch requires equal rounds). Unit-cost bubble
    about (p-1)/(v m) of the step; warm-up holds more chunks than 1F1B."""
    prog = Program(Placement.interleaved(p, v), m, name="interleaved-1f1b")
    groups = _rounds(m, p)
    for r in prog.ranks:
        fwd = [(c * p + r, j) for g in groups for c in range(v) for j in g]
        bwd = [(c * p + r, j) for g in groups for c in reversed(range(v)) for j in g]
        fs, bs = prog.queue(r, "F", fwd), prog.queue(r, "BW", bwd)
        warm = (p - r - 1) * 2 + (v - 1) * len(groups[0])
        prog.order(r, fs.take(warm), alternate(fs, bs), bs)
    return prog.build()


def _rounds(m: int, p: int) -> list[range]:
    """Micro-batches in max(1, m // p) rounds of nearly equal size (each >= p when m >= p),
    larger rounds first: the chunk loop runs once per round."""
    n = max(1, m // p)
    sizes = [m // n + (1 if i < m % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [range(a, a + k) for a, k in zip(starts, sizes, strict=True)]


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Looped breadth-first (Lamy-Poirier, 2023): on a looped placement, every micro-batch's
    forward through chunk 0, then chunk 1, ..., then the backwards in reverse. Fewest chunk
    switches (good with FSDP); activation peak m x v chunks as GPipe."""
    prog = Program(Placement.interleaved(p, v), m, name="bfs")
    for r in prog.ranks:
        chunks = [c * p + r for c in range(v)]
        prog.order(r, prog.queue(r, "F", stages=chunks),
                   prog.queue(r, "BW", stages=chunks[::-1]))
    return prog.build()
