"""``flexpipe run``: train a built-in model with a schedule for real, one process per rank
(spawned locally over gloo, or joining a torchrun launch when its environment is set). Each
step is printed as soon as every rank has finished it (loss, step time, tokens/s, peak memory;
``flexpipe.cli.live``), then the measured metrics; ``--predict`` also profiles the model
(on the ranks that trained, after the last step: no second launch), simulates the schedule
with the measured costs and compares the predicted makespan with the measured one. A run
that fails or is interrupted still reports the steps it completed. torch is imported only
here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpipe.cli import guards, run_args, run_report, runguards
from flexpipe.cli.common import (
    add_mem_arg,
    add_schedule_args,
    load_schedule,
    positive_int,
    positive_number,
)
from flexpipe.cli.config import add_config_arg
from flexpipe.cli.live import Live
from flexpipe.cli.metrics import metrics_for
from flexpipe.cli.model_args import (
    model_arg,
    partition_arg,
    seed_arg,
    split_partition,
    split_points_arg,
)
from flexpipe.cli.written import announce
from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.ir.sharded import shard_per_step
from flexpipe.schedules.dualpipe_twoway import model_placement, model_stages

if TYPE_CHECKING:  # the runtime (torch) is imported only when a run starts
    from flexpipe.cost.model import CostModel
    from flexpipe.runtime.models.spec import ModelSpec
    from flexpipe.runtime.processes.train import Job


class DefaultsHelp(argparse.HelpFormatter):
    """Help that ends each option's text with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    parser = sub.add_parser("run", help="run a schedule for real on PyTorch",
                            description="Train the built-in GPT on your data (--data) or on "
                            "synthetic text (or the MLP, or your own model) with a schedule, over "
                            "torch.distributed. One step holds m micro-batches "
                            "(-m, a count) of --micro-batch-size samples each, per replica: "
                            "global batch = m x micro-batch size x dp.",
                            formatter_class=DefaultsHelp)
    add_schedule_args(parser, gate=False)
    add_config_arg(parser)
    add = parser.add_argument
    add("--steps", type=positive_int, default=5, help="optimizer steps")
    add("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline")
    add("--fsdp", action="store_true",
        help="shard every stage over the --dp replicas with torch's FSDP2 under any schedule: "
        "gathered before the stage's first pass of the step, reduce-scattered after its last "
        "(a schedule with its own AG/RS, zeropp, keeps them); each repeated block of a stage "
        "is its own FSDP2 unit; with --ep over the dp x ep ranks, the experts left whole")
    add("--dp-replicate", type=positive_int, default=1, metavar="R",
        help="HSDP with --fsdp: the --dp ranks as R replica groups of dp/R shards each "
        "(FSDP2 reduce-scatters within a group, all-reduces across groups); world = p x "
        "dp x tp, dp = dp_replicate x dp_shard; with --ep each group shards over its "
        "dp/R x ep ranks")
    add("--tp", type=positive_int, default=1,
        help="tensor-parallel ranks per pipeline rank (the model's tp plan: the built-in gpt "
        "splits heads and MLP, Megatron-style); world = p x dp x tp, FlexPipe's DeviceMesh "
        "dp x pp x tp")
    add("--ep", type=positive_int, default=1,
        help="expert-parallel ranks per pipeline rank: each MoE layer's experts shared out "
        "over them, tokens exchanged by all-to-all (the model's ep plan: the built-in moe's, "
        "your UserModel's ep_plan, or a Hugging Face MoE family's); they train on data of "
        "their own, as replicas do: world = p x dp x ep x tp; with --tp the experts stay "
        "whole on every tp rank")
    add("--global-batch-size", type=positive_int, metavar="GBS",
        help="samples per step over all replicas; sets m = GBS / (micro-batch size x dp) "
        "(Megatron's convention)")
    add("--seed", type=seed_arg, default=0,
        help="seed of the model's initial weights and the data")
    add("--log-every", type=positive_int, default=1, metavar="K",
        help="print every K-th step (and the last)")
    add("--trace-out", metavar="FILE", help="write the measured last step as a Chrome/Perfetto "
        "trace (JSON; open in ui.perfetto.dev or chrome://tracing)")
    add("--model", type=model_arg, default="gpt", metavar="gpt|mlp|moe|clip|PKG.MODULE:FACTORY",
        help="built-in model (moe: a mixture of experts, --experts per layer, for --ep; "
        "clip: two towers joined in a contrastive loss; needs a schedule "
        "whose stage graph is its graph, e.g. examples/two_tower.py), or your own: a function "
        "returning a flexpipe.UserModel or (model, (inputs, target), loss_fn)")
    add("--layers", type=positive_int, help="transformer blocks (default: 2 per stage)")
    add("--experts", type=positive_int, default=8, help="experts of each MoE layer (moe)")
    add("--hidden", type=positive_int, default=64, help="hidden size")
    add("--heads", type=positive_int, default=4, help="attention heads")
    add("--seq", type=positive_int, default=32, help="sequence length")
    add("--vocab", type=positive_int, default=256, help="vocabulary size")
    add("--micro-batch-size", type=positive_int, default=4,
        help="samples in each micro-batch (not the count of micro-batches: that is -m)")
    add("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
        help="parameter and activation type")
    add("--optimizer", choices=("sgd", "adamw"), default="adamw", help="optimizer")
    add("--lr", type=positive_number, default=1e-3, help="learning rate")
    add("--partition", type=partition_arg, help="layers per stage, comma-separated, or auto: "
        "balance the ranks' work (counted floating-point operations) for the schedule's "
        "placement, or params: balance the ranks' parameters; the layer list is embedding, "
        "blocks, head (default: even layer counts)")
    add("--split-points", type=split_points_arg, metavar="LIST",
        help="torchtitan's split points instead of --partition: the blocks that start a new "
        "stage, e.g. layers.2,layers.4 (the embedding goes with the first stage, the head with "
        "the last)")
    add("--threads", type=positive_int, default=1, help="torch threads per rank")
    add("--backend", choices=("gloo", "nccl", "auto"), default="gloo",
        help="gloo (CPU, default), nccl (one GPU per rank: cuda:LOCAL_RANK) or auto (nccl "
        "when CUDA is available)")
    add("--timeout", type=positive_number, default=60.0,
        help="seconds to wait for another rank")
    add("--predict", action="store_true",
        help="profile, simulate with the measured costs, compare with the run")
    add("--cost-out", metavar="FILE", help="with --predict: write the measured cost model")
    add("--json", action="store_true", help="print one JSON object (the live step lines go to "
        "stderr)")
    add("--checkpoint-dir", metavar="DIR", help="write checkpoints here; resume from the newest "
        "complete one when there is one")
    add("--on-nan", choices=("stop", "skip"), default="stop",
        help="a NaN or infinite loss or gradient: stop the run naming the step, rank, stage "
        "and parameter (no checkpoint of it is written), or skip that step's update")
    add("--checkpoint-every", type=positive_int, metavar="K",
        help="with --checkpoint-dir: a checkpoint every K steps (default: after the last step)")
    add("--dry-run", action="store_true",
        help="check the whole job (schedule, model, sizes, data, checkpoint and memory "
        "options), print what would run and exit without starting a process")
    run_args.add_training_args(parser)
    add_mem_arg(parser, "refuse to start when a rank's simulated peak memory (weights, "
                "gradients, optimizer state and activations, measured on the model) exceeds "
                "LIMIT")


