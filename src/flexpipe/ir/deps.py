"""Resolve the dependencies of every op in a schedule from the kind registry: which ops must end
before each op may start. Shared by the validator, the simulator and the runtime."""

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
        self._gated: dict[Op, list[Op]] = defaultdict(list)
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

    def needs(self, op: Op) -> list[Op]:
        """Ops that must finish before ``op`` starts, including those gated onto it."""
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
        extra = self._gated.get(op)
        return out + extra if extra else out

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
