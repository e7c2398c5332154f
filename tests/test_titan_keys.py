"""torchtitan's job-file keys in ``--config`` (``flexpipe.cli.titan``): honoured ones take
FlexPipe's options of the same meaning, the others are refused by name with the reason, and
examples/llama_job.toml (torchtitan's layout) becomes a run's settings."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexpipe.cli import cmd_run, config, titan
from flexpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def run_parser() -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser."""
    top = argparse.ArgumentParser()
    cmd_run.register(top.add_subparsers())
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def parsed(tmp_path: Path, text: str, *argv: str) -> argparse.Namespace:
    job = tmp_path / "job.toml"
    job.write_text(text, encoding="utf-8")
    parser = run_parser()
    config.apply(parser, "run", str(job))
    return parser.parse_args(["1f1b", *argv])


def test_torchtitan_keys_set_the_options_of_the_same_meaning(tmp_path: Path) -> None:
    args = parsed(tmp_path, """
[job]
dump_folder = "out"
description = "a test"
[optimizer]
name = "AdamW"
lr = 0.002
eps = 1e-6
beta1 = 0.8
beta2 = 0.95
weight_decay = 0.1
[lr_scheduler]
warmup_steps = 3
decay_ratio = 0.5
decay_type = "cosine"
min_lr_factor = 0.1
[training]
max_norm = 1.0
local_batch_size = 8
dataset_path = "examples/data/tiny_text.txt"
[metrics]
log_freq = 5
[checkpoint]
enable_checkpoint = true
folder = "ck"
interval = 4
[validation]
enable = true
freq = 7
[activation_checkpoint]
mode = "none"
[parallelism]
num_pp_microbatches = 4
""")
    assert (args.run_dir, args.description, args.optimizer, args.lr, args.eps) == \
        ("out", "a test", "adamw", 0.002, 1e-6)
    assert (args.beta1, args.beta2, args.weight_decay, args.max_norm) == (0.8, 0.95, 0.1, 1.0)
    assert (args.warmup_steps, args.decay_ratio, args.decay_type, args.min_lr_factor) == \
        (3, 0.5, "cosine", 0.1)
    assert (args.local_batch_size, args.data, args.log_every, args.microbatches) == \
        (8, "examples/data/tiny_text.txt", 5, 4)
    assert (args.checkpoint_dir, args.checkpoint_every, args.val_every) == \
        (str(Path("out") / "ck"), 4, 7)


def test_an_lr_scheduler_table_takes_torchtitans_defaults(tmp_path: Path) -> None:
    args = parsed(tmp_path, "[lr_scheduler]\nmin_lr_factor = 0.2\n")
    assert (args.warmup_steps, args.decay_type) == (200, "linear")
    plain = parsed(tmp_path, "[training]\nsteps = 3\n")
    assert (plain.warmup_steps, plain.decay_type) == (0, "constant")
    own = parsed(tmp_path, "[lr_scheduler]\ndecay_type = 'sqrt'\n[run]\nwarmup-steps = 5\n")
    assert (own.warmup_steps, own.decay_type) == (5, "sqrt")


@pytest.mark.parametrize(("text", "words"), [
    ("[training]\ndataset = 'c4'\n", "training.dataset: not supported: FlexPipe reads no named"),
    ("[model]\nflavor = 'debugmodel'\n", "model.flavor: not supported: flavors name"),
    ("[float8]\nenable_fsdp_float8_all_gather = true\n", "float8.enable_fsdp_float8_all_gather:"
     " not supported: no float8"),
    ("[checkpoint]\nkeep_latest_k = 3\n", "keeps the 2 newest complete checkpoints"),
    ("[activation_checkpoint]\nmode = 'full'\n", "activation_checkpoint.mode = 'full': "
     "recomputation is a property of the schedule"),
    ("[parallelism]\ncontext_parallel_degree = 2\n", "no context parallelism"),
    ("[optimizer]\nname = 'Lion'\n", "optimizer.name: 'Lion': FlexPipe trains with AdamW or SGD"),
    ("[optimizer]\nlr = 0.1\n[run]\nlr = 0.2\n", "optimizer.lr and run.lr set the same option"),
    ("[metrics]\nenable_tensorboard = 'yes'\n", "expected true or false"),
])
def test_what_flexpipe_cannot_honour_is_refused_by_name(tmp_path: Path, text: str,
                                                        words: str) -> None:
    with pytest.raises(ConfigError, match="job.toml: .*") as err:
        parsed(tmp_path, text)
    assert words in str(err.value)


