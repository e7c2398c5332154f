"""torchtitan's job-file keys in ``--config``: those FlexPipe honours are rewritten to FlexPipe's
own (a ``config.KEYS`` key or a ``run.OPTION``) with the same meaning; those it cannot honour are
refused by name with the reason. ``translate`` runs on the flattened file before
``flexpipe.cli.config`` applies it; docs/runtime.md lists both sets.

A ``[lr_scheduler]`` table takes torchtitan's defaults for the keys it leaves out
(``warmup_steps = 200``, ``decay_type = "linear"``), so a torchtitan job file schedules the
learning rate as torchtitan would; without the table the rate is constant (``--lr``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flexpipe.errors import ConfigError

RENAMED: dict[str, str] = {
    "job.dump_folder": "run.run-dir",
    "job.description": "run.description",
    "training.dataset_path": "run.data",
    "training.local_batch_size": "run.local-batch-size",
    "training.max_norm": "run.max-norm",
    "model.tokenizer_path": "run.tokenizer",
    "optimizer.lr": "run.lr",
    "optimizer.eps": "run.eps",
    "optimizer.beta1": "run.beta1",
    "optimizer.beta2": "run.beta2",
    "optimizer.weight_decay": "run.weight-decay",
    "lr_scheduler.warmup_steps": "run.warmup-steps",
    "lr_scheduler.decay_ratio": "run.decay-ratio",
    "lr_scheduler.decay_type": "run.decay-type",
    "lr_scheduler.min_lr_factor": "run.min-lr-factor",
    "metrics.log_freq": "run.log-every",
    "comm.train_timeout_seconds": "run.timeout",
    "parallelism.num_pp_microbatches": "parallelism.pipeline_parallel_microbatches",
}
"""torchtitan key -> the FlexPipe key of the same meaning."""

LR_DEFAULTS = {"lr_scheduler.warmup_steps": 200, "lr_scheduler.decay_type": "linear"}
"""torchtitan's defaults for the ``[lr_scheduler]`` keys whose FlexPipe default differs."""

REFUSED: dict[str, str] = {
    "training.dataset": "FlexPipe reads no named (downloaded) data set; give "
    "training.dataset_path: a text file or folder, a .bin/.npy token array or a "
    "datasets.save_to_disk folder",
    "training.enable_cpu_offload": "FSDP's CPU offload of parameters is not supported; a "
    "schedule's OFFLOAD/RELOAD ops move activations",
    "training.gc_freq": "FlexPipe collects garbage after every step, outside the timed step",
    "training.deterministic": "a run is deterministic by construction (seeded data, weights "
    "and layer random numbers); there is no switch",
    "model.flavor": "flavors name torchtitan's model registry; give [model] layers, hidden, "
    "heads and vocab",
    "model.norm_type": "the built-in gpt's norm is fixed (LayerNorm)",
    "model.converters": "no model converters (float8, ...) in FlexPipe",
    "optimizer.implementation": "FlexPipe's AdamW is torch's default implementation",
    "optimizer.early_step_in_backward": "the optimizer steps after the schedule's step",
    "checkpoint.keep_latest_k": "FlexPipe keeps the 2 newest complete checkpoints",
    "checkpoint.async_mode": "checkpoints are written synchronously",
    "checkpoint.model_weights_only": "a checkpoint always holds the optimizer state too",
    "checkpoint.export_dtype": "a checkpoint keeps the training dtype",
    "checkpoint.load_step": "a run resumes from the newest complete checkpoint",
    "checkpoint.initial_load_path": "a run resumes from its own --checkpoint-dir only",
    "checkpoint.exclude_from_loading": "a resume loads the whole state",
    "checkpoint.create_seed_checkpoint": "every rank builds the same seeded model",
    "metrics.enable_wandb": "no Weights & Biases logging; metrics go to metrics.jsonl and "
    "TensorBoard",
    "metrics.save_for_all_ranks": "the launcher writes one metrics file for the run",
    "validation.dataset": "the validation loss uses the held-out windows of --data",
    "validation.dataset_path": "the validation loss uses the held-out windows of --data "
    "(--val-fraction)",
    "validation.steps": "a validation takes one batch of held-out micro-batches per replica",
    "validation.local_batch_size": "a validation batch is a training batch's size",
    "validation.seq_len": "a validation window is a training window's length",
    "parallelism.pipeline_parallel_schedule_csv": "give the schedule as a FlexPipe file or "
    "name (pipeline_parallel_schedule)",
    "parallelism.pipeline_parallel_first_stage_less_layers": "give the layers per stage "
    "(pipeline_parallel_layers_per_stage) or split points",
    "parallelism.pipeline_parallel_last_stage_less_layers": "give the layers per stage "
    "(pipeline_parallel_layers_per_stage) or split points",
    "parallelism.enable_async_tensor_parallel": "tensor parallelism runs torch's synchronous "
    "DTensor collectives",
    "parallelism.fsdp_reshard_after_forward": "FSDP's gathers and scatters are the schedule's "
    "own AG/RS ops",
    "parallelism.disable_loss_parallel": "the built-in gpt's loss is not vocabulary-parallel",
    "activation_checkpoint.selective_ac_option": "recomputation is a property of the schedule "
    "(its recompute ops), not of the job",
}
"""torchtitan key -> why FlexPipe refuses it."""

