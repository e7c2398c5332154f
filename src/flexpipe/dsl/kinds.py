"""Declaring new op kinds in the DSL: ``op_kind`` registers a kind once for the process; the
validator, simulator, text format, views and runtime pick it up from the registry with no edits
elsewhere. The standard extra kinds FlexPipe ships (OFFLOAD, RELOAD, SR, AG, RS) are declared
with the built-ins in ``flexpipe.ir.kinds`` (``STANDARD``), so reading a schedule never depends
on importing the DSL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexpipe.ir.kinds import Gate, MemEffect, Need, OpKind, register_kind


def op_kind(name: str, doc: str, *, needs: Sequence[Need] = (), gates: Sequence[Gate] = (),
            time: Mapping[str, float] | None = None, fallback: Mapping[str, float] | None = None,
            memory: Sequence[MemEffect] = (), stream: str = "compute", useful: bool = False,
            color: str = "white", glyph: str = "?") -> OpKind:
    """Declare and register an op kind.

    ``needs``: ops that must end first (``Need(kinds, where, optional, span)``); ``gates``: ops
    that must wait for this one; ``time``: duration as {cost-model time key: coefficient};
    ``fallback``: the same, used when the cost model lacks one of ``time``'s keys; ``memory``:
    ``MemEffect``s; ``stream``: ops on different streams of a rank overlap; ``useful``: counted
    as useful work in the bubble rate.
    """
    spec = OpKind(name, doc, tuple(needs), tuple(gates), tuple((time or {}).items()),
                  tuple(memory), stream, useful, color, glyph, tuple((fallback or {}).items()))
    return register_kind(spec)
