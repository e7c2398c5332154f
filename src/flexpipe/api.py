"""The public pipeline API, ``flexpipe.pipeline``: your model and a schedule named as anywhere
else in FlexPipe (a library name, a schedule file, a DSL ``.py`` program, ``torch:NAME``; or a
``Schedule`` or search result) -> this rank's ``flexpipe.Pipeline`` (``step``/``eval`` in your
own training loop; ``flexpipe.runtime.pipeline.api``, built by
``flexpipe.runtime.pipeline.build``). It sits above the runtime because names are read by
``flexpipe.specs``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def pipeline(model: Any, schedule: Any, *, loss_fn: Any = None, m: int | None = None,
             dp: int | None = None, split_points: Sequence[str] = (),
             partition: str | Sequence[int] = "layers", example: Any = None,
             seed: int | None = None, timeout_s: float = 60.0, lookahead: int = 2,
             tp: int | None = None, tp_plan: Any = None, mesh: Any = None,
             loss_items: Any = None, mixed_precision: Any = None, overlap_reduce: bool = True,
             fsdp: bool = False, ep: int | None = None, ep_plan: Any = None,
             overlap_pairs: bool = True, recompute: Any = None, dp_replicate: int = 1,
             **params: object) -> Any:
    """This rank's ``Pipeline`` of ``model`` under ``schedule`` (joins torchrun's process
    group when none is set up yet).

    ``model``: an ``nn.Sequential`` or list of layers, cut by ``partition`` (``layers``: even
    counts; ``flops``: the ranks' counted FLOPs on ``example``, the inputs of one micro-batch;
    ``params``: the ranks' parameters; or layers per stage); any ``nn.Module`` with
    ``split_points`` (the modules that start stages 1, 2, ...; none: points balancing the
    ranks' parameters; skips across stages become stage-graph edges); or a
    ``flexpipe.UserModel``. Every rank must build the same initial
    weights (seed torch first; checked). ``schedule``: a library name or file (``m``
    micro-batches, p = world size / (``dp`` x ``ep`` x ``tp``), or the ``mesh``'s ``pp``
    size, generator ``params``), a DSL ``.py`` program, a ``Schedule`` or a search result.
    ``loss_fn(*outputs, target)``: a micro-batch's mean loss; ``loss_items(target)``: how
    many items it averages over (``(target != -100).sum()`` for a token mean), so that the
    micro-batches weigh by their items and the gradient is one device's on the whole batch
    (None: each weighs 1 / m). ``seed``: per-layer dropout
    seeds (masks independent of the schedule). ``dp``/``tp``: data-parallel replicas and
    tensor-parallel ranks (None: the ``mesh``'s, else 1); ``tp_plan``: module-name pattern ->
    ``colwise``/``rowwise``; ``mesh``: your own DeviceMesh (dimensions ``pp`` and optional
    ``dp``, ``ep``, ``tp``). ``ep``: expert-parallel ranks (each MoE layer's experts shared
    out over them, tokens exchanged by all-to-all; they train on data of their own, as
    replicas do); ``ep_plan``: experts module-name pattern -> ``stacked``/``list`` (None: the
    ``UserModel``'s, else the Hugging Face family's built-in plan). ``mixed_precision``:
    ``"bf16"`` trains as torchtitan's bf16 runs do (bfloat16 compute copies, float32 master
    weights, optimizer state, gradient accumulation and reduction), or a
    ``MixedPrecision`` policy; None: the model's own dtype.
    ``overlap_reduce``: each stage's gradients average over the replicas as soon as they are
    final in the step, behind the compute still to come (False: all after the step).
    ``fsdp``: shard every stage over the ``dp`` replicas with torch's FSDP2 under any schedule
    (gathered before the stage's first pass of the step, reduce-scattered after its last;
    each repeated block of a stage, a transformer block, is its own FSDP2 unit).
    ``dp_replicate``: HSDP, the ``dp`` ranks as that many replica groups of
    ``dp / dp_replicate`` shards each (FSDP2's own HSDP on the mesh ``(dp_replicate,
    dp_shard)``; with ``fsdp`` or a schedule with AG/RS; with ``ep``, each group's shards
    over its ``dp / dp_replicate x ep`` ranks, the experts left whole); every rank still
    trains on its own micro-batches.
    ``overlap_pairs``: run the two passes of each overlapped pair of the schedule (DualPipe's
    F&B) at once, each one's expert all-to-alls behind the other's compute (False: one after
    the other, in the same order).
    ``recompute``: selective recompute in a traced model, ``flexpipe.Recompute(drop=(MyMLP,
    "attn"), keep=..., every=2)`` (module types or name patterns; every n-th); the modules the
    model checkpoints itself (``torch.utils.checkpoint``, ``gradient_checkpointing_enable()``)
    are dropped too; under a schedule without SR or R, an SR goes before each backward."""
    from flexpipe.errors import ConfigError
    from flexpipe.runtime.pipeline.build import build_pipeline, join_group

    if isinstance(schedule, str):
        from flexpipe.specs import load

        _rank, world, _owns = join_group(timeout_s)
        spread = (dp or 1) * (tp or 1) * (ep or 1)
        if mesh is not None:
            from flexpipe.runtime.transport.mesh import mesh_sizes

            schedule = load(schedule, mesh_sizes(mesh)["pp"], m, **params)
        elif spread < 1 or world % spread:
            raise ConfigError(f"world size {world} is not a multiple of dp x ep x tp = "
                              f"{spread}")
        else:
            schedule = load(schedule, world // spread, m, **params)
    elif params or m is not None:
        raise ConfigError("m and generator parameters apply to a schedule given by name; this "
                          "schedule is already built")
    return build_pipeline(model, schedule, loss_fn=loss_fn, dp=dp, split_points=split_points,
                          partition=partition, example=example, seed=seed,
                          timeout_s=timeout_s, lookahead=lookahead, tp=tp, tp_plan=tp_plan,
                          mesh=mesh, loss_items=loss_items,
                          mixed_precision=mixed_precision, overlap_reduce=overlap_reduce, fsdp=fsdp,
                          ep=ep, ep_plan=ep_plan, overlap_pairs=overlap_pairs,
                          recompute=recompute, dp_replicate=dp_replicate)
