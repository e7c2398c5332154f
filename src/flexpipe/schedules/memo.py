"""Remember the last few results of a pure, cost-aware generator: the search builds the same
construction several times for one input (adaptive V at 1F1B's memory is ZB-V's fourth try,
V-ZB's fifth and the search's own ``adaptive-v`` candidate), and ``search.frontier`` asks for
every library V-shape (ZB-V, V-Min, V-Half, V-ZB: each the best of many tries by simulation)
once per memory limit with the same cost model. Generators are pure functions of
their arguments and schedules are immutable, so a repeated call returns the same object; the
cost model is compared by value (its stages and links), not by identity."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

from flexpipe.cost.model import CONTEXTS, CostModel
from flexpipe.errors import InfeasibleError
from flexpipe.ir.schedule import Schedule

SIZE = 16
F = TypeVar("F", bound=Callable[..., Schedule])


def cost_key(cost: CostModel | None) -> object:
    """A hashable value that equals for equal cost models."""
    if cost is None:
        return None
    stages = tuple((tuple(sorted(st.times.items())), st.act, st.wact, st.input, st.params,
                    st.out_bytes, st.sr_act, st.sr_act_w,
                    *(tuple(sorted(getattr(st, t).items())) for t in CONTEXTS))
              for st in cost.stages)
    return stages, tuple(map(tuple, cost.comm.latency)), tuple(map(tuple, cost.comm.bandwidth)), \
        cost.comm.post, cost.edges


def remembered(fn: F) -> F:
    """``fn(p, m, cost=None, **kw)`` with its last ``SIZE`` outcomes kept: the schedule, or the
    ``InfeasibleError`` raised (re-raised when asked again: a memory ladder asks every rung
    below the limit, and the lowest rungs have no schedule); other errors are not kept."""
    kept: OrderedDict[object, Schedule | InfeasibleError] = OrderedDict()

    @wraps(fn)
    def call(p: int, m: int, cost: CostModel | None = None, **kw: object) -> Schedule:
        try:
            key = (p, m, cost_key(cost), tuple(sorted(kw.items())))
            hash(key)
        except TypeError:  # an argument that is not a value: no memo
            return fn(p, m, cost, **kw)
        if key not in kept:
            try:
                kept[key] = fn(p, m, cost, **kw)
            except InfeasibleError as exc:
                kept[key] = exc
            if len(kept) > SIZE:
                kept.popitem(last=False)
        kept.move_to_end(key)
        found = kept[key]
        if isinstance(found, InfeasibleError):
            raise found.with_traceback(None)
        return found

    return call  # type: ignore[return-value]
