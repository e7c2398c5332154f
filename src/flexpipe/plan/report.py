"""A plan as data (JSON-ready) and as text: stage -> layers, stage -> device, the schedule and the
micro-batches, the predicted time and memory per device, and the baselines beside it."""

from __future__ import annotations

from typing import Any

from flexpipe.plan.evaluate import Outcome
from flexpipe.plan.planner import Plan

GB = 1e9
BASELINES = {
    "megatron": "uniform split, devices in index order, 1F1B",
    "pipedream": "DP assuming uniform links, index order, 1F1B",
}


def stages(plan: Plan) -> list[dict[str, Any]]:
    """One row per stage: its layers (first..last, names) and its device and rank."""
    cand, layers = plan.best.candidate, plan.model.layers
    ranks = cand.placement.stage_rank
    return [{"stage": s, "first": cand.cuts[s], "last": cand.cuts[s + 1] - 1,
             "names": _span(layers[cand.cuts[s]].name, layers[cand.cuts[s + 1] - 1].name),
             "device": dev, "rank": ranks[s]}
            for s, dev in enumerate(cand.stage_devices())]


def _span(first: object, last: object, sep: str = "..") -> str:
    """``first..last``, or the one item of a single-layer stage."""
    return str(first) if first == last else f"{first}{sep}{last}"


def as_dict(plan: Plan, baselines: dict[str, Outcome | None],
            step_ms: float | None = None) -> dict[str, Any]:
    """The JSON form of a plan and its baselines; ``step_ms`` is the whole step when it is more
    than the pipeline's iteration (data-parallel collectives; ``time_ms`` stays the pipeline's,
    which ``flexpipe simulate`` reproduces from the written files)."""
    best, cand = plan.best, plan.best.candidate
    step = best.makespan if step_ms is None else step_ms
    memory = [{"device": d, "peak_bytes": peak, "capacity_bytes": plan.cluster.devices[d].memory}
              for d, peak in zip(cand.path, best.peak_memory, strict=True)]
    base = {name: None if out is None else
            {"time_ms": out.makespan, "fits": out.fits, "micro_batch": out.candidate.b,
             "speedup": out.makespan / step}
            for name, out in baselines.items()}
    return {"model": plan.model.name, "cluster": plan.cluster.name,
            "schedule": plan.schedule_name, "micro_batch": cand.b, "microbatches": cand.m,
            "time_ms": best.makespan, "step_ms": step, "stages": stages(plan), "memory": memory,
            "optimal": plan.optimal, "simulated": plan.simulated, "seconds": plan.seconds,
            "baselines": base}


def _split(data: dict[str, Any]) -> str:
    """`` (pipeline X ms + data-parallel collectives)`` when the step is more than the pipeline."""
    if data["step_ms"] <= data["time_ms"]:
        return ""
    return f" (pipeline {data['time_ms']:.3f} ms + data-parallel collectives)"


def as_text(plan: Plan, baselines: dict[str, Outcome | None],
            step_ms: float | None = None) -> str:
    """The plan as a few aligned lines of text (``step_ms`` as in ``as_dict``)."""
    data = as_dict(plan, baselines, step_ms)
    proof = "optimal over the searched space" if plan.optimal else "heuristic"
    out = [f"plan for {data['model']} on {data['cluster']} ({proof}; {plan.simulated} "
           f"candidates simulated in {plan.seconds:.2f} s)",
           f"schedule {data['schedule']}, micro-batch size {data['micro_batch']}, "
           f"{data['microbatches']} micro-batches",
           f"predicted iteration time {data['step_ms']:.3f} ms" + _split(data), "",
           f"{'stage':>5}  {'layers':>9}  {'names':<24} {'device':>6}  {'rank':>4}"]
    out += [f"{r['stage']:>5}  {_span(r['first'], r['last'], '-'):>9}  {r['names']:<24} "
            f"{r['device']:>6}  {r['rank']:>4}" for r in data["stages"]]
    out += ["", f"{'device':>6}  {'peak memory':>12}  {'capacity':>10}"]
    out += [f"{m['device']:>6}  {m['peak_bytes'] / GB:>9.2f} GB  "
            f"{m['capacity_bytes'] / GB:>7.1f} GB" for m in data["memory"]]
    out += ["", "baselines (same simulator, same cluster):"]
    for name, row in data["baselines"].items():
        if row is None:
            out.append(f"  {name:<10} cannot run ({BASELINES[name]})")
            continue
        fits = "" if row["fits"] else ", does not fit memory"
        out.append(f"  {name:<10} {row['time_ms']:.3f} ms, plan is {row['speedup']:.2f}x "
                   f"faster ({BASELINES[name]}{fits})")
    return "\n".join(out)
