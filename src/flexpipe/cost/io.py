"""Cost model files: load a ``CostModel`` from JSON or TOML, save one as JSON.

Format (every key optional unless said; JSON shown, TOML has the same tables)::

    {
      "description": "any text",
      "num_stages": 4,                 # needed when "stages" is absent (or pass num_stages)
      "num_ranks": 4,                  # ranks the links cover (default: num_ranks, or stages)
      "default": {"F": 1.0, "B": 1.0, "W": 0.8, "act": 1.0, "wact": 0.5},
      "stages": [{"F": 1.2}, {}, {}, {"F": 1.5, "params": 2.0}],
      "comm": {"latency": 0.01, "bandwidth": 1e6},
      "edges": [{"from": 0, "to": 2, "bytes": 512, "grad_bytes": 0}]
    }

- ``default`` holds stage fields every stage starts from; ``stages`` lists one table per stage
  whose fields override the default. Stage fields: times -- ``F``, ``B``, ``W`` (required,
  from the stage or the default), ``BW`` (default B + W), ``R`` (default F) and any other
  upper-case key an op kind reads -- and memory: ``act`` (M_B, default 1), ``wact`` (M_W,
  default 1), ``input`` (stage input kept for recompute, default 0), ``params`` (default 0),
  ``out_bytes`` (bytes sent to each consumer, default 0), ``sr_act`` (M_B held after a forward
  marked for selective recompute whose backward is fused, at most ``act``; default 70% of
  ``act``: a profile measures it under the model's ``Recompute`` policy), ``sr_act_w`` (the
  same for a split backward, whose forward records what W reads; default ``sr_act``). All
  finite and non-negative.
  Three tables of times by context, each a key not given taking the plain time: ``cold``
  (``{"F": 1.3, "B": 1.4}``), passes that follow another stage's pass on their rank, with the
  caches cold; ``fused`` (``{"F": 0.97}``), passes of a micro-batch whose backward is fused
  (BW), whose forward records nothing for W; ``after_w`` (``{"F": 1.03}``), passes right
  after their own stage's W (``flexpipe.cost.model.StageCost``).
- ``comm``: ``latency`` and ``bandwidth``, each one number for every pair of ranks or a
  num_ranks x num_ranks matrix (list of lists, row = sender; need not be symmetric). A transfer
  from rank a to b takes ``latency[a][b] + out_bytes / bandwidth[a][b]``; bandwidth may be
  ``"inf"`` (the default) and must be positive off the diagonal. Default latency 0.
- ``edges``: stage-graph edges that carry less than their producer's ``out_bytes`` (a consumer
  reading some of its producer's outputs): ``from`` and ``to`` (stage indices), ``bytes``
  (sent forward), ``grad_bytes`` (gradients sent back; default ``bytes``) and ``kept_bytes``
  (bytes of what it sends that the consumer's forward keeps for its backward; default 0: on
  one rank those are the producer's own outputs, so the consumer's ``act`` there is that much
  less) and ``kept_w_bytes`` (of those, what the consumer's W still holds after its B; default
  0). Every other edge carries ``out_bytes`` both ways; ``flexpipe run --cost-out`` writes
  the measured ones.
- ``transformer``: instead of ``default``/``stages``, the fields of
  ``flexpipe.cost.transformer.TransformerSpec`` (layers, hidden, heads, seq, micro_batch, vocab,
  device_flops, efficiency, num_stages, layers_per_stage, num_ranks, latency_ms,
  bandwidth_gbs, tp, tp_bandwidth_gbs); a ``comm`` table next to it replaces the spec's uniform
  link.

Units are the user's (the papers use ms and bytes; the transformer model uses exactly those).
Every problem raises ``ConfigError`` naming the file and the key path, e.g.
``cost.json: stages[3].F: must be a finite non-negative number, got -1``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexpipe.cost import checks as ck
from flexpipe.cost.model import CONTEXTS, SR_KEYS, Comm, CostModel, Edge, StageCost
from flexpipe.cost.transformer import MAX_COUNT, TransformerSpec, field_names, spec_cost
from flexpipe.errors import ConfigError

TOP_KEYS = ("description", "num_stages", "num_ranks", "default", "stages", "comm", "edges",
            "transformer")
EDGE_KEYS = ("from", "to", "bytes", "grad_bytes", "kept_bytes", "kept_w_bytes")
MEM_FIELDS = ("act", "wact", "input", "params", "out_bytes", *SR_KEYS)
TIME_HINTS = ("F", "B", "W", "BW", "R")
COMM_KEYS = ("latency", "bandwidth", "post")
REQUIRED_SPEC = ("layers", "hidden", "heads", "seq")
TIME_KEY = re.compile(r"[A-Z][A-Z0-9_]*\Z")


def load_cost(path: str | Path, num_stages: int | None = None,
              num_ranks: int | None = None) -> CostModel:
    """Read a ``.json`` or ``.toml`` cost file; ``num_stages``/``num_ranks`` are the schedule's
    (checked against the file, and used where the file leaves them open)."""
    path = Path(path)
    if path.suffix.lower() not in (".json", ".toml"):
        raise ConfigError(f"{path}: unknown cost file type {path.suffix!r} (expected .json or "
                          f".toml)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read cost file ({exc})") from None
    data = ck.read_data(text, path.suffix.lower(), str(path))
    return cost_from_dict(data, num_stages, num_ranks, source=str(path))


def save_cost(cost: CostModel, path: str | Path) -> None:
    """Write ``cost`` as a JSON cost file that ``load_cost`` reads back equal."""
    path = Path(path)
    if path.suffix.lower() == ".toml":
        raise ConfigError(f"{path}: save_cost writes JSON; use a .json path")
    try:
        path.write_text(json.dumps(cost_to_dict(cost), indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write cost file ({exc})") from None


def cost_to_dict(cost: CostModel) -> dict[str, Any]:
    """The file form of ``cost``: every stage in full; a uniform link as plain numbers."""
    stages = []
    for st in cost.stages:
        table: dict[str, Any] = dict(st.times)
        table.update({k: getattr(st, k) for k in MEM_FIELDS if getattr(st, k) is not None})
        table.update({t: dict(getattr(st, t)) for t in CONTEXTS if getattr(st, t)})
        stages.append(table)
    comm = {"latency": _matrix_out(cost.comm.latency),
            "bandwidth": _matrix_out(cost.comm.bandwidth)}
    if cost.comm.post:
        comm["post"] = cost.comm.post
    out = {"num_stages": cost.num_stages, "num_ranks": cost.comm.num_ranks, "stages": stages,
           "comm": comm}
    if cost.edges:
        out["edges"] = [{"from": e.producer, "to": e.consumer, "bytes": e.data,
                         "grad_bytes": e.grad, "kept_bytes": e.kept, "kept_w_bytes": e.kept_w}
                        for e in cost.edges]
    return out


def _matrix_out(matrix: tuple[tuple[float, ...], ...]) -> Any:
    flat = {v for row in matrix for v in row}
    values: Any = next(iter(flat)) if len(flat) == 1 else [list(row) for row in matrix]
    return _inf_out(values)


def _inf_out(value: Any) -> Any:
    if isinstance(value, list):
        return [_inf_out(v) for v in value]
    return "inf" if value == math.inf else value


def cost_from_dict(data: Any, num_stages: int | None = None, num_ranks: int | None = None, *,
                   source: str = "cost") -> CostModel:
    """Build a ``CostModel`` from the file form (see the module docstring); ``source`` names
    the file in error messages."""
    top = ck.table(data, source, "")
    ck.known(top, TOP_KEYS, source, "")
    if "transformer" in top:
        return _from_transformer(top, num_stages, num_ranks, source)
    stages = _stages(top, num_stages, source)
    comm = _comm(top.get("comm"), _rank_count(top, num_ranks, len(stages), source), source)
    return CostModel(stages, comm, _edges(top.get("edges"), len(stages), source))


def _edges(raw: Any, num_stages: int, source: str) -> tuple[Edge, ...]:
    """The ``edges`` list: each a table naming two stages and the bytes between them."""
    if raw is None:
        return ()
    out = []
    for k, item in enumerate(ck.tables(raw, source, "edges", "edge", num_stages ** 2)):
        where = f"edges[{k}]"
        tab = ck.table(item, source, where)
        ck.known(tab, EDGE_KEYS, source, where)
        ends = [ck.count(tab.get(key), source, f"{where}.{key}", num_stages - 1, 0)
                for key in ("from", "to")]
        data = ck.nonneg(tab.get("bytes"), source, f"{where}.bytes")
        grad = ck.nonneg(tab.get("grad_bytes", data), source, f"{where}.grad_bytes")
        kept = ck.nonneg(tab.get("kept_bytes", 0.0), source, f"{where}.kept_bytes")
        kept_w = ck.nonneg(tab.get("kept_w_bytes", 0.0), source, f"{where}.kept_w_bytes")
        out.append(Edge(ends[0], ends[1], data, grad, kept, kept_w))
    return tuple(out)


# --- stages -----------------------------------------------------------------------------------

def _stages(top: Mapping[str, Any], num_stages: int | None, source: str) -> tuple[StageCost, ...]:
    default = _stage_fields(top.get("default", {}), source, "default")
    raw = top.get("stages")
    if raw is not None and (isinstance(raw, str | bytes | Mapping) or not isinstance(raw, list)):
        raise ConfigError(f"{source}: stages: must be a list of stage tables, got {ck.show(raw)}")
    counts = {"the schedule": num_stages,
              "'num_stages'": _count(top.get("num_stages"), source, "num_stages"),
              "the 'stages' list": len(raw) if raw is not None else None}
    n = _agree(counts, source, "stages")
    if n is None:
        raise ConfigError(f"{source}: give a 'stages' list or 'num_stages' (with a 'default')")
    tables = raw if raw is not None else [{}] * n
    return tuple(_stage(default, tables[s], source, f"stages[{s}]") for s in range(n))


def _stage(default: dict[str, Any], raw: Any, source: str, where: str) -> StageCost:
    mine = _stage_fields(raw, source, where)
    fields = {**default, **mine}
    contexts: dict[str, Any] = {t: {**default.get(t, {}), **mine.get(t, {})} for t in CONTEXTS}
    times = {k: v for k, v in fields.items() if k not in (*MEM_FIELDS, *CONTEXTS)}
    for key in ("F", "B", "W"):
        if key not in times:
            raise ConfigError(f"{source}: {where}: missing time {key!r} (give it in the stage "
                              f"or in 'default')")
    mem = {k: v for k, v in fields.items() if k in MEM_FIELDS}
    for key in (k for k in SR_KEYS if mem.get(k, 0.0) > mem.get("act", 1.0)):
        raise ConfigError(f"{source}: {where}.{key}: {mem[key]:g} is more than act "
                          f"({mem.get('act', 1.0):g}): selective recompute keeps part of M_B")
    return StageCost(times, **mem, **contexts)


def _stage_fields(raw: Any, source: str, where: str, context: bool = False) -> dict[str, Any]:
    """A stage table's fields; ``context``: the table is one of a stage's ``CONTEXTS``, times
    only."""
    table = ck.table(raw, source, where)
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in CONTEXTS and not context:
            out[key] = _stage_fields(value, source, f"{where}.{key}", context=True)
            continue
        if not ((key in MEM_FIELDS and not context) or TIME_KEY.match(str(key))):
            raise ck.unknown(key, TIME_HINTS if context else (*TIME_HINTS, *MEM_FIELDS,
                                                              *CONTEXTS),
                             source, where, " (times are upper-case keys such as F)")
        out[str(key)] = ck.nonneg(value, source, f"{where}.{key}")
    return out


# --- comm -------------------------------------------------------------------------------------

def _rank_count(top: Mapping[str, Any], num_ranks: int | None, num_stages: int,
                source: str) -> int:
    """Ranks the links cover: the file's num_ranks, a matrix's size, the argument, or stages."""
    declared = _count(top.get("num_ranks"), source, "num_ranks")
    comm = top.get("comm")
    sizes = [len(v) for v in (comm or {}).values() if isinstance(v, list)] \
        if isinstance(comm, Mapping) else []
    size = declared or (sizes[0] if sizes else None) or num_ranks or num_stages
    if num_ranks is not None and size < num_ranks:
        raise ConfigError(f"{source}: the links cover {size} ranks, the schedule has {num_ranks}")
    return size


def _comm(raw: Any, n: int, source: str) -> Comm:
    table = ck.table(raw if raw is not None else {}, source, "comm")
    ck.known(table, COMM_KEYS, source, "comm")
    rows = f"num_ranks = {n}"
    lat = ck.matrix(table.get("latency", 0.0), n, source, "comm.latency", ck.nonneg, rows=rows)
    bw = ck.matrix(table.get("bandwidth", math.inf), n, source, "comm.bandwidth", _bandwidth,
                   rows=rows)
    for a in range(n):
        for b in range(n):
            if a != b and bw[a][b] == 0:
                raise ConfigError(f"{source}: comm.bandwidth[{a}][{b}]: must be positive "
                                  f"between different ranks")
    return Comm(lat, bw, ck.nonneg(table.get("post", 0.0), source, "comm.post"))


def _bandwidth(value: Any, source: str, where: str) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if ck.number(value) and value == math.inf:
        return math.inf
    rate = ck.nonneg(value, source, where, what="a non-negative number or \"inf\"")
    if 0 < rate < ck.MIN_RATE:  # a transfer time would overflow to inf
        raise ConfigError(f"{source}: {where}: must be 0 (same rank) or at least "
                          f"{ck.MIN_RATE:g}, got {ck.show(value)}")
    return rate


# --- transformer ------------------------------------------------------------------------------

def _from_transformer(top: Mapping[str, Any], num_stages: int | None, num_ranks: int | None,
                      source: str) -> CostModel:
    clash = [k for k in ("default", "stages", "num_stages") if k in top]
    if clash:
        raise ConfigError(f"{source}: 'transformer' cannot be combined with {clash[0]!r} (give "
                          f"num_stages or layers_per_stage inside the transformer table)")
    table = dict(ck.table(top["transformer"], source, "transformer"))
    ck.known(table, field_names(), source, "transformer")
    missing = [k for k in REQUIRED_SPEC if k not in table]
    if missing:
        raise ConfigError(f"{source}: transformer: missing {', '.join(map(repr, missing))}")
    for key in ("layers_per_stage",):
        if isinstance(table.get(key), list):
            table[key] = tuple(table[key])
    if isinstance(table.get("bandwidth_gbs"), str):
        table["bandwidth_gbs"] = _bandwidth(table["bandwidth_gbs"], source,
                                            "transformer.bandwidth_gbs")
    if num_stages is not None and table.get("layers_per_stage") is None:
        table.setdefault("num_stages", num_stages)
    if num_ranks is not None:
        table.setdefault("num_ranks", num_ranks)
    try:
        cost = spec_cost(TransformerSpec(**table))
    except ConfigError as exc:
        raise ConfigError(f"{source}: transformer: {exc}") from None
    if num_stages is not None and cost.num_stages != num_stages:
        raise ConfigError(f"{source}: transformer: the model has {cost.num_stages} stages, the "
                          f"schedule has {num_stages}")
    if "comm" in top or "num_ranks" in top:
        n = _rank_count(top, num_ranks, cost.num_stages, source)
        cost = cost.with_comm(_comm(top.get("comm"), n, source))
    if num_ranks is not None and cost.comm.num_ranks < num_ranks:
        raise ConfigError(f"{source}: transformer: the links cover {cost.comm.num_ranks} ranks, "
                          f"the schedule has {num_ranks}")
    return cost


# --- small checks -----------------------------------------------------------------------------

def _count(value: Any, source: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ConfigError(f"{source}: {where}: must be a positive integer up to {MAX_COUNT}, "
                          f"got {ck.show(value)}")
    return value


def _agree(counts: Mapping[str, int | None], source: str, what: str) -> int | None:
    """The one value the given counts share; an error naming two that differ."""
    given = [(k, v) for k, v in counts.items() if v is not None]
    for (k1, v1), (k2, v2) in zip(given, given[1:], strict=False):
        if v1 != v2:
            raise ConfigError(f"{source}: {k2} has {v2} {what}, {k1} has {v1}")
    return given[0][1] if given else None
