"""Remember the last few list-scheduler runs. The search and the library ask for the same run
several times (ZB-V's plain B > F > W list schedule is also the search's ``policy[vshape]``
candidate; a ``reserve="auto"`` run that falls back to "all" is the "all" candidate), and a run
is a pure function of its inputs. The placement, the policy and the graph are compared by
value; the cost model by identity (the search fits one per placement and passes that object
everywhere), and each entry keeps its cost model alive so that its id is not reused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from flexpipe.cost.model import CostModel
from flexpipe.errors import InfeasibleError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement

Orders = tuple[tuple[Op, ...], ...]
SIZE = 32


def _value(x: object, ranks: int) -> object:
    """A per-rank setting as a hashable value (one number for every rank as that number, as
    ``policy._per_rank`` reads it); raises TypeError for a function."""
    if callable(x):
        raise TypeError("a function is not a value")
    if isinstance(x, Sequence) and not isinstance(x, str):
        if len(x) == ranks and len(set(x)) == 1:
            return float(x[0])
        return tuple(x)
    return x


def run_key(placement: Placement, m: int, cost: CostModel, policy: Any,
            graph: StageGraph | None) -> tuple[object, ...] | None:
    """The key of a run of ``policy`` (a ``flexpipe.dsl.policy.Policy``, not imported: policy
    imports this module), None when some input is not a value (a priority or a per-rank
    function)."""
    if policy.priority is not None:
        return None
    try:
        n = placement.num_ranks
        knobs = (policy.prefer, policy.split, _value(policy.max_inflight, n),
                 _value(policy.mem_limit, n), policy.defer_w, policy.reserve,
                 _value(policy.max_ahead, n), policy.gang_wait)
        key = (placement, m, id(cost), knobs, graph)
        hash(key)
    except TypeError:
        return None
    return key


class _Runs:
    """The last ``SIZE`` runs: key -> (cost model, orders or the InfeasibleError raised)."""

    def __init__(self) -> None:
        self.kept: OrderedDict[object, tuple[CostModel, Orders | InfeasibleError]] = \
            OrderedDict()

    def get(self, key: object) -> Orders | None:
        """The remembered orders (None: not remembered); re-raises a remembered error."""
        if key is None or key not in self.kept:
            return None
        self.kept.move_to_end(key)
        found = self.kept[key][1]
        if isinstance(found, InfeasibleError):
            raise found.with_traceback(None)
        return found

    def put(self, key: object, found: Orders | InfeasibleError, cost: CostModel) -> None:
        """Remember a run's outcome (nothing when ``key`` is None)."""
        if key is None:
            return
        self.kept[key] = (cost, found)
        if len(self.kept) > SIZE:
            self.kept.popitem(last=False)


RUNS = _Runs()
