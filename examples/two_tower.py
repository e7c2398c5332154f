"""Schedules for a two-tower (CLIP-like) model: an image tower and a text tower meeting in a
contrastive loss, a stage graph with a join. With p=3 each tower has a rank and the join the
last; with p=4 the image tower is cut over ranks 0 and 1. The list scheduler orders each rank
(1F1B-like warm-up; ``split=true`` gives the zero-bubble-like B/W split). Try:

    flexpipe show examples/two_tower.py -p 3 -m 4
    flexpipe run examples/two_tower.py -p 4 -m 8 --model clip --param split=true
"""

from flexpipe.dsl import Placement
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.schedule import Schedule

# p -> (stage graph edges, micro-batches a rank may begin ahead of its backward)
LAYOUTS = {
    3: (((0, 2), (1, 2)), (2, 2, 1)),  # image 0, text 1, join 2
    4: (((0, 1), (1, 3), (2, 3)), (3, 2, 2, 1)),  # image 0 -> 1, text 2, join 3
}


def schedule(p: int, m: int, split: bool = False) -> Schedule:
    if p not in LAYOUTS:
        raise ValueError(f"two-tower layouts exist for p=3 and p=4, not p={p}")
    edges, ahead = LAYOUTS[p]
    prefer = ("B", "F", "W") if split else ("B", "F")
    policy = Policy(prefer=prefer, split=split, max_ahead=ahead)
    return policy_schedule(Placement.linear(p), m, policy, graph=StageGraph(p, edges),
                           name=f"two-tower-{'zb' if split else '1f1b'}")
