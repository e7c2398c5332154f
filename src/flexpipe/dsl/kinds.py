"""Declaring new op kinds in the DSL, and the standard extra kinds FlexPipe ships, all declared
here with ``op_kind`` exactly as a user would: activation offload/reload, selective recompute,
and FSDP all-gather / reduce-scatter per chunk and scheduling unit.

Declaring a kind registers it once for the process; the validator, simulator, text format, views
and runtime pick it up from the registry with no edits elsewhere.
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


OFFLOAD = op_kind(
    "OFFLOAD", "copy a micro-batch's activations to host memory after its forward",
    needs=[Need(("F",))], time={"OFFLOAD": 1.0}, fallback={"F": 0.5}, stream="d2h",
    memory=[MemEffect("act", -1.0), MemEffect("act", 1.0, pool="host")],
    color="bright_magenta", glyph="o")
RELOAD = op_kind(
    "RELOAD", "copy offloaded activations back to the device before the backward",
    needs=[Need(("OFFLOAD",))], gates=[Gate(("B", "BW"))], time={"RELOAD": 1.0},
    fallback={"F": 0.5}, stream="h2d",
    memory=[MemEffect("act", 1.0, "start"), MemEffect("act", -1.0, pool="host")],
    color="bright_magenta", glyph="r")
SELECTIVE_RECOMPUTE = op_kind(
    "SR", "selective recompute: redo only the attention core (30% of the activations, "
          "10% of the forward time) before the backward",
    needs=[Need(("F",))], gates=[Gate(("B", "BW"))], time={"SR": 1.0}, fallback={"F": 0.1},
    memory=[MemEffect("act", -0.3, "end", "F"), MemEffect("act", 0.3, "start")],
    color="magenta", glyph="s")
ALL_GATHER = op_kind(
    "AG", "FSDP all-gather of a chunk's parameters for one scheduling unit (the run of "
          "micro-batches up to the next AG of the stage)",
    gates=[Gate(("F", "B", "BW", "W"), span="run")], time={"AG": 1.0}, fallback={"F": 0.25},
    memory=[MemEffect("params", 1.0, "start")], stream="comm", color="bright_blue", glyph="g")
REDUCE_SCATTER = op_kind(
    "RS", "FSDP reduce-scatter of a chunk's gradients after its unit's weight gradients; "
          "frees the gathered parameters",
    needs=[Need(("W", "BW"), span="run")], time={"RS": 1.0}, fallback={"F": 0.25},
    memory=[MemEffect("params", -1.0)], stream="comm", color="bright_blue", glyph="x")