def _jobs(args: argparse.Namespace) -> Job:
    from flexpipe.runtime.models.spec import ModelSpec
    from flexpipe.runtime.processes.train import Job, TrainConfig
    from flexpipe.runtime.transport import comm

    run_args.local_batch(args)
    run_args.global_batch(args)
    run_args.data_vocab(args)
    schedule = load_schedule(args)
    if args.fsdp:
        schedule = shard_per_step(schedule)
    layers = args.layers or max(1, 2 * schedule.num_stages - 2)
    model = ModelSpec(args.model, layers=layers, hidden=args.hidden, heads=args.heads,
                      vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch_size,
                      dtype=args.dtype, seed=args.seed,
                      experts=args.experts) if ":" not in args.model else None
    if comm.env_launch() is None:  # a local launch: its processes first, then the model
        guards.check_ranks(schedule.num_ranks * args.dp * args.ep * args.tp, args.no_size_guard,
                           args.threads)
    args.estimated_params = runguards.guard_model(args, model, schedule.num_stages,
                                                  schedule.microbatches)
    model = model or _user_model(args.model, args.seed)
    train = TrainConfig(steps=args.steps, optimizer=args.optimizer, lr=args.lr, dp=args.dp,
                        dp_replicate=args.dp_replicate, tp=args.tp, ep=args.ep,
                        timeout_s=args.timeout, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every or 0,
                        measure_memory=bool(args.predict), on_nan=args.on_nan,
                        **run_args.train_settings(args))
    partition = args.partition
    if args.split_points is not None:
        if partition is not None:
            raise ConfigError("give --partition or --split-points, not both")
        if ":" in args.model:
            raise ConfigError("--split-points cuts the built-in models (layers.K); a model of "
                              f"your own ({args.model}) names its split points in its "
                              "UserModel (split_points=('layers.2',)), or is cut automatically")
        partition = split_partition(args.split_points, layers, model_stages(schedule))
    if partition in ("auto", "params"):
        from flexpipe.runtime.measurement.balance import auto_partition

        partition = auto_partition(model, model_placement(schedule.placement).stage_rank,
                                   "flops" if partition == "auto" else "params")
    _check_checkpoint_args(args)
    if args.predict and args.ep > 1:  # costed from the run's own last step
        from flexpipe.runtime.measurement.passes import check_apart

        check_apart(schedule)
    if args.predict and args.tp > 1:
        raise ConfigError("--predict profiles each stage whole on one process and does not "
                          "model tensor-parallel collectives; run --tp without --predict "
                          "(flexpipe plan --tp models them)")
    return Job(schedule, model, train, partition)