REFUSED_TABLES: dict[str, str] = {
    "profiling": "give --trace-out FILE for a Chrome/Perfetto trace of the last step",
    "float8": "no float8 training in FlexPipe",
    "mx": "no MX formats in FlexPipe",
    "compile": "no torch.compile of the stages",
    "fault_tolerance": "no torchft; a failed run resumes from its newest checkpoint",
    "experimental": "no custom torchtitan modules",
    "memory_estimation": "give --mem LIMIT: the simulated peak memory is checked before the run",
    "quantize": "no quantized training",
}
"""torchtitan table -> why FlexPipe refuses every key of it."""

Flat = dict[str, Any]
Handler = Callable[[str, Any, Mapping[str, Any]], Flat]


def _optimizer(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    names = {"adamw": "adamw", "sgd": "sgd"}
    if not isinstance(value, str) or value.lower() not in names:
        raise ConfigError(f"{path}: optimizer.name: {value!r}: FlexPipe trains with AdamW or "
                          "SGD")
    return {"run.optimizer": names[value.lower()]}


def _assets(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    return {"run.tokenizer": str(Path(str(value)) / "tokenizer.json")}


def _checkpoint(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    """torchtitan's ``enable_checkpoint``: checkpoints in ``dump_folder/folder`` every
    ``interval`` steps (without it: after the last step)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: checkpoint.enable: expected true or false, got {value!r}")
    if not value:
        return {}
    folder = Path(str(flat.get("checkpoint.folder", "checkpoint")))
    out: Flat = {"run.checkpoint-dir": str(Path(str(flat.get("job.dump_folder", "."))) / folder)}
    if "checkpoint.interval" in flat:
        out["run.checkpoint-every"] = flat["checkpoint.interval"]
    return out


def _validation(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    """torchtitan's ``validation.enable``: a validation loss every ``freq`` steps."""
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: validation.enable: expected true or false, got {value!r}")
    return {"run.val-every": flat.get("validation.freq", 10)} if value else {}


def _tensorboard(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: metrics.enable_tensorboard: expected true or false, got "
                          f"{value!r}")
    return {"run.tensorboard": "on" if value else "off"}


def _only(key: str, allowed: tuple[Any, ...], reason: str) -> Handler:
    """A key FlexPipe honours at the values ``allowed`` only (they need nothing of it)."""
    def handle(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
        if value not in allowed:
            raise ConfigError(f"{path}: {key} = {value!r}: {reason}")
        return {}
    return handle


def _degree(path: str, key: str, value: Any) -> int:
    """A data-parallel degree: a positive integer, or torchtitan's -1 (the ranks left: none
    here), read as 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
        raise ConfigError(f"{path}: parallelism.{key}: expected a positive integer or -1, got "
                          f"{value!r}")
    return max(value, 1)


def _shard(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    """torchtitan's ``data_parallel_shard_degree``: FSDP2 over that many ranks under any
    schedule (``run --fsdp``); 1 or -1 shard nothing. With ``data_parallel_replicate_degree``
    given too, that key's handler reads both (``_replicate``)."""
    shard = _degree(path, "data_parallel_shard_degree", value)
    if "parallelism.data_parallel_replicate_degree" in flat or shard == 1:
        return {}
    return {"parallelism.data_parallel_replicate_degree": shard, "run.fsdp": True}


def _replicate(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    """torchtitan's ``data_parallel_replicate_degree`` R: replicas of the pipeline (``--dp``);
    with ``data_parallel_shard_degree`` S > 1 too, HSDP: ``--dp`` R x S ``--fsdp``
    ``--dp-replicate`` R (R groups, each sharding over S ranks)."""
    replicate = _degree(path, "data_parallel_replicate_degree", value)
    shard = _degree(path, "data_parallel_shard_degree",
                    flat.get("parallelism.data_parallel_shard_degree", 1))
    out: Flat = {"parallelism.data_parallel_replicate_degree": replicate * shard}
    if shard > 1:
        out["run.fsdp"] = True
    if shard > 1 and replicate > 1:
        out["run.dp-replicate"] = replicate
    return out


def _consumed(path: str, value: Any, flat: Mapping[str, Any]) -> Flat:
    return {}  # read by another key's handler


HANDLERS: dict[str, Handler] = {
    "optimizer.name": _optimizer,
    "model.hf_assets_path": _assets,
    "checkpoint.enable": _checkpoint,
    "checkpoint.enable_checkpoint": _checkpoint,
    "checkpoint.folder": _consumed,
    "checkpoint.interval": _consumed,
    "validation.enable": _validation,
    "validation.freq": _consumed,
    "metrics.enable_tensorboard": _tensorboard,
    "metrics.save_tb_folder": _only("metrics.save_tb_folder", ("tb",),
                                    "TensorBoard's events go to RUN_DIR/tb"),
    "activation_checkpoint.mode": _only("activation_checkpoint.mode", ("none",),
                                        "recomputation is a property of the schedule (its "
                                        "recompute ops), not of the job"),
    "parallelism.data_parallel_shard_degree": _shard,
    "parallelism.data_parallel_replicate_degree": _replicate,
    "parallelism.context_parallel_degree": _only(
        "parallelism.context_parallel_degree", (1,), "no context parallelism in FlexPipe"),
}
"""torchtitan keys whose FlexPipe form depends on their value (or on another key)."""


def translate(path: str, flat: Mapping[str, Any]) -> Flat:
    """``flat`` (``table.key`` -> value) with torchtitan's keys in FlexPipe's form; a refused
    key is a ``ConfigError`` naming the file, the key and the reason."""
    given = dict(flat)
    if any(k.startswith("lr_scheduler.") for k in given):
        given = {k: v for k, v in LR_DEFAULTS.items() if RENAMED[k] not in given} | given
    out: Flat = {}
    for key, value in given.items():
        table = key.partition(".")[0]
        if key in REFUSED or table in REFUSED_TABLES:
            reason = REFUSED.get(key) or REFUSED_TABLES[table]
            raise ConfigError(f"{path}: {key}: not supported: {reason}")
        parts = HANDLERS[key](path, value, given) if key in HANDLERS else \
            {RENAMED.get(key, key): value}
        for name, new in parts.items():
            if name in out or (name != key and name in given):
                raise ConfigError(f"{path}: {key} and {name} set the same option; give one")
            out[name] = new
    return out
