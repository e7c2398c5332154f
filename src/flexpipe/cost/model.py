"""The cost model: per-stage times and memory, and point-to-point communication between ranks.

Times are in any unit the user picks (the papers use ms); memory in any unit (bytes, or M_B).
``time(stage, key)`` is what op kinds' ``time`` formulas read: keys F, B, W, BW (default B + W),
R (default F) and any extra key a new op kind declares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexpipe.errors import ConfigError
from flexpipe.ir.overlap import COMM_SHARE, HIDE_SHARE

MEM_KEYS = ("act", "wact", "input", "params")
CONTEXTS = ("cold", "fused", "after_w")
"""A stage's tables of times by context (``StageCost``)."""
DEFAULT_TIME = {"BW": ("B", "W"), "R": ("F",)}
SR_SHARE = 0.3
"""The share of M_B that selective recompute drops where a stage's ``sr_act`` is not given: the
attention core's (Korthikanti et al. 2022). A profile measures it (``sr_act``)."""
SR_KEYS = ("sr_act", "sr_act_w")
"""A stage's measured memory under selective recompute (``StageCost``)."""
SHARE_KEYS = (HIDE_SHARE,)
"""Time keys that hold a share (within [0, 1]), not a time: scaling a stage leaves them as
they are (``StageCost.map_times``) and merging stages weighs them (``merge_stages``)."""


