"""``flexpipe run``'s checks before any rank starts, beyond the schedule's: the model's memory
(estimated from its shapes, or from its factory built on torch's ``meta`` device: nothing is
allocated) against what this machine has, and the checkpoint directory (writable, nothing in
the way of what the run will write, room for one checkpoint when the run will write one: as
much as the checkpoint it resumes from takes, else estimated; locked for this run;
``flexpipe.runtime.processes.ckdir``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from flexpipe.cli import guards
from flexpipe.errors import ConfigError

if TYPE_CHECKING:  # the CLI imports torch only when it runs a job
    from flexpipe.runtime.processes.train import Job


def _this_machine(args: argparse.Namespace, stages: int) -> float:
    """The share of the whole job's memory that lands on this machine: every replica of a
    local launch; under torchrun, this node's ranks (``LOCAL_WORLD_SIZE``) of the world."""
    world = os.environ.get("WORLD_SIZE")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world and local and world.isdigit() and local.isdigit() and int(world) > 0:
        return args.dp * int(local) / int(world)
    return float(args.dp)


def guard_model(args: argparse.Namespace, spec: Any, stages: int,
                microbatches: int) -> int | None:
    """Refuse a model whose training would take more than ``guards.SHARE`` of this machine's
    available memory (unless ``--no-size-guard``), before anything is allocated; its estimated
    parameter count (None: not estimated). ``spec``: the built-in ``ModelSpec``, or None for
    ``--model PKG.MODULE:FACTORY`` (then built on the meta device)."""
    from flexpipe.runtime.processes import modelsize

    if spec is None:
        from flexpipe.runtime.user.model import load_factory

        sys.path.insert(0, os.getcwd())
        count = modelsize.factory_params(lambda: load_factory(args.model, args.seed))
        if count is None:
            return None
        what = f"the model of {args.model} ({count:,} parameters)"
        est = modelsize.estimate(argparse.Namespace(name="user"), 0, args.optimizer, count)
    else:
        est = modelsize.estimate(spec, min(microbatches, stages), args.optimizer)
        what = f"the {spec.name} model (hidden {spec.hidden}, {spec.layers} layers, " \
            f"{est.params:,} parameters)" if est else ""
    if est is None:
        return None
    need, have = est.total * _this_machine(args, stages), guards.available_memory()
    if not args.no_size_guard and need > guards.SHARE * have:
        raise ConfigError(
            f"{what} needs about {guards.size(need)} to train here (weights, gradients and "
            f"optimizer state {guards.size(est.static_bytes)}, activations "
            f"{guards.size(est.activation_bytes)}), more than {guards.SHARE:.0%} of the "
            f"{guards.size(have)} this machine has available; use a smaller model, or give "
            f"--no-size-guard to try anyway")
    return est.params


@contextlib.contextmanager
def checkpoint_dir(args: argparse.Namespace, job: Job, params: int | None,
                   env: tuple[int, int] | None) -> Iterator[None]:
    """Check and lock ``--checkpoint-dir`` for the run (the launcher, or torchrun's rank 0);
    the lock is held until the block ends."""
    if job.train.checkpoint_dir is None or (env is not None and env[0] != 0):
        yield
        return
    from flexpipe.runtime.processes import ckdir, manifests, modelsize

    root, train = job.train.checkpoint_dir, job.train
    nbytes = modelsize.DTYPE_BYTES.get(getattr(job.model, "dtype", "float32"), 4)
    resume, used = manifests.resume_point(root)
    need = used or ckdir.checkpoint_bytes(params or 0, nbytes, train.optimizer)
    plan = ckdir.plan_for(need, resume, train.steps, train.checkpoint_every)
    with ckdir.prepare(root, plan, _say):
        yield


def _say(line: str) -> None:
    print(f"checkpoint: {line}", file=sys.stderr, flush=True)