def _user_model(factory: str, seed: int) -> ModelSpec:
    """``--model package.module:function``: your own model (its factory called here once to
    check it and read its micro-batch size; every rank calls it again)."""
    from flexpipe.runtime.models.spec import ModelSpec
    from flexpipe.runtime.user.model import load_factory

    sys.path.insert(0, os.getcwd())  # a module in the current directory, as python -m finds it
    user = load_factory(factory, seed)
    return ModelSpec("user", micro_batch=user.micro_batch, seed=seed, factory=factory)


def _check_checkpoint_args(args: argparse.Namespace) -> None:
    """--checkpoint-every needs --checkpoint-dir, which must be a directory (or not exist)."""
    folder = args.checkpoint_dir
    if args.checkpoint_every and folder is None:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR")
    if folder is not None and not folder.strip():
        raise ConfigError("--checkpoint-dir is empty; give a directory (the checkpoints would "
                          "land in the current one)")
    if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
        raise ConfigError(f"--checkpoint-dir {folder!r} exists and is not a directory")


def run(args: argparse.Namespace) -> int:
    """Run (or join a torchrun launch), printing each step as it ends, and report."""
    from flexpipe.runtime.transport import comm

    if args.cost_out and not args.predict:
        raise ConfigError("--cost-out writes the cost model that --predict measures; give "
                          "--predict too (without it nothing would be written)")
    for path in (args.cost_out, args.trace_out):
        guards.check_output(path, force=True)  # replaced if it exists; checked before the run
    job = _jobs(args)
    os.environ[comm.BACKEND_ENV] = comm.pick_backend(args.backend)  # ranks inherit it
    if args.mem is not None:
        from flexpipe.runtime.measurement.memory_check import check_memory

        check_memory(job, args.mem)
    env = comm.env_launch()
    if env is None and args.ranks is None:
        raise ConfigError("give the number of pipeline ranks with -p/--ranks")
    if args.dry_run:
        return _dry_run(job, args)
    with runguards.checkpoint_dir(args, job, args.estimated_params, env):  # held for the run
        return _run(job, args, env)


def _dry_run(job: Job, args: argparse.Namespace) -> int:
    """Check the job as a launch does, print what the run would be (its first lines, or one
    JSON object) and start nothing."""
    from flexpipe.runtime.processes.launch import check_job

    check_job(job, job.world)
    head = run_report.header(job)
    what = (f"dry run: the job checks out; {job.world} processes would train "
            f"{job.train.steps} steps (nothing was started)")
    if args.json:
        print(json.dumps(head | {"dry_run": True, "world": job.world, "steps": job.train.steps}))
    else:
        how = args.partition if args.partition in ("auto", "params") else False
        print(f"{run_report.title(head, auto=how)}\n{what}")
    return 0


def _run(job: Job, args: argparse.Namespace, env: tuple[int, int] | None) -> int:
    """Launch (or join), print the steps as they end, and report."""
    head = run_report.header(job)
    out = sys.stderr if args.json else sys.stdout
    if env is None or env[0] == 0:
        how = args.partition if args.partition in ("auto", "params") else False
        print(run_report.title(head, auto=how), file=out, flush=True)
    amount, unit = run_report.throughput(job)
    metrics = metrics_for(job, args, amount)
    live = Live(job.train.steps, amount, unit, args.log_every, out, suffix=metrics.step)
    try:
        with live:
            ranks, cost = _launch(job, args, env, live)
    except (FlexPipeError, KeyboardInterrupt) as exc:
        _partial(job, head, live, args, exc)
        raise
    finally:
        metrics.close()
    if env is not None and env[0] != 0:
        return 0
    steps = live.steps if env is None else run_report.steps_of(ranks)
    report = head | run_report.from_steps(job, steps, ranks[0].start_step)
    trace = run_report.last_step(job, ranks)  # built once: the report, the file, the replay
    report |= run_report.measured(trace, ranks) | metrics.summary()
    if args.trace_out:
        _write_trace(job, ranks, trace, args.trace_out, args.json)
    if args.predict:
        report |= _predict(job, report, args, trace, ranks, cost)
    run_report.show(report, args.json)
    return 0


