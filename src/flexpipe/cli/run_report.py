"""What ``flexpipe run`` reports after (or instead of) its live step lines: one dict whose keys
name their unit (``_ms``, ``_bytes``, ``_pct``, ``_per_s``), printed as JSON or as labelled
lines that say what each number is. A run cut short (failure, Ctrl-C) reports the steps it
completed from the live log."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from flexpipe.schedules.dualpipe_twoway import data_microbatches
from flexpipe.viz.units import fmt_bytes, fmt_ms

if TYPE_CHECKING:  # the runtime (torch) is imported only when a run starts
    from flexpipe.runtime.processes.train import Job


def throughput(job: Job) -> tuple[int, str]:
    """Tokens (token models) or samples processed in one step, and which of the two."""
    samples = data_microbatches(job.schedule) * job.model.micro_batch * job.train.replicas
    if job.model.name in ("gpt", "moe"):
        return samples * job.model.seq, "tokens"
    return samples, "samples"


def header(job: Job) -> dict[str, Any]:
    """The run's identity: schedule, sizes, batch, partition and seed (``m``: the schedule's,
    per direction for DualPipe, whose global batch counts both)."""
    return {"schedule": job.schedule.name, "p": job.schedule.num_ranks,
            "m": job.schedule.microbatches, "dp": job.train.dp,
            "dp_replicate": job.train.dp_replicate, "tp": job.train.tp,
            "ep": job.train.ep, "micro_batch_size": job.model.micro_batch,
            "global_batch_size": data_microbatches(job.schedule) * job.model.micro_batch
            * job.train.replicas,
            "partition": list(job.partition) if job.partition else None,
            "seed": job.model.seed, "model": job.model.factory or job.model.name,
            "split_points": list(job.model.cut) or None,
            "mixed_precision": _policy(getattr(job.train, "mixed_precision", None))}


def _policy(policy: Any) -> str | None:
    """A mixed-precision policy in words (None: off)."""
    if policy is None:
        return None
    return (f"{_dtype(policy.param_dtype)} compute, float32 master weights and gradients, "
            f"{_dtype(policy.reduce_dtype)} reduction")


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def from_steps(job: Job, steps: list[Any], first: int = 0) -> dict[str, Any]:
    """The figures of the completed steps (``flexpipe.runtime.processes.progress.Step``)."""
    from flexpipe.runtime.measurement.measure import median

    times = [s.seconds for s in steps]
    amount, unit = throughput(job)
    med = median(times[1:] or times) if times else 0.0
    out: dict[str, Any] = {
        "first_step": first, "steps_completed": len(steps),
        "losses": [s.loss for s in steps if s.loss is not None],
        "step_ms": [1e3 * t for t in times],
        "median_step_ms": 1e3 * med,
        f"{unit}_per_s": amount / med if med > 0 else 0.0,
    }
    if steps and max(s.peak_bytes for s in steps) > 0:
        out |= {"peak_memory_bytes": max(s.peak_bytes for s in steps),
                "peak_memory_kind": steps[-1].memory_kind}
    return out


def steps_of(ranks: list[Any]) -> list[Any]:
    """The steps as every rank's results tell them (a torchrun launch, where each rank saw only
    its own progress): the loss of the ranks that compute it, the slowest rank's time, the
    largest measured peak (0 where the ranks did not report one)."""
    from flexpipe.runtime.processes.progress import Step

    sinks = [r.losses for r in ranks if r.losses and r.losses[0] is not None]
    out = []
    for k in range(len(ranks[0].step_times)):
        loss = sinks[0][k] if sinks else None
        out.append(Step(ranks[0].start_step + k, loss, max(r.step_times[k] for r in ranks), 0,
                        "RSS"))
    return out


def last_step(job: Job, ranks: list[Any]) -> Any:
    """The last step as a measured ``Trace`` (from the ranks' op times); None when not every
    rank reported a step."""
    from flexpipe.runtime.measurement.measure import measured_trace

    if not ranks[0].step_times or len(ranks) != job.world:
        return None
    return measured_trace(job.schedule, ranks)


def measured(trace: Any, ranks: list[Any]) -> dict[str, Any]:
    """The last step's measured makespan and bubble rate (``last_step``'s trace; none without
    one), and its activation peaks where the run measured them."""
    if trace is None:
        return {}
    metrics = trace.metrics()
    out: dict[str, Any] = {"measured_makespan_ms": metrics.makespan,
                           "measured_bubble_rate": metrics.bubble_rate}
    if any(r.activations for r in ranks):
        out["measured_activation_peak_bytes"] = list(metrics.peak_activation)
    return out


LABELS: dict[str, tuple[str, str]] = {
    "median_step_ms": ("median step time", "wall clock of one step, optimizer included, "
                       "median over the steps after the first"),
    "measured_makespan_ms": ("measured makespan", "last step, first op start to last op end"),
    "measured_bubble_rate": ("measured bubble rate", "last step"),
    "mfu_median": ("MFU", "model FLOPs / step time / devices' peak, median over the logged "
                   "steps"),
    "val_loss": ("validation loss", "held-out windows of --data, after the last step"),
    "predicted_makespan_ms": ("predicted makespan", "simulated with the profiled costs"),
    "predicted_bubble_rate": ("predicted bubble rate", "simulated"),
    "profiled_post_ms": ("compute thread per send or receive", "profiled under gloo; the "
                         "simulator charges it per transfer: docs/cost.md, post"),
    "prediction_error_pct": ("prediction error", "(predicted - measured) / measured makespan"),
    "replayed_makespan_ms": ("replayed makespan", "the measured last step simulated with its "
                             "ops' measured durations: predicted -> replayed is what the op "
                             "times account for, replayed -> measured the waits and transfers"),
}


def _value(key: str, value: float) -> str:
    if key.endswith("_ms"):
        return fmt_ms(value)
    if key.endswith("_pct"):
        return f"{value:+.1f}%"
    if key.startswith("mfu"):
        return f"{100 * value:.2f}%"
    return f"{value:.4f}"


def _show_activations(report: dict[str, Any]) -> None:
    """Measured vs predicted activation peak per rank (``run --predict``)."""
    got = report.get("measured_activation_peak_bytes")
    want = report.get("predicted_activation_peak_bytes")
    if not got or not want or len(got) != len(want):
        return
    print("  activation peak per rank (measured: live saved tensors, outputs and W's inputs "
          "and output gradients after every op; predicted: simulated with the profiled "
          "M_B and M_W):")
    for r, (meas, pred) in enumerate(zip(got, want, strict=True)):
        err = f"{100.0 * (pred - meas) / meas:+.1f}%" if meas else "n/a"
        print(f"    rank {r}: measured {fmt_bytes(meas)}, predicted {fmt_bytes(pred)} ({err})")


def show(report: dict[str, Any], as_json: bool) -> None:
    """Print ``report``: one JSON object, or labelled lines."""
    if as_json:
        print(json.dumps(report, indent=2), flush=True)
        return
    rate = next((k for k in report if k.endswith("_per_s")), None)
    if rate and report[rate]:
        print(f"  throughput: {report[rate]:,.0f} {rate[:-len('_per_s')]}/s "
              f"(at the median step time)")
    if "peak_memory_bytes" in report:
        print(f"  peak memory: {fmt_bytes(report['peak_memory_bytes'])} "
              f"({report['peak_memory_kind']}, largest over the ranks)")
    for key, (label, what) in LABELS.items():
        if key in report and report.get("steps_completed", 1):
            print(f"  {label}: {_value(key, report[key])}  ({what})")
    _show_activations(report)
    if "error" in report:
        last = f" (last loss {report['losses'][-1]:.4f})" if report["losses"] else ""
        saved = report.get("steps_checkpointed")
        kept = f", checkpointed up to step {saved} (the same command resumes there)" \
            if saved else ""
        print(f"  stopped after {report['steps_completed']} completed steps{last}{kept}: "
              f"{report['error']}", file=sys.stderr)


def title(head: dict[str, Any], auto: bool | str = False) -> str:
    """The first line: schedule, sizes, batch; then the partition (``auto``: chosen by
    ``--partition auto``, or ``"params"``: by ``--partition params``)."""
    hsdp = head.get("dp_replicate", 1)
    text = (f"schedule {head['schedule']}: p={head['p']} m={head['m']} dp={head['dp']}"
            + (f" (HSDP {hsdp} x {head['dp'] // hsdp})" if hsdp > 1 else "")
            + (f" tp={head['tp']}" if head.get("tp", 1) > 1 else "")
            + (f" ep={head['ep']}" if head.get("ep", 1) > 1 else "") + ", "
            f"micro-batch size {head['micro_batch_size']}, global batch "
            f"{head['global_batch_size']} samples, seed {head['seed']}")
    if head["partition"]:
        how = ("params: balances the ranks' parameters" if auto == "params" else
               "auto: balances the ranks' counted FLOPs" if auto else "given")
        layers = ": embedding, blocks, head" if head.get("model") in ("gpt", "mlp") else ""
        text += (f"\n  partition (layers per stage{layers}): "
                 f"{','.join(map(str, head['partition']))} ({how})")
    if head.get("mixed_precision"):
        text += f"\n  mixed precision: {head['mixed_precision']}"
    if head.get("split_points"):
        text += (f"\n  split points: {', '.join(head['split_points'])} (automatic: the "
                 "ranks' work balanced)")
    return text
