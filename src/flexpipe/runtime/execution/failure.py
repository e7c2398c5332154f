"""When a rank's part of a call fails: every rank learns it at once, as one error.

A rank whose step raises part-way (a stage's forward or backward, a dtype its layers refuse, a
transfer) first ends its connections in the pipeline's transfer group (``P2P.abandon``), so a
peer waiting on a transfer with it fails at once rather than after its timeout, and abandons in
turn: the failure spreads along the waits until no rank waits. Then every rank, failed or
finished, meets in one agreement (``comm.complaints``) carrying its ``Failure`` or None. When any
rank failed, each replaces its transfer links by new ones (nothing of the abandoned step can
then be matched with the next step's messages) and raises the same ``RankError``, naming where
the failure began: the rank, its stage, micro-batch and op, and the exception. A rank whose
transfer failed only because another stopped first is a follower, named after the origin.

A rank whose transfer timed out (a peer stuck in a long forward) waits for that peer in the
agreement too, up to the process group's timeout; when the agreement itself fails (a rank is
gone or stuck for good), each rank raises its own failure, which names the peer it lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flexpipe.errors import RunError
from flexpipe.ir.op import Op
from flexpipe.runtime.transport.comm import PeerError

TEXT_LIMIT = 600
"""Characters of an exception's message kept in the error (the rest is on its own rank)."""


@dataclass(frozen=True)
class Failure:
    """One rank's failure in a call: its global ``rank``, ``where`` it was (op, stage,
    micro-batch), the exception's type and message, and whether it was a transfer that failed
    (``follows``: another rank stopped first, or is gone)."""

    rank: int
    where: str
    error: str
    follows: bool

    def __str__(self) -> str:
        return f"rank {self.rank} {self.where}: {self.error}"


class RankError(RunError):
    """A call failed on one or more ranks; every rank raises it with the same message.
    ``origins``: the global ranks where the failure began; ``recovered``: whether the pipeline
    can run its next call (its transfers were reset)."""

    def __init__(self, message: str, origins: tuple[int, ...] = (),
                 recovered: bool = False) -> None:
        super().__init__(message)
        self.origins, self.recovered = origins, recovered

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.origins, self.recovered)


def where(op: Op | None) -> str:
    """Where in a step ``op`` is: its op, stage and micro-batch (None: outside the step's ops,
    at its start or end, or outside a step)."""
    if op is None:
        return "outside its ops"
    return f"in op {op} ({op.kind} of stage {op.stage}, micro-batch {op.mb})"


def of(exc: BaseException, rank: int, op: Op | None) -> Failure:
    """The ``Failure`` of ``exc``, raised on global rank ``rank`` while running ``op``."""
    text = " ".join(str(exc).split())
    if len(text) > TEXT_LIMIT:
        text = text[:TEXT_LIMIT] + " ..."
    return Failure(rank, where(op), f"{type(exc).__name__}: {text}".rstrip(": "),
                   isinstance(exc, PeerError))


def error(call: str, failed: Mapping[int, Failure], recovered: bool, after: str) -> RankError:
    """The one error every rank raises for the ``failed`` ranks of ``call``; ``after`` says what
    the pipeline can do next."""
    origins = [f for f in failed.values() if not f.follows] or list(failed.values())
    followers = sorted(r for r, f in failed.items() if f not in origins)
    text = f"{call} failed on " + "; ".join(map(str, origins))
    if followers:
        text += (f" (so rank{'s' if len(followers) > 1 else ''} "
                 f"{', '.join(map(str, followers))} stopped waiting for it)")
    return RankError(f"{text}. {after}", tuple(f.rank for f in origins), recovered)
