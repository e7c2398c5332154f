"""torch.distributed.pipelining's built-in schedules as FlexPipe schedules (``torch:NAME`` specs).

torch's schedule classes compute every rank's order (``pipeline_order``) in ``__init__``; they
read only a few attributes of their stages (stage count, group size and rank, sub-module), so
small stand-ins are enough: no process group, no model. Each compute action becomes an op
(torch F, I, W, B = FlexPipe F, B, W, BW; an ``OVERLAP_F_B`` becomes its two sub-actions as
an overlapped pair, ``flexpipe.ir.overlap``); torch's bookkeeping actions (``REDUCE_GRAD``)
and idle slots are dropped. The placement is torch's own stage -> rank mapping (looped, or V
for ZB-V and DualPipeV).

The order is taken as torch wrote it and then checked like any FlexPipe schedule, so a torch
order that is not a valid schedule fails with the validator's message. Known case (torch 2.13):
``Schedule1F1B.pipeline_order`` (used only for display; its runtime runs its own loop) skips
micro-batch 0 on the last rank and runs micro-batch m there instead; ``torch:1f1b`` reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.torch_csv import FROM_TORCH


@dataclass(frozen=True)
class TorchClass:
    """One of torch's schedule classes: its name in ``torch.distributed.pipelining.schedules``,
    the stages per rank it takes (None: any, default 2) and its stage layout."""

    cls: str
    chunks: int | None
    layout: str  # "loop" or "v"


CLASSES: dict[str, TorchClass] = {
    "gpipe": TorchClass("ScheduleGPipe", 1, "loop"),
    "1f1b": TorchClass("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": TorchClass("ScheduleInterleaved1F1B", None, "loop"),
    "bfs": TorchClass("ScheduleLoopedBFS", None, "loop"),
    "interleaved-zb": TorchClass("ScheduleInterleavedZeroBubble", None, "loop"),
    "zbv": TorchClass("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": TorchClass("ScheduleDualPipeV", 2, "v"),
}


class _Stub:
    """The attributes of a pipeline stage that torch's schedule constructors read."""

    def __init__(self, index: int, num_stages: int, p: int, rank: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = p
        self.group_rank = rank
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def names() -> list[str]:
    """The ``torch:`` schedule names, sorted."""
    return sorted(CLASSES)


def torch_schedule(name: str, p: int | None, m: int | None, **params: object) -> Schedule:
    """torch's built-in schedule ``name`` (see ``CLASSES``) for p ranks and m micro-batches as a
    validated FlexPipe ``Schedule``; ``v`` (stages per rank) for the classes that take any."""
    key = name.lower()
    if key not in CLASSES:
        raise ConfigError(f"unknown torch schedule 'torch:{name}'; known: "
                          + ", ".join(f"torch:{n}" for n in names()))
    entry = CLASSES[key]
    v = _chunks(name, entry, params)
    if not (_positive(p) and _positive(m)):
        raise ConfigError(f"torch schedule 'torch:{name}' needs -p and -m (positive integers), "
                          f"got p={p!r}, m={m!r}")
    order, stage_rank = _pipeline_order(entry, p, m, v)
    schedule = _to_schedule(order, stage_rank, p, m, f"torch:{key}")
    _check(schedule, entry)
    return schedule


def _positive(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _chunks(name: str, entry: TorchClass, params: dict[str, object]) -> int:
    given = {k: val for k, val in params.items() if val is not None}
    v = given.pop("v", None)
    if given:
        raise ConfigError(f"torch schedule 'torch:{name}' takes no parameter "
                          f"{', '.join(sorted(given))}")
    if v is None:
        return entry.chunks or 2
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"torch schedule 'torch:{name}': v must be a positive integer, "
                          f"got {v!r}")
    if entry.chunks is not None and v != entry.chunks:
        raise ConfigError(f"torch schedule 'torch:{name}' ({entry.cls}) runs exactly "
                          f"{entry.chunks} stage(s) per rank, not v={v}")
    return v


def _pipeline_order(entry: TorchClass, p: int, m: int,
                    v: int) -> tuple[dict[int, list[Any]], list[int]]:
    """torch's per-rank order and its stage -> rank mapping (as rank-0 sees them)."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as exc:
        raise ConfigError(f"torch schedules need PyTorch with torch.distributed.pipelining "
                          f"({exc})") from None
    cls = getattr(schedules, entry.cls, None)
    if cls is None:
        raise ConfigError(f"this torch has no {entry.cls}")
    stages = [_Stub(i, p * v, p, 0) for i in _rank0_stages(entry.layout, p, v)]
    try:
        obj = cls(stages[0], m) if entry.chunks == 1 else cls(stages, m)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ConfigError(f"torch's {entry.cls} rejects p={p}, m={m}, v={v}: {exc}") from None
    mapping = getattr(obj, "stage_index_to_group_rank", None) or {s: s for s in range(p)}
    return dict(obj.pipeline_order), [mapping[s] for s in range(p * v)]


def _rank0_stages(layout: str, p: int, v: int) -> list[int]:
    if layout == "v":
        return [0, 2 * p - 1]
    return [c * p for c in range(v)]


def _to_schedule(order: dict[int, list[Any]], stage_rank: Sequence[int], p: int, m: int,
                 name: str) -> Schedule:
    ranks = [[op for action in order.get(r, []) for op in _ops(action, r)] for r in range(p)]
    pairs = [(ops[0], ops[1]) for r in range(p) for action in order.get(r, [])
             if action is not None and action.sub_actions
             for ops in [_ops(action, r)] if len(ops) == 2]
    sched = Schedule.build(ranks, _placement(tuple(stage_rank), p), m, name=name)
    return sched.with_overlaps(pairs) if pairs else sched


def _placement(stage_rank: tuple[int, ...], p: int) -> Placement:
    """The named placement (looped or V / zig-zag) equal to torch's mapping, else explicit."""
    v = len(stage_rank) // p
    for named in (Placement.interleaved(p, v), Placement.zigzag(p, v)):
        if named.stage_rank == stage_rank:
            return named
    return Placement(stage_rank, p)


def _ops(action: Any, rank: int) -> list[Op]:
    """The compute ops of one torch action (none for an idle slot or a bookkeeping action)."""
    if action is None:
        return []
    if action.sub_actions:
        return [op for sub in action.sub_actions for op in _ops(sub, rank)]
    kind = FROM_TORCH.get(action.computation_type.value)
    if kind is None:
        return []
    return [Op(kind, action.stage_index, action.microbatch_index)]


def _check(schedule: Schedule, entry: TorchClass) -> None:
    from flexpipe.sim.validate import check

    try:
        check(schedule)
    except FlexPipeError as exc:
        raise ConfigError(f"torch's {entry.cls}.pipeline_order is not a valid schedule for "
                          f"p={schedule.num_ranks}, m={schedule.microbatches}:\n{exc}") from None
