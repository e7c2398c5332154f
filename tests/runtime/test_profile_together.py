"""Profiling ranks stay busy together (``profile.time_stages(..., together=True)``): a rank that
has timed its stages keeps computing untimed rounds until every rank has (so no rank's last
repetitions run alone, faster than they train), a rank with nothing to time still takes
part in the signal instead of leaving the others waiting, and the cold rounds take turns, so
that no rank's cache eviction runs beside another's timed pass. Every assertion is on
what the ranks did in order (rounds counted, a file handshake between the ranks), never on
how many rounds a machine manages in some time: a busy machine passes as a quiet one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexpipe.ir.placement import Placement
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch_task

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def _timing(rank: int, world: int, reps: list[int], timed: list[bool],
            handshake: str = "", wanted: int = 0) -> list[Any]:
    """This rank's profiling rounds under ``time_stages(together=True)``, in order, each
    "hot" or "cold" (timed) or "busy" (untimed, while another rank times); how many stages it
    got figures for; the (start, end) of its evictions and of its timed passes
    (``time.monotonic``: one clock for every process of the host). With ``handshake`` (a
    file), rank 0 writes there how many untimed rounds it has run, and rank 1 starts its last
    hot round only once rank 0 has run ``wanted``: had rank 0 stopped computing when it
    finished its own timing, rank 1 would wait for ever (the launch's timeout fails it)."""
    import time

    from flexpipe.runtime.measurement import profile
    from flexpipe.runtime.transport import comm

    items, _, _ = profile._stages_of((TINY, Placement.linear(world), None), rank,
                                     comm.device())
    rounds: list[str] = []
    evictions: list[tuple[float, float]] = []
    passes: list[tuple[float, float]] = []
    phase: list[str] = []
    real_round, real_rounds, real_evictor = profile._round, profile._timed_rounds, profile.evictor
    real_busy = profile._stay_busy

    def stay_busy(items: Any) -> None:
        rounds.append("|")  # the rank has timed what it had to, for now
        real_busy(items)

    def timed_rounds(items: Any, reps: int, evict: Any) -> Any:
        phase.append("hot" if evict is None else "cold")
        try:
            return real_rounds(items, reps, evict)
        finally:
            phase.pop()

    def one_round(item: Any, now: Any, evict: Any = None) -> dict[str, float]:
        rounds.append(phase[-1] if phase else "busy")
        if handshake and rank == 0 and not phase:
            Path(handshake).write_text(str(rounds.count("busy")))
        if handshake and rank == 1 and rounds.count("hot") == reps[1] + 2:
            _wait_for(Path(handshake), wanted)
        return real_round(item, now, evict)

    def evictor(device: Any) -> Any:
        real = real_evictor(device)

        class Recorded:
            active = real.active

            def __call__(self) -> None:
                t0 = time.monotonic()
                real()
                evictions.append((t0, time.monotonic()))
        return Recorded()

    def clock(device: Any) -> Any:
        def now() -> float:
            t = time.monotonic()
            if phase and (not passes or passes[-1][1] >= 0):
                passes.append((t, -1.0))
            elif phase:
                passes[-1] = (passes[-1][0], t)
            return t
        return now

    profile._round, profile._timed_rounds = one_round, timed_rounds  # type: ignore[assignment]
    profile._stay_busy = stay_busy  # type: ignore[assignment]
    profile.evictor, profile.clock = evictor, clock  # type: ignore[assignment]
    got = profile.time_stages(items if timed[rank] else [], reps[rank], together=True)
    return [rounds, len(got), evictions, passes]


def _wait_for(path: Path, wanted: int) -> None:
    """Until the count rank 0 writes to ``path`` reaches ``wanted`` (no time limit here: the
    launch's timeout stops a rank that waits for ever)."""
    import time

    while not path.exists() or int(path.read_text() or 0) < wanted:
        time.sleep(0.01)


def _after_hot(rounds: list[str]) -> list[str]:
    """The untimed rounds a rank ran after its hot rounds, until every rank had timed its."""
    return "".join(r[0] for r in rounds).split("|")[1]


def test_a_rank_that_finishes_first_keeps_computing_until_all_have(tmp_path: Path) -> None:
    """Rank 0 times 1 repetition (3 rounds with the 2 warm-ups), rank 1 times 4 and holds its
    last hot round until rank 0 has run 5 untimed rounds: rank 0 keeps computing while rank 1
    still times (else the launch times out), and both return their stages' figures."""
    first, second = launch_task(_timing, ([1, 4], [True, True], str(tmp_path / "busy"), 5),
                                2, timeout_s=120)
    assert second[0].count("hot") == 6 and second[1] == 1
    assert first[1] == 1 and first[0].count("hot") == 3
    assert _after_hot(first[0]).count("b") >= 5


def test_a_rank_with_nothing_to_time_does_not_leave_the_others_waiting() -> None:
    first, second = launch_task(_timing, ([2, 2], [True, False]), 2, timeout_s=120)
    assert first[1] == 1 and first[0].count("hot") == 4  # its 4 timed rounds, no wait
    assert second[1] == 0 and set(second[0]) == {"|"}


def test_no_rank_evicts_the_caches_while_another_times_a_pass() -> None:
    """On a CPU the cold rounds take turns (``profile._cold_rounds``): an eviction writes
    twice the shared last-level cache, and beside another rank's timed pass it slowed that
    pass. Every pass is timed cold on its own rank's turn, the other running untimed."""
    ranks = launch_task(_timing, ([2, 2], [True, True]), 2, timeout_s=120)
    for mine, other in ((ranks[0], ranks[1]), (ranks[1], ranks[0])):
        # 2 cold rounds (no warm-up: the hot rounds ran before), 4 timed passes a round
        assert mine[0].count("cold") == 2 and len(mine[2]) == 8
        assert "busy" in other[0]
        for a, b in mine[2]:
            assert not any(a < d and c < b for c, d in other[3]), "an eviction overlapped"