def _launch(job: Job, args: argparse.Namespace, env: tuple[int, int] | None,
            live: Live) -> tuple[list[Any], CostModel | None]:
    """Every rank's result, and the profiled cost model where ``--predict`` profiled on the
    ranks that trained (local processes, one per stage rank: ``then_profile``, no second
    launch); steps reach ``live`` as they end (under torchrun: this rank's own, printed by the
    rank that computes the loss of the first replica)."""
    from flexpipe.runtime.measurement.then_profile import train_then_profile
    from flexpipe.runtime.processes import launch
    from flexpipe.runtime.processes.progress import Step, StepLog

    if env is None:
        log = StepLog(job.world, live.step)
        placement = model_placement(job.schedule.placement)
        if args.predict and job.train.ep == 1 and placement.num_ranks == job.world:
            return train_then_profile(job, (job.model, placement, job.partition),
                                      threads=args.threads, timeout_s=args.timeout,
                                      on_update=log.add)
        return launch.launch([job], job.world, threads=args.threads, timeout_s=args.timeout,
                             on_update=log.add)[0], None

    def own(r: Any) -> None:  # every step counted (a failure report), those with a loss shown
        if r.rank < job.schedule.num_ranks * job.train.tp:
            live.step(Step(r.step, r.loss, r.seconds, r.peak_bytes, r.memory_kind),
                      shown=r.loss is not None)

    return launch.run_torchrun([job], timeout_s=args.timeout, on_step=own)[0], None


def _partial(job: Job, head: dict[str, Any], live: Live, args: argparse.Namespace,
             exc: BaseException) -> None:
    """Report the completed steps of a run that failed or was interrupted."""
    report = head | run_report.from_steps(job, live.steps)
    report["error"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else \
        str(exc).splitlines()[0]
    if args.checkpoint_dir is not None:
        report["steps_checkpointed"] = _checkpointed(args.checkpoint_dir)
    run_report.show(report, args.json)


def _checkpointed(folder: str) -> int:
    """The step of the newest intact checkpoint under ``folder`` (0: none usable)."""
    from flexpipe.runtime.processes import checkpoint as ck

    try:
        found = ck.latest(folder)
    except (ConfigError, OSError):
        return 0
    return 0 if found is None else found.step


def _write_trace(job: Job, ranks: list[Any], trace: Any, path: str,
                 as_json: bool = False) -> None:
    """The measured last step (``trace``, else built from ``ranks``) as a Chrome trace."""
    from flexpipe.runtime.measurement.measure import measured_trace
    from flexpipe.viz.chrome import dumps

    trace = trace or measured_trace(job.schedule, ranks)
    try:
        Path(path).write_text(dumps([trace], [f"{job.schedule.name} (measured)"]),
                              encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--trace-out {path!r}: cannot write ({exc.strerror})") from None
    announce(path, "the measured last step as a Chrome/Perfetto trace", as_json)


def _predict(job: Job, report: dict[str, Any], args: argparse.Namespace,
             trace: Any, ranks: list[Any], profiled: CostModel | None) -> dict[str, Any]:
    """Profile (unless the launch did: ``profiled``), simulate with the profiled costs and
    compare with the measured makespan; the measured last step replayed with its ops' own
    durations says how much of the error the op times account for (``flexpipe.sim.replay``;
    ``trace``: that step, ``run_report.last_step``).
    Expert-parallel: the passes' times are the run's last step's (``ranks``' results,
    ``passes.last_step_cost``: their all-to-alls run with the other ``ep`` ranks), and no
    activation peak is predicted (those times carry no memory)."""
    from flexpipe.cost.io import save_cost
    from flexpipe.ir.lower import lower
    from flexpipe.runtime.measurement.passes import last_step_cost
    from flexpipe.runtime.measurement.profile import profile
    from flexpipe.search.costs import fit_placement
    from flexpipe.sim.engine import simulate
    from flexpipe.sim.replay import replay

    placement = job.schedule.placement  # DualPipe: its p model stages, then both directions
    if profiled is None and job.train.ep == 1:
        profiled = profile(job.model, model_placement(placement), job.partition,
                           threads=args.threads)
    cost = last_step_cost(job.schedule, ranks) if profiled is None else fit_placement(
        profiled, placement)
    if args.cost_out:
        save_cost(cost, args.cost_out)
        announce(args.cost_out, "the profiled cost model, JSON", args.json)
    predicted = simulate(lower(job.schedule), cost).metrics()
    out: dict[str, Any] = {"predicted_makespan_ms": predicted.makespan,
                           "predicted_bubble_rate": predicted.bubble_rate}
    if job.train.ep == 1:
        out["predicted_activation_peak_bytes"] = list(predicted.peak_activation)
    if cost.comm.post:
        out["profiled_post_ms"] = cost.comm.post
    measured = report.get("measured_makespan_ms")
    if measured:
        out["prediction_error_pct"] = 100.0 * (predicted.makespan - measured) / measured
        out["replayed_makespan_ms"] = replay(trace, cost).metrics().makespan
    return out