def test_an_unknown_key_is_still_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="training.stepz: unknown key; did you mean"):
        parsed(tmp_path, "[training]\nstepz = 3\n")


def test_every_listed_key_is_documented_and_no_key_is_both_kept_and_refused() -> None:
    page = (ROOT / "docs" / "runtime.md").read_text(encoding="utf-8")
    for key in [*titan.RENAMED, *titan.HANDLERS, *titan.REFUSED]:
        assert f"`{key}`" in page, key
    assert not set(titan.RENAMED) & set(titan.REFUSED)
    assert not set(titan.HANDLERS) & (set(titan.REFUSED) | set(titan.RENAMED))


def test_the_llama_job_file_reads_as_a_run(tmp_path: Path) -> None:
    parser = run_parser()
    config.apply(parser, "run", str(ROOT / "examples" / "llama_job.toml"))
    args = parser.parse_args([])
    assert args.data == "examples/data/tiny_text.txt" and args.optimizer == "adamw"
    assert args.warmup_steps > 0 and args.decay_type == "cosine" and args.max_norm == 1.0
    assert args.ranks == 2 and args.val_every > 0


@given(st.dictionaries(st.sampled_from(sorted(titan.RENAMED)), st.integers(0, 9), max_size=6),
       st.one_of(st.none(), st.sampled_from(sorted(titan.REFUSED))))
def test_translate_renames_each_key_keeping_its_value_and_names_a_refused_one(
        keys: dict[str, int], refused: str | None) -> None:
    flat: dict[str, object] = dict(keys)
    if refused is not None:
        flat[refused] = 1
        with pytest.raises(ConfigError, match=f"f.toml: {refused}: not supported: "):
            titan.translate("f.toml", flat)
        return
    out = titan.translate("f.toml", flat)
    for key, value in keys.items():
        assert out[titan.RENAMED[key]] == value
    extra = set(out) - {titan.RENAMED[k] for k in keys}
    assert extra <= {titan.RENAMED[k] for k in titan.LR_DEFAULTS}  # torchtitan's defaults


def test_a_shard_degree_runs_fsdp_over_that_many_replicas(tmp_path: Path) -> None:
    args = parsed(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\n")
    assert args.dp == 2 and args.fsdp
    assert not parsed(tmp_path, "[parallelism]\ndata_parallel_shard_degree = -1\n").fsdp
    plain = parsed(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\n"
                             "data_parallel_replicate_degree = 1\n")
    assert (plain.dp, plain.fsdp, plain.dp_replicate) == (2, True, 1)


def test_replicate_and_shard_degrees_run_hsdp(tmp_path: Path) -> None:
    """torchtitan's HSDP: R replica groups x S shards -> --dp R*S --fsdp --dp-replicate R."""
    args = parsed(tmp_path, "[parallelism]\ndata_parallel_replicate_degree = 2\n"
                            "data_parallel_shard_degree = 3\n")
    assert (args.dp, args.fsdp, args.dp_replicate) == (6, True, 2)
    ddp = parsed(tmp_path, "[parallelism]\ndata_parallel_replicate_degree = 2\n"
                           "data_parallel_shard_degree = -1\n")
    assert (ddp.dp, ddp.fsdp, ddp.dp_replicate) == (2, False, 1)
    with pytest.raises(ConfigError, match="data_parallel_shard_degree: expected a positive"):
        parsed(tmp_path, "[parallelism]\ndata_parallel_replicate_degree = 2\n"
                         "data_parallel_shard_degree = 0\n")


def test_the_expert_parallel_degree_sets_ep(tmp_path: Path) -> None:
    args = parsed(tmp_path, "[parallelism]\nexpert_parallel_degree = 2\n")
    assert args.ep == 2
