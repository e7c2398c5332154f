"""``flexpipe run``: train a built-in model with a schedule for real, one process per rank
(spawned locally over gloo, or joining a torchrun launch when its environment is set), and
print losses, step times and the measured metrics; ``--predict`` also profiles the model,
simulates the schedule with the measured costs and compares. torch is imported only here."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from flexpipe.cli.common import add_schedule_args, load_schedule, positive_int
from flexpipe.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    parser = sub.add_parser("run", help="run a schedule for real on PyTorch",
                            description="Train the built-in GPT (or MLP) on synthetic data with "
                            "a schedule, over torch.distributed.")
    add_schedule_args(parser)
    add = parser.add_argument
    add("--steps", type=positive_int, default=5, help="optimizer steps (default 5)")
    add("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline")
    add("--model", choices=("gpt", "mlp", "clip"), default="gpt",
        help="built-in model (clip: two towers joined in a contrastive loss; needs a schedule "
        "whose stage graph is its graph, e.g. examples/two_tower.py)")
    add("--layers", type=positive_int, help="transformer blocks (default: 2 per stage)")
    add("--hidden", type=positive_int, default=64, help="hidden size")
    add("--heads", type=positive_int, default=4, help="attention heads")
    add("--seq", type=positive_int, default=32, help="sequence length")
    add("--vocab", type=positive_int, default=256, help="vocabulary size")
    add("--micro-batch-size", type=positive_int, default=4, help="samples per micro-batch")
    add("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    add("--optimizer", choices=("sgd", "adamw"), default="adamw")
    add("--lr", type=float, default=1e-3, help="learning rate")
    add("--partition", type=partition_arg, help="layers per stage, comma-separated, or auto: "
        "balance the ranks' work (counted floating-point operations) for the schedule's "
        "placement (default: even layer counts)")
    add("--threads", type=positive_int, default=1, help="torch threads per rank")
    add("--backend", choices=("gloo", "nccl", "auto"), default="gloo",
        help="gloo (CPU, default), nccl (one GPU per rank: cuda:LOCAL_RANK) or auto (nccl "
        "when CUDA is available)")
    add("--timeout", type=float, default=60.0, help="seconds to wait for another rank")
    add("--predict", action="store_true",
        help="profile, simulate with the measured costs, compare with the run")
    add("--cost-out", metavar="FILE", help="with --predict: write the measured cost model")
    add("--json", action="store_true", help="print one JSON object")
    add("--checkpoint-dir", metavar="DIR", help="write checkpoints here; resume from the newest "
        "complete one when there is one")
    add("--checkpoint-every", type=positive_int, metavar="K",
        help="with --checkpoint-dir: a checkpoint every K steps (default: after the last step)")
    add("--mem", type=byte_size, metavar="LIMIT", help="refuse to start when a rank's simulated "
        "peak memory exceeds LIMIT bytes (suffixes K, M, G, KiB, MiB, GiB)")


UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
         "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
         "tib": 2**40}


def partition_arg(text: str) -> str | tuple[int, ...]:
    """argparse type: ``auto`` or positive layer counts per stage, e.g. ``3,2,2,3``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or positive layer counts per stage "
                                         f"like 3,2,2,3, got {text!r}")
    return counts


