"""Building a rank's ``Pipeline`` (what ``flexpipe.pipeline`` returns): join the process
group, take the schedule (or a search result's best), cut the model into the schedule's
stages (split points, a partition of a chain of layers, or points found automatically), fit
the schedule to the model's stage graph, check every rank built the same weights, and keep
the stages this rank runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.sharded import shard_per_step
from flexpipe.runtime.execution import precision
from flexpipe.runtime.execution.fsdp import check_replicate
from flexpipe.runtime.execution.handlers import check_supported
from flexpipe.runtime.execution.parallel import Parallel
from flexpipe.runtime.execution.segments import build_graph_stages, check_graph
from flexpipe.runtime.execution.stage import LossFn
from flexpipe.runtime.execution.twoway import build_two_way_stages, refuse_two_way
from flexpipe.runtime.measurement.balance import split_layers
from flexpipe.runtime.pipeline import items, state
from flexpipe.runtime.pipeline.api import Pipeline
from flexpipe.runtime.processes.jobcheck import agree_weights
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.user.experts import family_plan
from flexpipe.runtime.user.interface import as_inputs, loss_for
from flexpipe.runtime.user.model import (
    UserModel,
    cut_for,
    fit_graph,
    layer_list,
    model_graph,
    original_names,
)
from flexpipe.runtime.user.recompute import as_recompute, has_regions
from flexpipe.schedules.dualpipe_twoway import is_two_way, model_placement
from flexpipe.schedules.recompute import with_recompute
from flexpipe.sim.validate import check


def join_group(timeout_s: float) -> tuple[int, int, bool]:
    """(rank, world size, whether we joined the group here): the process group already set up
    (``flexpipe.spawn``, your own code) or torchrun's, joined now; with neither, a group of
    this one process (a one-rank schedule: the one-process pipeline, the reference)."""
    if comm.world_size():
        return comm.my_rank(), comm.world_size(), False
    env = comm.env_launch() or (0, 1)
    comm.init(env[0], env[1], timeout_s=timeout_s)
    return env[0], env[1], True


def resolve_schedule(schedule: Any) -> Schedule:
    """A ``Schedule``, or a search result's best schedule (names and files are read above the
    runtime, by ``flexpipe.api.pipeline`` through ``flexpipe.specs``)."""
    best = getattr(schedule, "best", getattr(schedule, "schedule", schedule))
    if not isinstance(best, Schedule):
        raise ConfigError(f"schedule must be a Schedule, a library name, a file, a DSL program "
                          f"or a search result, got {type(schedule).__name__}")
    return best


def build_pipeline(model: nn.Module | Sequence[nn.Module] | UserModel, schedule: Any, *,
                   loss_fn: LossFn | None = None, dp: int | None = None,
                   split_points: Sequence[str] = (), partition: str | Sequence[int] = "layers",
                   example: Any = None, seed: int | None = None, timeout_s: float = 60.0,
                   lookahead: int = 2, tp: int | None = None,
                   tp_plan: Mapping[str, str] | None = None, mesh: Any = None,
                   loss_items: items.ItemCount | None = None,
                   mixed_precision: Any = None, overlap_reduce: bool = True,
                   fsdp: bool = False, ep: int | None = None,
                   ep_plan: Mapping[str, str] | None = None,
                   overlap_pairs: bool = True, recompute: Any = None,
                   dp_replicate: int = 1) -> Pipeline:
    """This rank's ``Pipeline`` of ``model`` under ``schedule`` (what ``flexpipe.pipeline``
    returns; here the schedule is a ``Schedule`` or a search result).

    ``model``: an ``nn.Sequential`` / list of layers (cut by ``partition``: ``layers`` even,
    ``flops`` counted on ``example``, the inputs of one micro-batch, ``params``, or layers per
    stage), any ``nn.Module`` with ``split_points`` (module names starting stages 1, 2, ...;
    none: points balancing the ranks' parameters), or a ``UserModel``. Every rank must build
    the same initial weights (seed torch first).
    ``dp``, ``tp``: data-parallel replicas and tensor-parallel ranks per pipeline rank (world
    size = the schedule's ranks x dp x tp; None: the ``mesh``'s, else 1); ``tp_plan``:
    module-name pattern -> ``colwise``/``rowwise`` (torch's ``ColwiseParallel`` /
    ``RowwiseParallel``; default: the ``UserModel``'s); ``mesh``: your own DeviceMesh with a
    ``pp`` dimension and optional ``dp``/``ep``/``tp`` (None: FlexPipe builds
    ``dp x ep x pp x tp``). ``ep``: expert-parallel ranks; ``ep_plan``: experts module-name
    pattern -> ``stacked``/``list`` (``flexpipe.runtime.transport.experts``; default: the
    ``UserModel``'s, else the built-in plan of the model's Hugging Face MoE family).
    ``loss_fn(*outputs, target)``: the mean loss of a micro-batch (``loss_fn(output,
    target)`` for a model returning a dict or a ``ModelOutput``; None: the model's own loss,
    from the ``labels`` it takes as an input). ``loss_items(target)``: how many items that
    mean averages over (Hugging Face's token mean: ``(target != -100).sum()``), so that each
    micro-batch weighs its share of the batch's items and the gradient is one device's on the
    whole batch (None: every micro-batch weighs 1 / m). ``example``: one micro-batch's inputs (a
    tensor, a tuple, or a dict of keyword inputs). ``seed``: per-layer dropout seeds, so
    masks do not depend on the schedule. ``mixed_precision``: ``"bf16"`` (bfloat16 compute,
    float32 master weights, gradients and reduction) or a policy
    (``flexpipe.runtime.execution.precision``); None: the model's own dtype throughout.
    ``overlap_reduce``: average each stage's gradients over the replicas as soon as its last
    backward of the step is done, behind the compute still to come (False: all after the
    step). ``fsdp``: shard every stage over the ``dp`` replicas with FSDP2 (with ``ep`` > 1 over
    the dp x ep ranks, the experts left whole), gathered before its
    first pass of the step and reduce-scattered after its last (``flexpipe.ir.sharded``; a
    schedule with its own AG/RS, ZeroPP's, keeps them); a stage's repeated blocks are units of
    their own (``engines.blocks``). ``dp_replicate``: HSDP, the ``dp`` ranks as that many
    replica groups, each sharding over ``dp / dp_replicate`` ranks (FSDP2 on the 2-D mesh
    ``(dp_replicate, dp_shard)``: reduce-scatter within a group, all-reduce across them; 1:
    plain FSDP); it needs a sharded schedule (``fsdp`` or AG/RS). ``overlap_pairs``: an overlapped
    pair's two passes at once (``flexpipe.runtime.execution.overlap``; False: in turn).
    ``recompute``: what selective recompute drops and recomputes in a traced model
    (``flexpipe.runtime.user.recompute.Recompute``: modules by type or name pattern, every
    n-th; default: the ``UserModel``'s); the modules the model checkpoints itself are dropped
    too. Where there are such regions and the schedule recomputes nothing, an SR goes before
    each backward (``flexpipe.schedules.recompute``)."""
    mp = precision.policy(mixed_precision)
    rank, world, owns = join_group(timeout_s)
    before = groups.made_groups()
    if isinstance(model, UserModel):  # what the call leaves out, the UserModel gives
        loss_fn = loss_fn or model.loss_fn
        split_points = split_points or model.split_points
        tp_plan = model.tp_plan if tp_plan is None else tp_plan
        ep_plan = (model.ep_plan or None) if ep_plan is None else ep_plan
        recompute = model.recompute if recompute is None else recompute
        if example is None and model.example is not None:
            example = model.example[0]
        model = model.module
    sched = resolve_schedule(schedule)
    spread = (dp or 1) * (tp or 1) * (ep or 1)
    if mesh is None and sched.num_ranks * spread != world:
        hint = " (run the script under torchrun --nproc-per-node N, or inside " \
            "flexpipe.spawn(fn, N))" if world == 1 else ""
        raise ConfigError(f"the schedule has {sched.num_ranks} pipeline ranks; x dp {dp or 1} "
                          f"x ep {ep or 1} x tp {tp or 1} = {sched.num_ranks * spread} "
                          f"processes, but the world has {world}{hint}")
    if ep_plan is None:
        ep_plan = family_plan(model)
    parallel = Parallel(dp, tp, mesh, dict(tp_plan or {}), overlap_reduce, ep,
                        dict(ep_plan or {}), overlap_pairs, dp_replicate)
    grid = parallel.grid(sched.num_ranks, world, comm.device())
    parallel = replace(parallel, dp=grid.dp, tp=grid.tp, mesh=grid.mesh, ep=grid.ep)
    cut = cut_for(model, split_points, example, sched, recompute=as_recompute(recompute))
    loss_for(cut.interface, loss_fn)  # a clear error now when there is no loss at all
    if has_regions(layer for seg in cut.segments for layer in seg.layers):
        sched = with_recompute(sched, "SR")
    sizes = None if cut.traced else _partition(model, partition, sched, example)
    keep = sched.placement.rank_stages[grid.coords["pp"]]
    if is_two_way(sched):  # two copies of the model stages, one per direction
        refuse_two_way(sched, {"a model cut at split points or traced (a chain of layers runs: "
                               "a list or an nn.Sequential)": cut.traced, "fsdp=True": fsdp,
                               "loss_items": loss_items is not None,
                               "mixed precision": mp is not None, "tp > 1": grid.tp > 1})
        check(sched)
        check_supported(sched)
        mine = build_two_way_stages(cut.segments, sizes, sched, keep)
    else:
        sched = _fit(sched, model_graph(cut.segments, sizes, sched.num_stages))
        if fsdp:
            sched = shard_per_step(sched)
            check(sched)
        every = build_graph_stages(cut.segments, sizes, sched.num_stages, graph=sched.graph)
        mine = {s: every[s] for s in keep}
    check_replicate(sched, grid.dp, dp_replicate, "dp_replicate")
    agree_weights(model)
    return Pipeline(sched, mine, loss_fn, original_names(model),
                    rank=rank, world=world, seed=seed, timeout_s=timeout_s,
                    lookahead=lookahead, owns_group=owns, interface=cut.interface,
                    buffers=state.buffer_names(model), parallel=parallel,
                    loss_items=loss_items, mixed_precision=mp, groups_before=before)


def _partition(model: nn.Module | Sequence[nn.Module], how: str | Sequence[int],
               sched: Schedule, example: Any) -> tuple[int, ...]:
    """Layers per stage of a chain model (per model stage for DualPipe)."""
    layers = layer_list(model) or []
    inputs = None if example is None else as_inputs(example, "example inputs")
    return tuple(split_layers(layers, how, model_placement(sched.placement).stage_rank, inputs))


def _fit(sched: Schedule, graph: StageGraph) -> Schedule:
    """The schedule on the model's stage graph (a chain schedule takes a model's forward skip
    edges); refused, naming the stage, when the graphs differ otherwise."""
    fitted = fit_graph(sched, graph)
    check_graph(graph, fitted.graph)
    check(fitted)
    check_supported(fitted)
    return fitted
