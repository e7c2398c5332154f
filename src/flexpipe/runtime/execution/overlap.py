"""Overlapped pairs run for real: the two passes of a pair (``flexpipe.ir.overlap``, DualPipe's
F&B) at once, the backward on the calling thread and the forward on a worker thread (torch
releases the GIL inside its kernels and while gloo waits), so each one's all-to-all waits
behind the other's compute.

Collectives: a pass's expert all-to-alls run on the group of its micro-batch's *lane*
(``transport.experts.expert_lane``; a backward's on its forward's, torch's reverse exchange
reusing the forward's group). The lanes are a 2-colouring of the forwards in which the two
passes of every pair differ, computed from the whole schedule alike on every rank, so two
passes running at once never issue collectives on one group and every ``ep`` rank matches each
group's collectives in program order. A pair whose passes cannot get different lanes (an odd
cycle of pairs) runs one pass after the other. The pipeline's sends and receives are the
schedule's SEND/RECV ops around the pair, posted without waiting (``transport.p2p``)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flexpipe.ir.op import Op
from flexpipe.ir.overlap import FORWARD, Pair

Key = tuple[int, int]


def lanes(pairs: Iterable[Pair]) -> tuple[dict[Key, int], frozenset[Pair]]:
    """Per forward (stage, micro-batch), its lane (0 or 1; 0 when in no pair) such that the two
    passes of a pair differ, and the pairs that cannot be given different lanes."""
    edges: dict[Key, list[Key]] = {}
    ordered = sorted(pairs)
    for a, b in ordered:
        x, y = _key(a), _key(b)
        edges.setdefault(x, []).append(y)
        edges.setdefault(y, []).append(x)
    lane: dict[Key, int] = {}
    for start in sorted(edges):
        if start in lane:
            continue
        lane[start], todo = 0, [start]
        while todo:
            node = todo.pop()
            for other in edges[node]:
                if other not in lane:
                    lane[other] = 1 - lane[node]
                    todo.append(other)
    clash = frozenset(pr for pr in ordered if lane[_key(pr[0])] == lane[_key(pr[1])])
    return lane, clash


def _key(op: Op) -> Key:
    return (op.stage, op.mb)


class PairRunner:
    """Runs this rank's pairs: which positions start one, each pass's lane, the worker thread;
    ``concurrent`` False runs every pair one pass after the other (on the same lanes)."""

    def __init__(self, ops: tuple[Op, ...], pairs: Iterable[Pair], concurrent: bool) -> None:
        everyone = tuple(pairs)
        self.lane, clash = lanes(everyone)
        where = {op: i for i, op in enumerate(ops)}
        mine = [pr for pr in everyone if pr[0] in where]
        self.heads = {where[a]: where[a] + 1 for a, _ in mine}
        self.seconds = frozenset(self.heads.values())
        self.together = frozenset(where[a] for a, b in mine if (a, b) not in clash) \
            if concurrent else frozenset()
        self.concurrent_runs = 0
        """Pairs run with their passes at once so far (the worker thread used)."""
        self._pool: ThreadPoolExecutor | None = None

    def lane_of(self, op: Op) -> int:
        """The expert lane ``op`` runs on: its micro-batch's forward's."""
        return self.lane.get(_key(op), 0)

    def run(self, i: int, ops: tuple[Op, ...], call: Callable[[int], None]) -> None:
        """Run the pair starting at position ``i`` (``call(j)`` runs op ``j``): the forward on
        the worker thread beside the backward here when it may, else one after the other. An
        error of either pass is raised once both have stopped."""
        order = sorted((i, i + 1), key=lambda j: ops[j].kind != FORWARD)
        if i not in self.together:
            for j in order:
                call(j)
            return
        forward, backward = order
        grad = torch.is_grad_enabled()
        done = self._worker().submit(contextvars.copy_context().run, _with_grad, grad,
                                     call, forward)
        try:
            call(backward)
        finally:
            _wait(done)
        self.concurrent_runs += 1

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="flexpipe-pair")
        return self._pool

    def close(self) -> None:
        """Stop the worker thread (a later pair starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _with_grad(grad: bool, call: Callable[[int], None], j: int) -> None:
    """``call(j)`` with the caller's grad mode (thread-local in torch)."""
    with torch.set_grad_enabled(grad):
        call(j)


def _wait(done: Future[None]) -> None:
    """Wait for the worker's pass; its error, if any, raised here."""
    done.result()
