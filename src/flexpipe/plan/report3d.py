"""The (pp, dp, tp) part of a plan as data (JSON-ready) and text: one row per layout considered
(its best schedule and micro-batch size, step time split into pipeline and data-parallel
collectives, the tensor-parallel all-reduces inside the pipeline time, peak memory per rank and
whether it fits), the Megatron-style default beside it, and why the winner wins."""

from __future__ import annotations

from typing import Any

from flexpipe.plan.choose3d import Plan3D, Row
from flexpipe.plan.parallel3d import group

GB = 1e9


def row_dict(row: Row) -> dict[str, Any]:
    """One layout's row as JSON-ready data."""
    lay, out = row.layout, row.outcome
    return {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "sharded": lay.sharded,
            "schedule": row.schedule, "micro_batch": out.candidate.b if out else None,
            "step_ms": row.step_ms if out else None, "pipeline_ms": row.pipeline_ms,
            "dp_comm_ms": row.dp_ms, "tp_comm_ms": row.tp_ms, "peak_bytes": row.peak,
            "fits": row.fits}


def as_dict(result: Plan3D, default: Row | None) -> dict[str, Any]:
    """The layout choice as JSON-ready data: the winner, every row, the default, the reason."""
    return {"parallel": row_dict(result.best), "layouts": [row_dict(r) for r in result.rows],
            "megatron_default": None if default is None else row_dict(default),
            "reason": result.reason}


def _line(name: str, row: Row) -> str:
    lay = row.layout
    fsdp = "fsdp" if lay.sharded else ""
    lead = f"{name:<22} {lay.pp:>3} {lay.dp:>3} {lay.tp:>3} {fsdp:>4} "
    if row.outcome is None:
        return lead + "does not fit memory"
    return (lead + f"{row.schedule[:16]:<16} {row.outcome.candidate.b:>2} {row.step_ms:>9.1f} "
            f"{row.pipeline_ms:>9.1f} {row.dp_ms:>8.1f} {row.tp_ms:>8.1f} {row.peak / GB:>7.1f} "
            f"{'yes' if row.fits else 'no':>4}")


def as_text(result: Plan3D, default: Row | None) -> str:
    """The layouts considered, the default and the reason, as aligned text."""
    head = (f"{'layout':<22} {'pp':>3} {'dp':>3} {'tp':>3} {'':>4} {'schedule':<16} {'b':>2} "
            f"{'step ms':>9} {'pipe ms':>9} {'dp ms':>8} {'tp ms':>8} {'GB/rank':>7} {'fits':>4}")
    out = ["(pp, dp, tp) layouts considered (step = pipeline + data-parallel collectives; "
           "tp all-reduces are inside the pipeline time):", head]
    for row in result.rows:
        mark = "chosen" if row.layout == result.best.layout else ""
        out.append(_line(mark, row))
    if default is not None:
        out.append(_line("megatron default", default))
        out.append(f"  megatron default: tp = a node, fewest stages that fit, 1F1B or "
                   f"interleaved; the plan is {default.step_ms / result.best.step_ms:.2f}x "
                   f"faster")
    out.append(f"why: {result.reason}")
    lay = result.best.layout
    if lay.tp > 1 or lay.dp > 1:
        first = group(lay, 0, 0)
        out.append(f"pipeline device i above is tensor-parallel group i dp + r of replica r "
                   f"(group g = cluster devices g tp .. g tp + tp - 1; device 0 = devices "
                   f"{first[0]}..{first[-1]}); peak memory is per rank")
    return "\n".join(out)
