"""Resolve the dependencies of every op in a schedule from the kind registry: which ops must end
before each op may start. Shared by the validator, the simulator and the runtime.

Gangs (``StageGraph.gangs``): an op of a gang stage also needs, for each peer op (same kind and
micro-batch on the gang's other stages), the op its rank runs just before the peer on the same
stream and everything the peer needs -- so every member is ready at the same moment and they all
start together, as a collective would. Inconsistent gang orders on two ranks become a cycle of
waits, which the simulator names as a deadlock."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from flexpipe.ir.kinds import KINDS, Gate, KindRegistry, Need
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


class DepIndex:
    """Dependencies of the ops of one schedule. ``needs(op)`` lists the ops that must finish first
    (they may be missing from the schedule: the validator reports that)."""

    def __init__(self, schedule: Schedule, registry: KindRegistry = KINDS) -> None:
        self.schedule = schedule
        self.registry = registry
        self.present: set[Op] = {op for rank in schedule.ranks for op in rank}
        self._mbs: dict[tuple[str, int], list[int]] = defaultdict(list)
        for op in sorted(self.present, key=lambda o: o.mb):
            self._mbs[(op.kind, op.stage)].append(op.mb)
        self._prev = _stream_prev(schedule, registry) if schedule.graph.gangs else {}
        self._gated: dict[Op, list[Op]] = defaultdict(list)
        self._own: dict[Op, tuple[Op, ...]] = {}
        for op in self.present:
            for gate in registry[op.kind].gates:
                for target in self._gate_targets(op, gate):
                    self._gated[target].append(op)

    def has(self, op: Op) -> bool:
        """Whether the schedule contains ``op``."""
        return op in self.present

    def run(self, kind: str, stage: int, mb: int) -> range:
        """Micro-batches from ``mb`` up to the next op of ``kind`` on ``stage`` (exclusive)."""
        mbs = self._mbs.get((kind, stage), [])
        i = bisect_right(mbs, mb)
        end = mbs[i] if i < len(mbs) else self.schedule.microbatches
        return range(mb, end)

    def needs(self, op: Op) -> tuple[Op, ...]:
        """Ops that must finish before ``op`` starts: its own (``own_needs``) and, on a gang
        stage, each peer's stream predecessor and needs (``gang_needs``)."""
        own = self.own_needs(op)
        return own + tuple(d for _peer, d in self.gang_needs(op)) if self._prev else own

    def peers(self, op: Op) -> list[Op]:
        """The ops that must start together with ``op`` (same kind and micro-batch on the other
        stages of its gang, when its kind is collective there), present or not; only compute
        ops form gangs (copies and communication run on their own streams)."""
        if op.kind not in self.registry or self.registry[op.kind].stream != "compute":
            return []
        return [Op(op.kind, t, op.mb) for t in self.schedule.graph.peers(op.stage, op.kind)]

    def stream_prev(self, op: Op) -> Op | None:
        """The compute op before ``op`` on its rank, for ops of gang stages (else None)."""
        return self._prev.get(op)

    def gang_needs(self, op: Op) -> list[tuple[Op, Op]]:
        """(peer, dep) pairs: each peer's stream predecessor on its rank and its own needs."""
        out: list[tuple[Op, Op]] = []
        for peer in self.peers(op):
            prev = self._prev.get(peer)
            if prev is not None:
                out.append((peer, prev))
            if peer in self.present:
                out += [(peer, d) for d in self.own_needs(peer)]
        return out

    def own_needs(self, op: Op) -> tuple[Op, ...]:
        """Ops that must finish before ``op`` starts by its kind's needs and gates alone
        (worked out once per op: the simulator's explicit path asks for them many times)."""
        known = self._own.get(op)
        if known is None:
            known = self._own[op] = self._own_needs(op)
        return known

    def _own_needs(self, op: Op) -> tuple[Op, ...]:
        out: list[Op] = []
        graph = self.schedule.graph
        for need in self.registry[op.kind].needs:
            stages = _stages(need, op.stage, graph.preds, graph.succs)
            mbs = self.run(op.kind, op.stage, op.mb) if need.span == "run" else (op.mb,)
            for stage in stages:
                for mb in mbs:
                    dep = self._pick(need, stage, mb)
                    if dep is not None:
                        out.append(dep)
        return tuple(out + self._gated.get(op, []))

    def _pick(self, need: Need, stage: int, mb: int) -> Op | None:
        for k in need.kinds:
            cand = Op(k, stage, mb)
            if cand in self.present:
                return cand
        return None if need.optional else Op(need.kinds[0], stage, mb)

    def _gate_targets(self, op: Op, gate: Gate) -> list[Op]:
        mbs = self.run(op.kind, op.stage, op.mb) if gate.span == "run" else (op.mb,)
        return [Op(k, op.stage, mb) for mb in mbs for k in gate.kinds
                if Op(k, op.stage, mb) in self.present]


def _stages(need: Need, stage: int, preds: tuple[tuple[int, ...], ...],
            succs: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    table = {"same": (stage,), "pred": preds[stage], "succ": succs[stage]}
    return table[need.where]


def _stream_prev(schedule: Schedule, registry: KindRegistry) -> dict[Op, Op]:
    """For each compute op of a gang stage: the compute op before it on its rank (if any)."""
    gang_of = schedule.graph.gang_of
    out: dict[Op, Op] = {}
    for ops in schedule.ranks:
        last: Op | None = None
        for op in ops:
            if op.kind in registry and registry[op.kind].stream == "compute":
                ganged = 0 <= op.stage < len(gang_of) and len(gang_of[op.stage]) > 1
                if last is not None and ganged:
                    out[op] = last
                last = op
    return out
