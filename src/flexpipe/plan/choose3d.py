"""The choice of (pp, dp, tp): plan one pipeline replica for every layout of the cluster
(``parallel3d.layouts``), add the data-parallel step collectives, and keep the fastest layout
that fits memory, with a table of every layout considered and the reason the winner wins.

A layout's step time is its replica's simulated pipeline iteration (tensor-parallel all-reduces
inside every F and B) plus its data-parallel collectives, not overlapped with the pipeline (an
upper bound): the largest over ranks of ``flexpipe.cost.parallel.dp_step_time`` for the static
bytes the rank holds. Data parallelism is plain first; a layout is tried sharded (ZeRO-3 /
FSDP) only when plain data parallelism finds no plan that fits (sharding only adds traffic).
Layouts are ranked with a cheaper planner effort (``SWEEP``) and the winner is planned again
with the full options. With one layout (``--tp 1 --dp 1``, or one device) it is the planner's
own plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flexpipe.cost import parallel as par
from flexpipe.cost.partition import uniform_cuts
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.plan.evaluate import Candidate, Outcome, simulate_candidate
from flexpipe.plan.parallel3d import (
    Layout,
    dp_bandwidth,
    layouts,
    replica_cluster,
    shard_model,
    tp_bandwidth,
    tp_choices,
)
from flexpipe.plan.planner import Options, Plan, plan
from flexpipe.plan.problem import Cluster, Model

SWEEP = {"refine_candidates": 0, "polish_sims": 60, "sim_budget": 150}
"""Planner effort while ranking layouts (each at most the caller's)."""


@dataclass(frozen=True)
class Row:
    """One layout's best plan: pipeline time, data-parallel and tensor-parallel communication
    of the step (the latter inside the pipeline time), peak memory per rank, whether it fits;
    ``outcome`` is replica 0's simulated pipeline (None: nothing fits)."""

    layout: Layout
    outcome: Outcome | None
    schedule: str = "-"
    pipeline_ms: float = 0.0
    dp_ms: float = 0.0
    tp_ms: float = 0.0
    peak: float = 0.0
    fits: bool = False

    @property
    def step_ms(self) -> float:
        """Pipeline iteration plus the data-parallel collectives."""
        return self.pipeline_ms + self.dp_ms


@dataclass
class Plan3D:
    """The chosen layout and its full plan, every layout's row, and why the winner wins."""

    best: Row
    plan: Plan
    rows: list[Row]
    reason: str


def _effort(options: Options) -> Options:
    return replace(options, **{k: min(getattr(options, k), v) for k, v in SWEEP.items()})


def row_of(model: Model, cluster: Cluster, layout: Layout, out: Outcome | None,
           schedule: str = "") -> Row:
    """The row of ``out`` (replica 0's pipeline of ``layout``): the same plan simulated on every
    other replica (the slowest decides; all must fit), the data-parallel collectives of each rank
    and the tensor-parallel all-reduces of the busiest rank."""
    if out is None:
        return Row(layout, None)
    sharded = shard_model(model, cluster, layout)
    outs: list[Outcome | None] = [out]
    base = replica_cluster(cluster, layout, 0)
    for r in range(1, layout.dp):
        other = replica_cluster(cluster, layout, r)
        if (other.devices, other.latency, other.bandwidth) != (base.devices, base.latency,
                                                                base.bandwidth):
            outs.append(simulate_candidate(sharded, other, out.candidate))
    if any(o is None for o in outs):
        return Row(layout, None)
    done = [o for o in outs if o is not None]
    cand = out.candidate
    ranks = cand.placement.stage_rank
    static, talk = [0.0] * len(cand.path), [0.0] * len(cand.path)
    tp_bw = tp_bandwidth(cluster, layout)
    for s in range(len(ranks)):
        for x in model.layers[cand.cuts[s]:cand.cuts[s + 1]]:
            static[ranks[s]] += x.params / layout.tp
            talk[ranks[s]] += par.tp_comm(x.out_bytes, layout.tp, tp_bw) * cand.b * cand.m
    dp_ms = max(par.dp_step_time(static[r], layout.dp, dp_bandwidth(cluster, layout, dev),
                                 layout.sharded) for r, dev in enumerate(cand.path))
    return Row(layout, out, schedule or out.schedule.name, max(o.makespan for o in done),
               dp_ms, max(talk), max(max(o.peak_memory) for o in done),
               all(o.fits for o in done))


def _plan_row(model: Model, cluster: Cluster, layout: Layout,
              options: Options) -> tuple[Row, Plan | None]:
    try:
        got = plan(shard_model(model, cluster, layout), replica_cluster(cluster, layout, 0),
                   options)
    except InfeasibleError:
        return Row(layout, None), None
    return row_of(model, cluster, layout, got.best, got.schedule_name), got


def plan_3d(model: Model, cluster: Cluster, options: Options | None = None,
            tp: int | None = None, dp: int | None = None) -> Plan3D:
    """Choose (pp, dp, tp), stages, devices, schedule and micro-batch size for ``model`` on
    ``cluster`` (``tp`` / ``dp`` fix a degree); raise ``InfeasibleError`` when nothing fits."""
    options = options or Options()
    shapes = layouts(model, cluster, tp, dp)
    if not shapes:
        raise ConfigError(f"no (pp, dp, tp) layout of the {cluster.size} devices with tp in "
                          f"{[tp] if tp else tp_choices(model, cluster)} and dp "
                          f"{dp if dp else 'any'} divides the global batch {model.global_batch}")
    quick = options if len(shapes) == 1 else _effort(options)
    rows: list[Row] = []
    plans: dict[Layout, Plan] = {}
    for layout in shapes:
        row, got = _plan_row(model, cluster, layout, quick)
        if not row.fits and layout.dp > 1:
            rows.append(row)
            row, got = _plan_row(model, cluster, replace(layout, sharded=True), quick)
        rows.append(row)
        if got is not None:
            plans[row.layout] = got
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise InfeasibleError(f"no (pp, dp, tp) layout of model {model.name!r} fits the memory "
                              f"of cluster {cluster.name!r} (tried {len(rows)})")
    best = min(fitting, key=lambda r: r.step_ms)
    final, full = best, plans[best.layout]
    if quick is not options:
        again, got = _plan_row(model, cluster, best.layout, options)
        if got is not None and again.fits and again.step_ms <= best.step_ms:
            final, full = again, got
    rows = [final if r.layout == final.layout else r for r in rows]
    return Plan3D(final, full, rows, reason(final, rows))


def reason(best: Row, rows: list[Row]) -> str:
    """Why ``best`` wins: the runner-up and what separates them (pipeline, tensor-parallel or
    data-parallel time), and the layouts that do not fit memory."""
    others = sorted((r for r in rows if r.fits and r.layout != best.layout),
                    key=lambda r: r.step_ms)
    misfits = [r.layout.label() for r in rows if not r.fits]
    text = f"{best.layout.label()} is the fastest layout that fits memory"
    if others:
        two = others[0]
        parts = {"pipeline (compute and bubbles)": (two.pipeline_ms - two.tp_ms)
                 - (best.pipeline_ms - best.tp_ms),
                 "tensor-parallel all-reduces": two.tp_ms - best.tp_ms,
                 "data-parallel collectives": two.dp_ms - best.dp_ms}
        what, gain = max(parts.items(), key=lambda kv: kv[1])
        text += (f": {two.step_ms / best.step_ms:.2f}x ahead of {two.layout.label()} "
                 f"({two.step_ms:.1f} ms), mostly {gain:.1f} ms less {what}")
    if misfits:
        text += f"; {len(misfits)} layout(s) do not fit memory ({', '.join(misfits[:4])}"
        text += ", ...)" if len(misfits) > 4 else ")"
    return text


def megatron_3d(model: Model, cluster: Cluster) -> Row | None:
    """Megatron-LM's usual setting: tp = the largest allowed (a node), the fewest pipeline
    stages whose uniform split fits memory, dp the rest (plain), 1F1B or interleaved 1F1B
    (v = 2) with the faster micro-batch size that fits; None when no pp fits."""
    t = max(tp_choices(model, cluster))
    for layout in sorted(layouts(model, cluster, tp=t), key=lambda lay: lay.pp):
        sharded = shard_model(model, cluster, layout)
        vc = replica_cluster(cluster, layout, 0)
        n = len(model.layers)
        outs = [simulate_candidate(sharded, vc, Candidate(fam, tuple(range(layout.pp)),
                                                          uniform_cuts(n, k * layout.pp), b, m))
                for fam, k in (("1f1b", 1), ("interleaved-1f1b", 2))
                if (layout.pp > 1 or k == 1) and n >= k * layout.pp
                for b, m in sharded.choices()]
        fit = [o for o in outs if o is not None and o.fits]
        if fit:
            row = row_of(model, cluster, layout, min(fit, key=lambda o: o.makespan))
            if row.fits:
                return row
    return None
