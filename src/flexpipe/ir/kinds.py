"""The op-kind registry: the one place where an op kind's dependencies, duration, memory effect
and stream are declared. The validator, simulator, text format, views and runtime read it and
need no edits when a kind is added (see ``register_kind``).

Everything here is data: a ``Need`` says which ops must finish first, a ``Gate`` which ops must
wait for this one, a ``MemEffect`` how much memory moves and when, ``time`` a linear combination
of the cost model's per-stage time keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from flexpipe.errors import ConfigError

Where = Literal["same", "pred", "succ"]
Span = Literal["one", "run"]
KIND_NAME = re.compile(r"[A-Z][A-Z_]*\Z")


@dataclass(frozen=True)
class Need:
    """Ops that must finish before an op of this kind starts.

    ``kinds``: alternatives, the first present in the schedule is the one needed (e.g. B or BW).
    ``where``: on the op's own stage, on each producer stage (pred) or each consumer stage (succ).
    ``optional``: needed only when the schedule contains such an op.
    ``span``: "one" = the same micro-batch; "run" = every micro-batch from this op's up to the
    next op of this op's kind on that stage (used by per-unit ops such as FSDP gathers).
    """

    kinds: tuple[str, ...]
    where: Where = "same"
    optional: bool = False
    span: Span = "one"


@dataclass(frozen=True)
class Gate:
    """Ops (on this op's stage) that must wait for this op when both are in the schedule."""

    kinds: tuple[str, ...]
    span: Span = "one"


@dataclass(frozen=True)
class MemEffect:
    """``coeff`` x the stage's memory quantity ``qty`` (act = M_B, wact = M_W, input = bytes of
    the stage's input, params = parameter bytes, sr = what selective recompute drops of M_B,
    read per micro-batch: ``StageCost.mem``'s sr_w where its backward is split) is added to
    ``pool`` at the start or end of the anchor op: this op itself (anchor None) or the op of
    kind ``anchor`` on the same stage and micro-batch (skipped when that op is absent)."""

    qty: str
    coeff: float
    at: Literal["start", "end"] = "end"
    anchor: str | None = None
    pool: Literal["device", "host"] = "device"


@dataclass(frozen=True)
class OpKind:
    """Everything FlexPipe knows about one op kind."""

    name: str
    doc: str
    needs: tuple[Need, ...] = ()
    gates: tuple[Gate, ...] = ()
    time: tuple[tuple[str, float], ...] = ()
    memory: tuple[MemEffect, ...] = ()
    stream: str = "compute"
    useful: bool = False
    color: str = "white"
    glyph: str = "?"
    fallback: tuple[tuple[str, float], ...] = ()
    grads: bool = False
    """Whether the op adds to its stage's parameter gradients (the last such op of a stage in
    a step makes them final: its data-parallel reduction may start there)."""

    def __post_init__(self) -> None:
        if not KIND_NAME.match(self.name):
            raise ConfigError(f"op kind name {self.name!r} must be upper-case letters and '_'")
        for key, coeff in self.time:
            if not isinstance(coeff, int | float) or coeff != coeff or coeff < 0:
                raise ConfigError(f"op kind {self.name}: time coefficient for {key!r} is {coeff!r}")

    def duration(self, times: Callable[[str], float], has: Callable[[str], bool]) -> float:
        """Duration from a stage's time lookup; ``fallback`` applies when a key is missing."""
        if self.fallback and not all(has(k) for k, _ in self.time):
            return sum(c * times(k) for k, c in self.fallback)
        return sum(c * times(k) for k, c in self.time)


F_NEED = Need(("F",), "same")
BACK_OF_SUCC = Need(("B", "BW"), "succ")

BUILTIN: tuple[OpKind, ...] = (
    OpKind("F", "forward pass", (Need(("F",), "pred"),), (), (("F", 1.0),),
           (MemEffect("act", 1.0, "start"),), useful=True, color="blue", glyph="F"),
    OpKind("B", "backward for the input gradient", (F_NEED, BACK_OF_SUCC), (), (("B", 1.0),),
           (MemEffect("act", -1.0), MemEffect("wact", 1.0)), useful=True, color="green", glyph="B",
           grads=True),
    OpKind("W", "backward for the weight gradient", (Need(("B",), "same"),), (), (("W", 1.0),),
           (MemEffect("wact", -1.0),), useful=True, color="yellow", glyph="W", grads=True),
    OpKind("BW", "fused full backward (B and W)", (F_NEED, BACK_OF_SUCC), (), (("BW", 1.0),),
           (MemEffect("act", -1.0),), useful=True, color="cyan", glyph="X", grads=True),
    OpKind("R", "full recompute of the forward from the saved stage input", (F_NEED,),
           (Gate(("B", "BW")),), (("R", 1.0),),
           (MemEffect("act", -1.0, "end", "F"), MemEffect("input", 1.0, "end", "F"),
            MemEffect("act", 1.0, "start"), MemEffect("input", -1.0, "start")),
           color="magenta", glyph="R"),
    OpKind("SEND_F", "send the stage output to its consumers", (F_NEED,), (), (),
           stream="send", color="bright_black", glyph=">"),
    OpKind("RECV_F", "post the receive of the stage input from its remote producers (waits for "
           "nothing; the F it gates waits for the data)", (), (Gate(("F",)),), (), stream="recv",
           color="bright_black", glyph="<"),
    OpKind("SEND_B", "send the input gradient to the producers",
           (Need(("B", "BW"), "same"),), (), (), stream="send", color="bright_black", glyph=">"),
    OpKind("RECV_B", "post the receive of the output gradient from the remote consumers",
           (), (Gate(("B", "BW")),), (), stream="recv",
           color="bright_black", glyph="<"),
)

# The standard extra kinds: activation offload/reload, selective recompute, FSDP all-gather and
# reduce-scatter per chunk and scheduling unit. Registered with the built-ins, so every path that
# reads a schedule (text, CSV, simulator, validator, runtime) knows them.
STANDARD: tuple[OpKind, ...] = (
    OpKind("OFFLOAD", "copy a micro-batch's activations to host memory after its forward",
           (F_NEED,), (), (("OFFLOAD", 1.0),),
           (MemEffect("act", -1.0), MemEffect("act", 1.0, pool="host")), stream="d2h",
           color="bright_magenta", glyph="o", fallback=(("F", 0.5),)),
    OpKind("RELOAD", "copy offloaded activations back to the device before the backward",
           (Need(("OFFLOAD",)),), (Gate(("B", "BW")),), (("RELOAD", 1.0),),
           (MemEffect("act", 1.0, "start"), MemEffect("act", -1.0, pool="host")),
           stream="h2d", color="bright_magenta", glyph="r", fallback=(("F", 0.5),)),
    OpKind("SR", "selective recompute: redo only the regions its forward dropped (the "
                 "activations a profile measured, sr = act - sr_act; else 30% of them; 10% of "
                 "the forward time unprofiled) before the backward",
           (F_NEED,), (Gate(("B", "BW")),), (("SR", 1.0),),
           (MemEffect("sr", -1.0, "end", "F"), MemEffect("sr", 1.0, "start", "SR")),
           color="magenta", glyph="s", fallback=(("F", 0.1),)),
    OpKind("AG", "FSDP all-gather of a chunk's parameters for one scheduling unit (the run of "
                 "micro-batches up to the next AG of the stage)",
           (), (Gate(("F", "B", "BW", "W"), span="run"),), (("AG", 1.0),),
           (MemEffect("params", 1.0, "start"),), stream="comm", color="bright_blue",
           glyph="g", fallback=(("F", 0.25),)),
    OpKind("RS", "FSDP reduce-scatter of a chunk's gradients after its unit's weight gradients; "
                 "frees the gathered parameters",
           (Need(("W", "BW"), span="run"),), (), (("RS", 1.0),), (MemEffect("params", -1.0),),
           stream="comm", color="bright_blue", glyph="x", fallback=(("F", 0.25),)),
)


class KindRegistry:
    """Name -> OpKind. Append-only: a name can be registered again only with the same spec."""

    def __init__(self, kinds: Iterable[OpKind] = ()) -> None:
        self._kinds: dict[str, OpKind] = {}
        for kind in kinds:
            self.register(kind)

    def register(self, kind: OpKind) -> OpKind:
        """Add ``kind``; re-registering an identical spec is a no-op, a different one an error."""
        old = self._kinds.get(kind.name)
        if old is not None and old != kind:
            raise ConfigError(
                f"op kind {kind.name!r} is already registered with another definition")
        self._kinds[kind.name] = kind
        return kind

    def __getitem__(self, name: str) -> OpKind:
        try:
            return self._kinds[name]
        except KeyError:
            known = ", ".join(sorted(self._kinds))
            raise ConfigError(f"unknown op kind {name!r} (known: {known})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._kinds

    def names(self) -> tuple[str, ...]:
        """Registered kind names, longest first (so a tokenizer matches BW before B)."""
        return tuple(sorted(self._kinds, key=lambda n: (-len(n), n)))

    def all(self) -> tuple[OpKind, ...]:
        """Every registered kind, in registration order."""
        return tuple(self._kinds.values())


KINDS = KindRegistry(BUILTIN + STANDARD)


def register_kind(kind: OpKind) -> OpKind:
    """Register a new op kind for the whole process (the DSL's ``op_kind`` calls this)."""
    return KINDS.register(kind)


def kind(name: str) -> OpKind:
    """Look up a registered kind by name, with a clear error for unknown names."""
    return KINDS[name]
