"""The schedule library's index: name -> ``Entry`` (the generator and the family's facts: its
placement, chunks, parameters, search grid, cost-awareness and memory closed form), the one
place the search, the planner and the commands read them from. Turning a spec (library name,
file, ``.py`` program, ``torch:NAME``) into a schedule is ``flexpipe.specs.load``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

Generator = Callable[..., Schedule]

ALIASES: dict[str, str] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved-1f1b",
    "loopedbfs": "bfs",
    "zbvzerobubble": "zb-v",
    "interleavedzerobubble": "torch:interleaved-zb",
    "dualpipev": "dualpipev",
}
"""torch.distributed.pipelining's and torchtitan's schedule names (``Interleaved1F1B``, also
with torch's class prefix ``ScheduleInterleaved1F1B``; any case) -> the FlexPipe spec that
runs it: a library name, or ``torch:NAME`` where the library has no equivalent."""


Params = tuple[tuple[str, object], ...]
PlacementRule = Callable[[int, Mapping[str, object]], Placement]
HeldRule = Callable[[int, int], int]


def linear(p: int, kw: Mapping[str, object]) -> Placement:
    """One stage per rank."""
    return Placement.linear(p)


def looped(p: int, kw: Mapping[str, object]) -> Placement:
    """``v`` chunks per rank, looped (interleaved)."""
    return Placement.interleaved(p, _int(kw, "v"))


def vshape(p: int, kw: Mapping[str, object]) -> Placement:
    """Two chunks per rank in a V (rank i holds stages i and 2p-1-i)."""
    return Placement.vshape(p)


def two_way(p: int, kw: Mapping[str, object]) -> Placement:
    """DualPipe's two directions: down stage s on rank s, up stage p+k on rank p-1-k."""
    from flexpipe.schedules.dualpipe_twoway import two_way_placement

    return two_way_placement(p)


def waves(p: int, kw: Mapping[str, object]) -> Placement:
    """``w`` waves: 2w chunks per rank in a zig-zag."""
    return Placement.zigzag(p, 2 * _int(kw, "w"))


def _int(kw: Mapping[str, object], key: str) -> int:
    value = kw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"parameter {key} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Entry:
    """A library schedule family and every fact about it that other layers need.

    ``fn(p, m, **params)`` generates it; ``params`` are its extra parameters (v, w, U, cost,
    ...) with their defaults; ``placement(p, params)`` is its stage -> rank layout; ``grid`` the
    parameter values the automated search tries (the first is the default); ``held(p, m)`` the
    micro-batches rank 0 provably holds at its peak (a closed form, docs/facts.md) when known, so a
    search can rule it out under a memory limit without building it."""

    name: str
    fn: Generator
    params: Params
    summary: str
    placement: PlacementRule = linear
    grid: tuple[tuple[str, tuple[object, ...]], ...] = ()
    held: HeldRule | None = None
    least_m: Callable[[int], int] | None = None
    """The fewest micro-batches the family is defined for at p ranks (None: any m >= 1);
    below it the generator raises ``InfeasibleError``."""
    ranks_ok: Callable[[int], bool] | None = None
    """Whether the family is defined at p ranks (None: any p; DualPipe: even p only)."""

    def builds(self, p: int, m: int) -> bool:
        """Whether the family is defined at (p, m) (``ranks_ok`` and ``least_m``)."""
        if self.ranks_ok is not None and not self.ranks_ok(p):
            return False
        return self.least_m is None or m >= self.least_m(p)

    @property
    def cost_aware(self) -> bool:
        """Whether the generator plans for a cost model (takes ``cost=``)."""
        return any(k == "cost" for k, _ in self.params)

    def placement_for(self, p: int, **params: object) -> Placement:
        """The placement for p ranks with ``params`` (defaults for the rest)."""
        given = {k: v for k, v in params.items() if v is not None}
        return self.placement(p, {**dict(self.params), **given})

    def chunks(self, p: int, **params: object) -> int:
        """Stages per rank."""
        return self.placement_for(p, **params).num_stages // p


def _entry(name: str, fn: Generator, *, placement: PlacementRule = linear,
           grid: tuple[tuple[str, tuple[object, ...]], ...] = (),
           held: HeldRule | None = None,
           least_m: Callable[[int], int] | None = None,
           ranks_ok: Callable[[int], bool] | None = None) -> Entry:
    sig = inspect.signature(fn)
    extra = tuple((k, p.default) for k, p in sig.parameters.items() if k not in ("p", "m"))
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    for key, values in grid:
        if key not in dict(extra) or not values:
            raise ConfigError(f"schedule {name!r}: search grid names {key!r}, which is not "
                              "one of its parameters, or gives no value")
    return Entry(name, fn, extra, doc, placement, grid, held, least_m, ranks_ok)


def _all_held(p: int, m: int) -> int:
    return m


def _two_units(p: int, m: int) -> int:
    """ZeroPP at its default unit U = p (the one the search builds): every rank runs the
    forwards of units 0 and 1 on all its chunks before unit 0's first backward, and its AG/RS
    ops move parameters only, so it holds min(m, 2p) micro-batches."""
    return min(m, 2 * p)


def _builtin() -> dict[str, Entry]:
    from flexpipe.schedules import classic, dualpipe, dualpipe_twoway, wave, zeropp
    from flexpipe.schedules import vshape as vs
    from flexpipe.schedules import zero_bubble as zb

    entries = (
        _entry("gpipe", classic.gpipe, held=_all_held),
        _entry("1f1b", classic.one_f_one_b, held=min),
        _entry("1f1b-recompute", classic.one_f_one_b_recompute,
               grid=(("selective", (False, True)),)),
        _entry("1f1b-offload", classic.one_f_one_b_offload),
        _entry("interleaved-1f1b", classic.interleaved_1f1b, placement=looped,
               grid=(("v", (2, 3, 4)),)),
        _entry("bfs", classic.looped_bfs, placement=looped, grid=(("v", (2, 4)),),
               held=_all_held),
        _entry("zb-h1", zb.zb_h1, held=min),
        _entry("zb-h2", zb.zb_h2, held=lambda p, m: min(2 * p - 1, m)),
        _entry("zb-v", zb.zb_v, placement=vshape),
        _entry("v-min", vs.v_min, placement=vshape),
        _entry("v-half", vs.v_half, placement=vshape),
        _entry("v-zb", vs.v_zb, placement=vshape),
        _entry("dualpipev", dualpipe.dualpipev, placement=vshape,
               least_m=lambda p: 2 * p),
        _entry("dualpipe", dualpipe_twoway.dualpipe, placement=two_way,
               least_m=lambda p: p, ranks_ok=lambda p: p % 2 == 0),
        _entry("hanayo", wave.hanayo, placement=waves, grid=(("w", (1, 2)),)),
        _entry("zeropp", zeropp.zeropp, placement=looped, held=_two_units),
    )
    return {e.name: e for e in entries}


_LIBRARY: dict[str, Entry] = {}


def library() -> Mapping[str, Entry]:
    """Every library schedule by name (read-only; add one with ``register``)."""
    if not _LIBRARY:
        _LIBRARY.update(_builtin())
    return MappingProxyType(_LIBRARY)


def register(name: str, fn: Generator, *, placement: PlacementRule = linear,
             grid: tuple[tuple[str, tuple[object, ...]], ...] = (),
             held: HeldRule | None = None) -> Entry:
    """Add a schedule family for the whole process: its generator ``fn(p, m, **params)`` and
    its facts (see ``Entry``). The search, the planner and every command then know it.
    Registering a name again is an error unless it is the same family."""
    entry = _entry(name.lower(), fn, placement=placement, grid=grid, held=held)
    old = library().get(entry.name)
    if old is not None and old != entry:
        raise ConfigError(f"schedule {name!r} is already registered")
    _LIBRARY[entry.name] = entry
    return entry


def names() -> list[str]:
    """Library schedule names, sorted."""
    return sorted(library())


def resolve(name: str) -> str:
    """``name`` with a torch/torchtitan alias (see ``ALIASES``) replaced by its FlexPipe spec;
    any other name unchanged."""
    key = name.lower()
    key = key[len("schedule"):] if key.startswith("schedule") else key
    return ALIASES.get(key, name)


def build(name: str, p: int, m: int, **params: object) -> Schedule:
    """Generate library schedule ``name`` (or a torch/torchtitan alias of one) for p ranks and
    m micro-batches; parameters the schedule does not take are ignored when None and rejected
    otherwise."""
    lib = library()
    key = resolve(name).lower()
    if key not in lib:
        raise ConfigError(f"unknown schedule {name!r}; known: {', '.join(sorted(lib))}")
    entry = lib[key]
    accepted = {k for k, _ in entry.params}
    given = {k: v for k, v in params.items() if v is not None}
    _check_args(name, p, m, given)
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ConfigError(f"schedule {name!r} takes no parameter {', '.join(unknown)}"
                          + (f" (it takes {', '.join(sorted(accepted))})" if accepted else ""))
    return entry.fn(p, m, **given)


def _check_args(name: str, p: object, m: object, given: dict[str, object]) -> None:
    """Positive integer p and m, and a ``CostModel`` for ``cost``, before any generator runs."""
    from flexpipe.cost.model import CostModel

    for what, value in (("p (ranks)", p), ("m (micro-batches)", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"schedule {name!r}: {what} must be a positive integer, "
                              f"got {value!r}")
    cost = given.get("cost")
    if cost is not None and not isinstance(cost, CostModel):
        raise ConfigError(f"schedule {name!r}: cost must be a cost model, got "
                          f"{type(cost).__name__}")
