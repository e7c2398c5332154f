"""Which devices run the pipeline, in which order (a path: rank r runs on device ``path[r]``).

Small clusters: every ordered selection of devices (exact). Large clusters: paths that keep
consecutive stages on fast links, scored by the round-trip time of a typical boundary message
(bottleneck first, then the sum): greedy nearest-neighbour paths from every start device,
improved by 2-opt (reversing a segment), plus the index order; each also backwards, since
links score alike both ways but the last stage (the head) is often the heaviest and should land
on a fast device.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import permutations

from flexpipe.plan.problem import Cluster

BOTTLENECK_WEIGHT = 4.0


def all_paths(n: int, lengths: range) -> Iterator[tuple[int, ...]]:
    """Every ordered selection of ``k`` of ``n`` devices for each k in ``lengths``."""
    for k in lengths:
        yield from permutations(range(n), k)


def count_paths(n: int, k: int) -> int:
    """How many ordered selections of k of n devices there are."""
    out = 1
    for i in range(k):
        out *= n - i
    return out


def path_cost(cluster: Cluster, path: tuple[int, ...], nbytes: float) -> float:
    """Round trips of ``nbytes`` along the path: weighted bottleneck plus the sum."""
    trips = [cluster.round_trip(a, b, nbytes)
             for a, b in zip(path, path[1:], strict=False)]
    return BOTTLENECK_WEIGHT * max(trips, default=0.0) + sum(trips)


def _greedy(cluster: Cluster, start: int, nbytes: float) -> tuple[int, ...]:
    path, left = [start], set(range(cluster.size)) - {start}
    while left:
        here = path[-1]
        nxt = min(left, key=lambda d: (cluster.round_trip(here, d, nbytes), d))
        path.append(nxt)
        left.remove(nxt)
    return tuple(path)


def two_opt(cluster: Cluster, path: tuple[int, ...], nbytes: float,
            rounds: int = 4) -> tuple[int, ...]:
    """Reverse segments while that lowers ``path_cost`` (at most ``rounds`` sweeps)."""
    best, cost = path, path_cost(cluster, path, nbytes)
    for _ in range(rounds):
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 2, len(best) + 1):
                cand = best[:i] + best[i:j][::-1] + best[j:]
                c = path_cost(cluster, cand, nbytes)
                if c < cost - 1e-12:
                    best, cost, improved = cand, c, True
        if not improved:
            break
    return best


def heuristic_paths(cluster: Cluster, nbytes: float, keep: int = 3) -> list[tuple[int, ...]]:
    """The ``keep`` best distinct full-length paths (index order always among them), each
    followed by its reverse."""
    n = cluster.size
    pool = {tuple(range(n))}
    for start in range(n):
        pool.add(_greedy(cluster, start, nbytes))
    ranked = sorted(pool, key=lambda p: path_cost(cluster, p, nbytes))
    improved = {two_opt(cluster, p, nbytes) for p in ranked[:keep]}
    ranked = sorted(improved | set(ranked[:keep]), key=lambda p: path_cost(cluster, p, nbytes))
    out = ranked[:keep]
    out = out if tuple(range(n)) in out else [*out, tuple(range(n))]
    return list(dict.fromkeys(x for p in out for x in (p, p[::-1])))