def byte_size(text: str) -> float:
    """argparse type: a positive size in bytes, e.g. ``2GiB``, ``512M``, ``1e6``."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB or 512M, got {text!r} "
                                         f"(units: {', '.join(u for u in UNITS if u)})") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return value


def _jobs(args: argparse.Namespace) -> Any:
    from flexpipe.runtime.models import ModelSpec
    from flexpipe.runtime.train import Job, TrainConfig

    schedule = load_schedule(args)
    layers = args.layers or max(1, 2 * schedule.num_stages - 2)
    model = ModelSpec(args.model, layers=layers, hidden=args.hidden, heads=args.heads,
                      vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch_size,
                      dtype=args.dtype)
    train = TrainConfig(steps=args.steps, optimizer=args.optimizer, lr=args.lr, dp=args.dp,
                        timeout_s=args.timeout, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every or 0)
    partition = args.partition
    if partition == "auto":
        from flexpipe.runtime.balance import auto_partition

        partition = auto_partition(model, schedule.placement.stage_rank)
    _check_checkpoint_args(args)
    return Job(schedule, model, train, partition)


def _check_checkpoint_args(args: argparse.Namespace) -> None:
    """--checkpoint-every needs --checkpoint-dir, which must be a directory (or not exist)."""
    folder = args.checkpoint_dir
    if args.checkpoint_every and folder is None:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR")
    if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
        raise ConfigError(f"--checkpoint-dir {folder!r} exists and is not a directory")


def run(args: argparse.Namespace) -> int:
    """Run (or join a torchrun launch) and report."""
    from flexpipe.runtime import comm, launch

    job = _jobs(args)
    os.environ[comm.BACKEND_ENV] = comm.pick_backend(args.backend)  # ranks inherit it
    if args.mem is not None:
        from flexpipe.runtime.limits import check_memory

        check_memory(job, args.mem)
    env = comm.env_launch()
    if env is not None:
        ranks = launch.run_torchrun([job], timeout_s=args.timeout)[0]
        if env[0] != 0:
            return 0
    else:
        if args.ranks is None:
            raise ConfigError("give the number of pipeline ranks with -p/--ranks")
        world = job.schedule.num_ranks * args.dp
        ranks = launch.launch([job], world, threads=args.threads, timeout_s=args.timeout)[0]
    report = _report(job, ranks)
    if args.predict:
        report |= _predict(job, report, args)
    _print(report, args.json)
    return 0


def _report(job: Any, ranks: list[Any]) -> dict[str, Any]:
    from flexpipe.runtime.measure import measured_trace, median

    sinks = [r.losses for r in ranks if r.losses and r.losses[0] is not None]
    times = [max(r.step_times[k] for r in ranks) for k in range(len(ranks[0].step_times))]
    out: dict[str, Any] = {"schedule": job.schedule.name, "p": job.schedule.num_ranks,
                           "m": job.schedule.microbatches, "dp": job.train.dp,
                           "first_step": ranks[0].start_step, "losses": sinks[0] if sinks else [],
                           "step_ms": [1e3 * t for t in times],
                           "median_step_ms": 1e3 * median(times[1:] or times) if times else 0.0}
    if times and len(ranks) == job.schedule.num_ranks * job.train.dp:
        metrics = measured_trace(job.schedule, ranks).metrics()
        out |= {"measured_makespan_ms": metrics.makespan,
                "measured_bubble_rate": metrics.bubble_rate}
    return out


def _predict(job: Any, report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from flexpipe.cost.io import save_cost
    from flexpipe.ir.lower import lower
    from flexpipe.runtime.profile import profile
    from flexpipe.sim.engine import simulate

    cost = profile(job.model, job.schedule.placement, job.partition, threads=args.threads)
    if args.cost_out:
        save_cost(cost, args.cost_out)
    predicted = simulate(lower(job.schedule), cost).metrics()
    measured = report["median_step_ms"]
    return {"predicted_makespan_ms": predicted.makespan,
            "predicted_bubble_rate": predicted.bubble_rate,
            "prediction_error": (predicted.makespan - measured) / measured}


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"schedule {report['schedule']}: p={report['p']} m={report['m']} dp={report['dp']}")
    if report["first_step"]:
        print(f"  resumed from the checkpoint before step {report['first_step']}")
    for k, (loss, ms) in enumerate(zip(report["losses"], report["step_ms"], strict=True),
                                   start=report["first_step"]):
        print(f"  step {k}: loss {loss:.4f}  {ms:8.1f} ms")
    for key in ("median_step_ms", "measured_makespan_ms", "measured_bubble_rate",
                "predicted_makespan_ms", "predicted_bubble_rate", "prediction_error"):
        if key in report:
            print(f"  {key.replace('_', ' ')}: {report[key]:.3f}")