def _check(name: str, value: object, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or (math.isinf(value) and not allow_inf) or value < 0:
        raise ConfigError(f"{name} must be a finite non-negative number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage for one micro-batch: ``times`` by key, activation memory held after F
    (``act`` = M_B), after B until W (``wact`` = M_W), the stage input kept for recompute
    (``input``), parameter memory (``params``) and bytes sent to each consumer (``out_bytes``);
    ``sr_act``: the activation memory held after a forward marked for selective recompute (SR
    drops the rest of ``act`` and recomputes it; None: ``1 - SR_SHARE`` of ``act``), measured
    by a profile under the model's ``Recompute`` policy, of a micro-batch whose backward is
    fused (BW); ``sr_act_w`` of one whose backward is split (B, W: its forward records the
    inputs of the weight layers for W, which SR then keeps; None: ``sr_act``). The times of
    a pass in three contexts (where the simulator gives them:
    ``flexpipe.sim.compile``; all three profiled, see
    ``flexpipe.runtime.measurement.profile``); a key a table lacks takes its ``times`` value:

    - ``cold``: a pass that finds none of this stage's data in the caches, another stage having
      run on its rank since (``switched_time``; profiled on a CPU, see
      ``flexpipe.runtime.measurement.caches``);
    - ``fused``: a pass of a micro-batch whose backward is fused (one BW, no B): its forward
      records nothing for W;
    - ``after_w``: a pass that directly follows its own stage's W on the rank: W reads the
      activations and output gradients, not the weights a forward reads.

    ``timer(context)`` reads them."""

    times: Mapping[str, float]
    act: float = 1.0
    wact: float = 1.0
    input: float = 0.0
    params: float = 0.0
    out_bytes: float = 0.0
    cold: Mapping[str, float] = field(default_factory=dict)
    fused: Mapping[str, float] = field(default_factory=dict)
    after_w: Mapping[str, float] = field(default_factory=dict)
    sr_act: float | None = None
    sr_act_w: float | None = None

    def __post_init__(self) -> None:
        times = {str(k): _check(f"time {k!r}", v) for k, v in dict(self.times).items()}
        for key in ("F", "B", "W"):
            if key not in times:
                raise ConfigError(f"stage cost needs time {key!r} (has {sorted(times)})")
        object.__setattr__(self, "times", times)
        for table in CONTEXTS:
            object.__setattr__(self, table, {
                str(k): _check(f"{table} time {k!r}", v)
                for k, v in dict(getattr(self, table)).items()})
        for key in (*MEM_KEYS, "out_bytes"):
            object.__setattr__(self, key, _check(key, getattr(self, key)))
        for key in SR_KEYS:
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, _check(key, value))
                if value > self.act:
                    raise ConfigError(f"{key} ({value:g}) must be at most act ({self.act:g}): "
                                      "selective recompute keeps part of M_B")

    def map_times(self, fn: Callable[[float], float]) -> StageCost:
        """This stage with ``fn`` applied to every time, in every context (a share,
        ``SHARE_KEYS``, is not a time: it stays)."""

        def mapped(table: Mapping[str, float]) -> dict[str, float]:
            return {k: v if k in SHARE_KEYS else fn(v) for k, v in table.items()}

        tables: dict[str, Any] = {t: mapped(getattr(self, t)) for t in CONTEXTS}
        return replace(self, times=mapped(self.times), **tables)

    def time(self, key: str) -> float:
        """Time of ``key``; BW defaults to B + W and R to F."""
        if key in self.times:
            return self.times[key]
        if key in DEFAULT_TIME:
            return sum(self.times[k] for k in DEFAULT_TIME[key])
        raise ConfigError(f"cost model has no time {key!r} (has {sorted(self.times)})")

    def switched_time(self, key: str) -> float:
        """Time of ``key`` after another stage's pass on the rank: its ``cold`` time;
        a derived key (BW, R) from the cold times of its parts; else ``time(key)``."""
        return self._from(self.cold, key)

    def timer(self, context: str | None) -> Callable[[str], float]:
        """``time`` in ``context``, one of ``CONTEXTS`` (None: ``time``): the context's time
        where its table has the key, a derived key (BW, R) from its parts' there, else
        ``time(key)``."""
        if context is None:
            return self.time
        table = getattr(self, context)
        return lambda key: self._from(table, key)

    def _from(self, table: Mapping[str, float], key: str) -> float:
        if key in table:
            return table[key]
        if key not in self.times and key in DEFAULT_TIME:
            return sum(self._from(table, k) for k in DEFAULT_TIME[key])
        return self.time(key)

    def has_time(self, key: str) -> bool:
        """Whether ``time(key)`` is defined (given, or derived by default)."""
        return key in self.times or key in DEFAULT_TIME

    def sr_kept(self, split: bool = False) -> float:
        """M_B held after a forward marked for SR: ``sr_act`` (``split``: ``sr_act_w``, else
        ``sr_act``), or ``1 - SR_SHARE`` of act."""
        got = self.sr_act_w if split and self.sr_act_w is not None else self.sr_act
        return (1.0 - SR_SHARE) * self.act if got is None else got

    def mem(self, qty: str) -> float:
        """Memory quantity ``qty``: one of act, wact, input, params, or what SR drops after
        its forward and recomputes before the backward, ``act - sr_kept()``: ``sr`` for a
        micro-batch whose backward is fused, ``sr_w`` for a split one."""
        if qty in ("sr", "sr_w"):
            return self.act - self.sr_kept(qty == "sr_w")
        if qty not in MEM_KEYS:
            raise ConfigError(f"unknown memory quantity {qty!r} (known: "
                              f"{', '.join((*MEM_KEYS, 'sr', 'sr_w'))})")
        return float(getattr(self, qty))


@dataclass(frozen=True)
class Comm:
    """Point-to-point transfer time ``latency[a][b] + bytes / bandwidth[a][b]`` from rank a to b;
    a hand-over on the same rank costs nothing. Matrices need not be symmetric. The simulator
    serializes transfers on one directed link (``link``: its occupancy and latency).

    ``post``: the time a rank's compute thread spends posting one transfer, a send or a
    receive, in which it computes nothing (0: the host runs ahead of the device, as under
    NCCL; on a CPU under gloo the same thread posts and computes). The simulator charges it
    where the lowering puts the send and receive ops: a send's after the op that makes its
    data, a receive's before the op it gates (``flexpipe.sim.compile``)."""

    latency: tuple[tuple[float, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]
    post: float = 0.0
    _table: dict[tuple[int, int], tuple[float, float]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.latency)
        if len(self.bandwidth) != n or any(len(r) != n for r in (*self.latency, *self.bandwidth)):
            raise ConfigError(f"latency and bandwidth must both be {n}x{n} matrices")
        table = {}
        for a in range(n):
            for b in range(n):
                lat = _check(f"latency[{a}][{b}]", self.latency[a][b])
                bw = _check(f"bandwidth[{a}][{b}]", self.bandwidth[a][b], allow_inf=True)
                if a != b and bw == 0:
                    raise ConfigError(f"bandwidth[{a}][{b}] must be positive")
                table[(a, b)] = (lat, bw)
        object.__setattr__(self, "_table", table)
        _check("post", self.post)

    @property
    def num_ranks(self) -> int:
        """Ranks the matrices cover."""
        return len(self.latency)

    @staticmethod
    def uniform(num_ranks: int, latency: float = 0.0, bandwidth: float = math.inf,
                post: float = 0.0) -> Comm:
        """The same link between every pair of ranks."""
        lat = _check("latency", latency)
        bw = _check("bandwidth", bandwidth, allow_inf=True)
        return Comm(tuple(tuple(lat for _ in range(num_ranks)) for _ in range(num_ranks)),
                    tuple(tuple(bw for _ in range(num_ranks)) for _ in range(num_ranks)), post)

    def time(self, src: int, dst: int, nbytes: float) -> float:
        """Transfer time of ``nbytes`` from rank ``src`` to rank ``dst``."""
        lat, busy = self.link(src, dst, nbytes)
        return lat + busy

    def link(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """(latency, occupancy) of ``nbytes`` from rank ``src`` to rank ``dst``: the link is busy
        for ``nbytes / bandwidth`` (0 with infinite bandwidth or on the same rank) and the data
        arrives ``latency`` after it leaves the link."""
        if src == dst:
            return 0.0, 0.0
        try:
            lat, bw = self._table[(src, dst)]
        except KeyError:
            raise ConfigError(f"no link from rank {src} to rank {dst} in the cost model") from None
        return lat, (nbytes / bw if bw != math.inf else 0.0)


@dataclass(frozen=True)
class Edge:
    """What one micro-batch moves over the stage-graph edge ``producer -> consumer``: the bytes
    sent forward (``data``: less than the producer's ``out_bytes`` when the consumer reads some
    of its outputs), the gradients coming back (``grad``: none for a value no parameter depends
    on, such as an attention mask), and the bytes of what it sends that the consumer's forward
    keeps for its backward (``kept``). On one rank nothing is copied: those are the producer's
    own outputs, which it keeps until its B anyway, so the consumer's M_B there is ``kept``
    less (``CostModel.mem_on``). ``kept_w``: the bytes of it that the consumer's W still holds
    after its B (the inputs of its weight layers): on one rank, counted in the consumer's M_W
    while the producer's M_B holds them too, so the simulator counts them once until the
    producer's B or the consumer's W (``flexpipe.sim.memory``)."""

    producer: int
    consumer: int
    data: float
    grad: float
    kept: float = 0.0
    kept_w: float = 0.0

    def __post_init__(self) -> None:
        for key in ("producer", "consumer"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"edge {key} must be a stage index, got {value!r}")
        for key in ("data", "grad", "kept", "kept_w"):
            object.__setattr__(self, key, _check(f"edge {key}", getattr(self, key)))


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs plus the communication model; ``edges`` the stage-graph edges that
    carry less than their producer's ``out_bytes`` (every other edge carries it, both ways)."""

    stages: tuple[StageCost, ...]
    comm: Comm
    edges: tuple[Edge, ...] = ()
    _sent: dict[tuple[int, int], Edge] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError("a cost model needs at least one stage")
        sent = {}
        for e in self.edges:
            for s in (e.producer, e.consumer):
                self.stage(s)  # names a stage the model lacks
            sent[(e.producer, e.consumer)] = e
        object.__setattr__(self, "_sent", sent)

    def sent(self, producer: int, consumer: int, grad: bool = False) -> float:
        """Bytes of one micro-batch on the edge ``producer -> consumer``: the forward data, or
        (``grad``) the gradients sent back."""
        edge = self._sent.get((producer, consumer))
        if edge is None:
            return self.stage(producer).out_bytes
        return edge.grad if grad else edge.data

    def hop(self, src: int, dst: int, forward: bool) -> float:
        """Bytes a transfer from stage ``src`` to stage ``dst`` carries: the forward data on
        the edge ``src -> dst`` (``forward``), or the gradients going back on ``dst -> src``."""
        return self.sent(src, dst) if forward else self.sent(dst, src, grad=True)

    def mem_on(self, s: int, qty: str, stage_rank: Sequence[int]) -> float:
        """Memory quantity ``qty`` of stage ``s`` placed by ``stage_rank``: its M_B (``act``)
        without what it keeps of its producers on the same rank (``Edge.kept``: the
        producer's outputs, counted by the producer)."""
        own = self.stage(s).mem(qty)
        if qty != "act":
            return own
        local = sum(e.kept for e in self.edges
                    if e.consumer == s and stage_rank[e.producer] == stage_rank[s])
        return max(own - local, 0.0)

    @property
    def num_stages(self) -> int:
        """Stages described."""
        return len(self.stages)

    def stage(self, s: int) -> StageCost:
        """Costs of stage ``s``, with a clear error for a stage the model lacks."""
        if not 0 <= s < len(self.stages):
            raise ConfigError(f"cost model describes stages 0..{len(self.stages) - 1}, not {s}")
        return self.stages[s]

    def check_fits(self, num_stages: int, num_ranks: int) -> None:
        """Raise unless this model covers ``num_stages`` stages and ``num_ranks`` ranks."""
        if self.num_stages != num_stages:
            raise ConfigError(
                f"cost model describes {self.num_stages} stages, the schedule has {num_stages}")
        if self.comm.num_ranks < num_ranks:
            raise ConfigError(
                f"cost model's links cover {self.comm.num_ranks} ranks, "
                f"the schedule has {num_ranks}")

    def with_comm(self, comm: Comm) -> CostModel:
        """A copy with another communication model."""
        return replace(self, comm=comm)

    @staticmethod
    def uniform(num_stages: int, num_ranks: int, *, f: float = 1.0, b: float = 1.0,
                w: float = 1.0, act: float = 1.0, wact: float = 1.0, comm: float = 0.0,
                extra: Mapping[str, float] | None = None) -> CostModel:
        """Every stage alike; ``comm`` is the fixed time of one cross-rank transfer."""
        times = {"F": f, "B": b, "W": w, **(extra or {})}
        stage = StageCost(times, act=act, wact=wact, input=act / 8)
        return CostModel((stage,) * num_stages, Comm.uniform(num_ranks, comm))

    @staticmethod
    def per_rank(stage_rank: Sequence[int], num_ranks: int, *, f: float = 1.0, b: float = 1.0,
                 w: float = 1.0, act: float = 1.0, wact: float = 1.0,
                 comm: float = 0.0) -> CostModel:
        """A rank's work is (f, b, w) and (act, wact), split evenly over the stages it holds:
        the convention of the papers' unit-cost figures for interleaved and V-shape schedules."""
        counts = [0] * num_ranks
        for r in stage_rank:
            counts[r] += 1
        stages = []
        for r in stage_rank:
            k = counts[r]
            stages.append(StageCost({"F": f / k, "B": b / k, "W": w / k}, act=act / k,
                                    wact=wact / k, input=act / (8 * k)))
        return CostModel(tuple(stages), Comm.uniform(num_ranks, comm))


def hideable(st: StageCost) -> float:
    """The communication of ``st``'s backward, what a pair with its backward in it can hide
    (``COMM_SHARE`` of BW, or of B and W: the larger where both are given; 0 without)."""
    split = sum(st.times.get(COMM_SHARE.format(k), 0.0) for k in ("B", "W"))
    return max(split, st.times.get(COMM_SHARE.format("BW"), 0.0))


def merged_share(stages: Sequence[StageCost], key: str) -> float:
    """Share ``key`` (``SHARE_KEYS``) of ``stages`` merged into one: each part's share (1, the
    default, where a part lacks it) weighed by its hideable time (``hideable``); the plain mean
    where no part has any."""
    shares = [st.times.get(key, 1.0) for st in stages]
    weights = [hideable(st) for st in stages]
    if not sum(weights):
        return sum(shares) / len(shares)
    return sum(v * w for v, w in zip(shares, weights, strict=True)) / sum(weights)


def merge_stages(stages: Sequence[StageCost]) -> StageCost:
    """Consecutive stages (or layers) as one stage: times and memory add up, a share
    (``SHARE_KEYS``) is weighed (``merged_share``); the first one's input and the last one's
    output cross the merged stage's boundaries."""
    if not stages:
        raise ConfigError("cannot merge an empty run of layers into a stage")
    keys = set().union(*(st.times for st in stages))

    def total(key: str, context: str | None) -> float:
        if key in SHARE_KEYS:
            return merged_share(stages, key)
        return sum(st.timer(context)(key) for st in stages)

    # each context for every part at once (the merged stage's data all cold together)
    tables: dict[str, Any] = {t: {k: total(k, t)
                                  for k in set().union(*(getattr(st, t) for st in stages))}
                              for t in CONTEXTS}
    sr: dict[str, Any] = {key: None if all(getattr(st, key) is None for st in stages)
                          else sum(st.sr_kept(key == "sr_act_w") for st in stages)
                          for key in SR_KEYS}
    return StageCost({k: total(k, None) for k in keys},
                     act=sum(st.act for st in stages), wact=sum(st.wact for st in stages),
                     input=stages[0].input, params=sum(st.params for st in stages),
                     out_bytes=stages[-1].out_bytes, **sr, **tables)
