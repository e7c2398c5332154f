"""The executor's inboxes: where the tensors handed to a stage wait for the op that reads them.

Per receive kind (``RECV_F``: a stage's inputs, ``RECV_B``: its outputs' gradients) and per
(stage, micro-batch), one box maps each neighbour stage to its tensors: handed over directly by
a local neighbour, or the pending receive (``Incoming``) of a remote one, posted up to
``lookahead`` ops before the op that uses it. The box also knows which receive ops it posted
early and which op kinds wait for which receives (the kind registry's gates).
"""

from __future__ import annotations

from collections.abc import Iterator

from flexpipe.ir.kinds import KINDS
from flexpipe.ir.op import Op
from flexpipe.runtime.execution.stage import Tensors
from flexpipe.runtime.transport.p2p import Incoming

Box = dict[int, "Tensors | Incoming"]  # neighbour stage -> its tensors (or a pending receive)
RECEIVES = ("RECV_F", "RECV_B")
"""The receive kinds, one inbox each."""


class Inbox:
    """The boxes of one rank's step, the receives posted early, and the gates."""

    def __init__(self, ops: tuple[Op, ...], lookahead: int) -> None:
        self.ops, self.lookahead = ops, lookahead
        self.gated_by = _gated_by(RECEIVES)
        """Op kind -> the receive kinds it waits for before it starts."""
        self.boxes: dict[str, dict[tuple[int, int], Box]] = {k: {} for k in RECEIVES}
        self.posted: set[Op] = set()

    def reset(self) -> None:
        """Empty every box for a new step."""
        self.boxes = {k: {} for k in RECEIVES}
        self.posted = set()

    def box(self, recv: str, stage: int, mb: int) -> Box:
        """The box of ``stage`` and micro-batch ``mb`` for ``recv`` (made empty if new)."""
        return self.boxes[recv].setdefault((stage, mb), {})

    def take(self, recv: str, stage: int, mb: int) -> Box:
        """Remove and return that box (empty if nothing was handed to it)."""
        return self.boxes[recv].pop((stage, mb), {})

    def gating(self, op: Op) -> Iterator[tuple[str, Box, int]]:
        """(receive kind, box, neighbour stage) of every pending receive ``op`` waits for."""
        for recv in self.gated_by.get(op.kind, ()):
            box = self.boxes[recv].get((op.stage, op.mb), {})
            for stage, got in list(box.items()):
                if isinstance(got, Incoming):
                    yield recv, box, stage

    def to_post(self, i: int) -> Iterator[int]:
        """Indices of the receive ops among op ``i`` and the next ``lookahead`` not posted
        yet; each is marked posted as it is yielded."""
        for j in range(i, min(i + 1 + self.lookahead, len(self.ops))):
            op = self.ops[j]
            if op.kind in RECEIVES and op not in self.posted:
                yield j
                self.posted.add(op)


def _gated_by(recv_kinds: tuple[str, ...]) -> dict[str, list[str]]:
    """Op kind -> the receive kinds that gate it, from the kind registry."""
    out: dict[str, list[str]] = {}
    for recv in recv_kinds:
        for gate in KINDS[recv].gates:
            for k in gate.kinds:
                out.setdefault(k, []).append(recv)
    return out
