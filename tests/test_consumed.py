"""Proofs that a sent message was consumed (``flexpipe.ir.consumed``): each is a message back
from the receiver, sent after the op that waited for the first one's data, so a sender that waits
on its send once the proof has arrived never waits on anyone; under 1F1B the forward output of
every micro-batch is proven by its gradient coming back."""

from __future__ import annotations

import pytest

from flexpipe.ir.consumed import RECV_OF, proofs
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.lower import lower
from flexpipe.ir.pairs import Message, transfers
from flexpipe.schedules import registry


def test_one_f_one_b_proves_each_output_by_its_gradient() -> None:
    lowered = lower(registry.build("1f1b", 2, 4))
    t = transfers(lowered)
    assert proofs(lowered, t, 0) == {Message("F", 0, 1, k): Message("B", 1, 0, k)
                                     for k in range(4)}
    # a gradient is proven by the next forward output the first rank sends after using it
    assert proofs(lowered, t, 1) == {Message("B", 1, 0, k): Message("F", 0, 1, k + 2)
                                     for k in range(2)}


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", registry.names())
def test_every_proof_is_sent_back_after_its_message_was_used(name: str, p: int) -> None:
    entry = registry.library()[name]
    if not entry.builds(p, 2 * p):
        pytest.skip(f"{name} is not defined at p = {p}")
    params = dict(entry.params)
    lowered = lower(registry.build(name, p, 2 * p, **({"v": 2} if "v" in params else {})))
    t = transfers(lowered)
    for rank in range(lowered.num_ranks):
        for msg, proof in proofs(lowered, t, rank).items():
            peer, at = t.recv_at[msg]
            assert t.send_at[msg][0] == rank and t.recv_at[proof][0] == rank
            assert t.send_at[proof][0] == peer
            gated = {k for g in KINDS[RECV_OF[msg.kind]].gates for k in g.kinds}
            used = [i for i, op in enumerate(lowered.ranks[peer]) if i > at
                    and op.kind in gated and (op.stage, op.mb) == (msg.dst, msg.mb)]
            assert used and t.send_at[proof][1] > used[0], (name, p, msg, proof)
