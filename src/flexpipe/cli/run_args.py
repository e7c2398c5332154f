"""``flexpipe run``'s options of a training job proper: the data (``--data``, ``--tokenizer``,
the held-out share and how often its loss is taken), the learning-rate schedule (torchtitan's
``[lr_scheduler]``), AdamW's settings, gradient clipping, the run folder (metrics.jsonl,
TensorBoard), the peak FLOP/s that MFU is measured against and mixed precision
(``--mixed-precision bf16``: float32 master weights); ``train_settings`` turns them into
``TrainConfig`` fields after checking them together."""

from __future__ import annotations

import argparse
import math
from typing import Any

from flexpipe.cli.common import positive_int, positive_number
from flexpipe.errors import ConfigError


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    if text.strip() == "0":
        return 0
    return positive_int(text)


def fraction(text: str) -> float:
    """argparse type: a number from 0 to 1."""
    try:
        value = float(text) if text.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return 0.0 if text.strip() in ("0", "0.0") else positive_number(text)


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Add the data, schedule, optimizer, metrics and run-folder options."""
    add = parser.add_argument
    add("--data", metavar="PATH", help="train the gpt on this data instead of the synthetic "
        "text: a UTF-8 text file or folder (bytes, or --tokenizer), a .npy/.bin token array "
        "(.bin: uint16, memory-mapped) or a datasets.save_to_disk folder; the model's "
        "vocabulary is raised to the data's")
    add("--tokenizer", metavar="FILE", help="with --data text: a tokenizers tokenizer.json")
    add("--val-fraction", type=fraction, default=0.1,
        help="with --data: the share of its windows held out for the validation loss")
    add("--val-every", type=count, default=0, metavar="K",
        help="with --data: the validation loss every K steps and after the last (0: never)")
    add("--local-batch-size", type=positive_int, metavar="N",
        help="samples per replica per step (torchtitan's): sets m = N / micro-batch size")
    add("--warmup-steps", type=count, default=0, help="linear warm-up steps of the lr")
    add("--decay-type", choices=("linear", "sqrt", "cosine", "constant"), default="constant",
        help="the lr's decay after the warm-up (torchtitan's names)")
    add("--decay-ratio", type=fraction, metavar="R", help="decay over the last R of the steps "
        "(a stable phase before it: WSD; default: every step after the warm-up)")
    add("--min-lr-factor", type=fraction, default=0.0,
        help="the decay ends at this share of --lr")
    add("--beta1", type=fraction, default=0.9, help="AdamW's beta1")
    add("--beta2", type=fraction, default=0.999, help="AdamW's beta2")
    add("--eps", type=positive_number, default=1e-8, help="AdamW's epsilon")
    add("--weight-decay", type=non_negative, default=0.01, help="AdamW's weight decay")
    add("--max-norm", type=positive_number, help="clip the gradients to this total norm over "
        "the whole model (Pipeline.clip_grad_norm_)")
    add("--run-dir", metavar="DIR", help="write metrics.jsonl (one JSON object per logged "
        "step) and TensorBoard events (DIR/tb) here")
    add("--tensorboard", choices=("auto", "on", "off"), default="auto",
        help="TensorBoard events in --run-dir: auto writes them when tensorboard is installed")
    add("--peak-flops", type=positive_number, metavar="FLOPS",
        help="one device's peak FLOP/s for MFU (default: a table of known GPUs; the CPU's "
        "measured matmul rate)")
    add("--description", metavar="TEXT", help="what the run is for (in metrics.jsonl)")
    add("--mixed-precision", choices=("bf16", "bfloat16", "fp32", "float32"),
        help="bf16: compute on bfloat16 copies of float32 master weights (float32 gradients, "
        "optimizer state, reduction), as torchtitan's mixed_precision_param (default: none)")
    add("--mixed-precision-reduce", choices=("float32", "fp32", "bfloat16", "bf16"),
        default="float32", help="with --mixed-precision: the gradients' reduction dtype")


def train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TrainConfig`` fields of these options (a ``ConfigError`` for a bad mix)."""
    from flexpipe.runtime.data.corpus import DataConfig
    from flexpipe.runtime.processes.lrschedule import LRSchedule

    if args.data is None and (args.tokenizer or args.val_every):
        flag = "--tokenizer" if args.tokenizer else "--val-every"
        raise ConfigError(f"{flag} needs --data (it applies to the data read from disk)")
    if args.data is not None and args.model != "gpt":
        raise ConfigError(f"--data feeds the built-in gpt; --model {args.model} draws its own "
                          "data (a model of your own: its factory's sample)")
    data = DataConfig(args.data, args.tokenizer, args.val_fraction) if args.data else None
    if data is not None and args.val_every and args.val_fraction == 0:
        raise ConfigError("--val-every needs held-out windows: --val-fraction is 0")
    schedule = LRSchedule(args.steps, args.warmup_steps, args.decay_ratio, args.decay_type,
                          args.min_lr_factor)
    constant = schedule == LRSchedule(args.steps)
    return {"betas": (args.beta1, args.beta2), "eps": args.eps,
            "weight_decay": args.weight_decay, "max_norm": args.max_norm, "data": data,
            "val_every": args.val_every, "lr_schedule": None if constant else schedule,
            "mixed_precision": mixed_precision(args)}


