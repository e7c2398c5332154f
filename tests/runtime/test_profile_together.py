"""Profiling ranks stay busy together (``profile.time_stages(..., together=True)``): a rank that
has timed its stages keeps computing untimed rounds until every rank has (so no rank's last
repetitions run alone, faster than they train), and a rank with nothing to time still takes
part in the signal instead of leaving the others waiting."""

from __future__ import annotations

from typing import Any

from flexpipe.ir.placement import Placement
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch_task

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def _timing(rank: int, world: int, reps: list[int], timed: list[bool]) -> list[Any]:
    """This rank's profiling rounds (timed and untimed) under ``time_stages(together=True)``."""
    from flexpipe.runtime.measurement import profile
    from flexpipe.runtime.transport import comm

    items, _, _ = profile._stages_of((TINY, Placement.linear(world), None), rank,
                                     comm.device())
    rounds = []
    real = profile._round

    def counted(*args: Any) -> dict[str, float]:
        if len(args) < 3:  # a hot round: one per repetition (on a CPU a cold one precedes it)
            rounds.append(1)
        return real(*args)

    profile._round = counted  # type: ignore[assignment]
    got = profile.time_stages(items if timed[rank] else [], reps[rank], together=True)
    return [len(rounds), len(got)]


def test_a_rank_that_finishes_first_keeps_computing_until_all_have() -> None:
    """Rank 0 times 1 repetition (3 rounds with the 2 warm-ups), rank 1 times 30: rank 0 runs
    untimed rounds while rank 1 still times, and both return their stages' figures."""
    first, second = launch_task(_timing, ([1, 30], [True, True]), 2, timeout_s=120)
    # the last rank may run a round or two more while the signal's all-reduce completes
    assert 32 <= second[0] <= 36 and second[1] == 1
    # rank 0's stage is about as fast as rank 1's: it kept computing for most of their 32
    assert first[1] == 1 and first[0] >= 16


def test_a_rank_with_nothing_to_time_does_not_leave_the_others_waiting() -> None:
    first, second = launch_task(_timing, ([2, 2], [True, False]), 2, timeout_s=120)
    assert first[1] == 1 and first[0] >= 4  # its 4 timed rounds (and no wait for rank 1)
    assert second == [0, 0]