def data_vocab(args: argparse.Namespace) -> None:
    """With ``--data``: raise ``--vocab`` to the data's vocabulary (read once here)."""
    if args.data is None:
        return
    from flexpipe.runtime.data.corpus import DataConfig, vocab_needed

    args.vocab = max(args.vocab, vocab_needed(DataConfig(args.data, args.tokenizer)))


def local_batch(args: argparse.Namespace) -> None:
    """``--local-batch-size``: m = N / micro-batch size (torchtitan's local batch per
    replica), which must be whole and agree with -m."""
    local = args.local_batch_size
    if local is None:
        return
    if local % args.micro_batch_size:
        raise ConfigError(f"--local-batch-size {local} is not a multiple of the micro-batch "
                          f"size {args.micro_batch_size}")
    m = local // args.micro_batch_size
    if args.microbatches is not None and args.microbatches != m:
        raise ConfigError(f"-m {args.microbatches} disagrees with --local-batch-size {local} "
                          f"(= {m} micro-batches of {args.micro_batch_size})")
    args.microbatches = m


def global_batch(args: argparse.Namespace) -> None:
    """``--global-batch-size``: m = GBS / (micro-batch size x dp), which must be a whole
    number and agree with -m when both are given."""
    gbs = args.global_batch_size
    if gbs is None:
        return
    per_mb = args.micro_batch_size * args.dp
    if gbs % per_mb:
        raise ConfigError(f"--global-batch-size {gbs} is not a multiple of micro-batch size "
                          f"{args.micro_batch_size} x dp {args.dp} = {per_mb}")
    m = gbs // per_mb
    if args.microbatches is not None and args.microbatches != m:
        raise ConfigError(f"-m {args.microbatches} disagrees with --global-batch-size {gbs} "
                          f"(= {m} micro-batches of {args.micro_batch_size} x dp {args.dp})")
    args.microbatches = m


def mixed_precision(args: argparse.Namespace) -> Any:
    """The policy of ``--mixed-precision`` and ``--mixed-precision-reduce`` (None: off)."""
    if args.mixed_precision is None:
        return None
    from flexpipe.runtime.execution.precision import policy

    if args.dtype != "float32":
        raise ConfigError(f"--mixed-precision keeps float32 master weights; --dtype "
                          f"{args.dtype} would build the model in another dtype: leave "
                          "--dtype at float32")
    return policy({"param": args.mixed_precision, "reduce": args.mixed_precision_reduce})
