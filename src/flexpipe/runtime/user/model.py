"""Your own model, for every path that trains a model: ``UserModel`` (the module, its loss, an
example micro-batch, optional split points and data), a factory named ``package.module:function``
(``flexpipe run --model pkg.mod:factory``), and the cut into stages.

A model is cut one of two ways. An ``nn.Sequential``, an ``nn.ModuleList`` or a list of layers
is a chain of layers (each takes the previous one's tensors) split by a partition (layers per
stage: even, balanced by counted FLOPs or by parameters: ``flexpipe.runtime.measurement.balance``
over ``flexpipe.cost.partition``). Any other ``nn.Module`` is traced and cut at split points
(``flexpipe.runtime.user.tracing``); its skip connections over stage boundaries become stage-graph
edges.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.segments import Segment, plan_stages
from flexpipe.runtime.execution.stage import LossFn, Tensors
from flexpipe.runtime.user.autocut import auto_points
from flexpipe.runtime.user.interface import Interface, as_example, as_inputs
from flexpipe.runtime.user.recompute import Recompute
from flexpipe.runtime.user.regions import refuse_split
from flexpipe.runtime.user.tracing import split_points as traced_split

Sample = tuple[Tensors, torch.Tensor]


@dataclass(frozen=True, eq=False)
class UserModel:
    """A model of your own, with what training it needs."""

    module: nn.Module | Sequence[nn.Module]
    """An ``nn.Sequential``, ``nn.ModuleList`` or list of layers (a chain), or any
    ``nn.Module`` (traced and cut at ``split_points``)."""
    loss_fn: LossFn
    """``loss_fn(*outputs, target)``: a scalar, the mean over the micro-batch's samples."""
    example: tuple[Any, torch.Tensor] | None = None
    """One micro-batch ``(inputs, target)``: inputs a tensor or a tuple of tensors. Gives the
    micro-batch size, the FLOPs of each layer and, without ``data``, the shapes of the
    synthetic data."""
    split_points: tuple[str, ...] = ()
    """Modules that start a new stage (``("layers.2", "layers.4")``), for a traced model."""
    data: Callable[[int], tuple[Any, torch.Tensor]] | None = None
    """Micro-batch ``index`` -> ``(inputs, target)`` for ``flexpipe run`` (None: random tensors
    shaped like ``example``, integers below its largest value)."""
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    """Tensor parallelism (``tp > 1``): module-name pattern (``fnmatch``, your model's names,
    e.g. ``"layers.*.attn.q_proj"``) -> ``"colwise"`` or ``"rowwise"`` (torch's
    ``ColwiseParallel``/``RowwiseParallel``). Your modules must then work on the features of
    their rank (e.g. count heads from the features, as ``view(b, s, -1, head_dim)`` does)."""
    ep_plan: Mapping[str, str] = field(default_factory=dict)
    """Expert parallelism (``ep > 1``): experts module-name pattern (``fnmatch``, e.g.
    ``"*.moe.experts"``) -> ``"stacked"`` (its own parameters hold the experts along their
    first dimension) or ``"list"`` (an ``nn.ModuleList`` of experts). The module's forward takes
    ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` and returns the weighted sum
    of each token's experts (Hugging Face's experts modules do;
    ``flexpipe.runtime.transport.experts``). None given: the Hugging Face family's plan."""
    recompute: Recompute | None = None
    """What selective recompute (SR) drops and recomputes in a traced model: modules by type
    or name pattern, every n-th one (``flexpipe.runtime.user.recompute``); the modules the
    model checkpoints itself are dropped in any case."""

    def sample(self, index: int, seed: int) -> Sample:
        """Micro-batch ``index`` of the training data."""
        if self.data is not None:
            inputs, target = self.data(index)
            return as_inputs(inputs, "data(index) inputs"), target
        if self.example is None:
            raise ConfigError("a UserModel trained by flexpipe run/Job needs example=(inputs, "
                              "target) or data=function(index) -> (inputs, target)")
        gen = torch.Generator().manual_seed(seed * 7919 + index)
        inputs, target = self.example
        return (tuple(_like(t, gen) for t in as_inputs(inputs, "example inputs")),
                _like(target, gen))

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch (the example's first dimension; 1 without an example)."""
        if self.example is None:
            return 1
        first = as_inputs(self.example[0], "example inputs")
        return int(first[0].shape[0]) if first and first[0].dim() else 1


def _like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor with ``t``'s shape and dtype (integers in 0..max(t))."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    high = int(t.max()) + 1 if t.numel() else 1
    return torch.randint(0, max(high, 1), t.shape, generator=gen, dtype=t.dtype)


def as_user_model(obj: object, where: str = "the model") -> UserModel:
    """A factory's answer as a ``UserModel``: one, or ``(model, (inputs, target), loss_fn)``."""
    if isinstance(obj, UserModel):
        return obj
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[2]):
        module, example, loss = obj
        if not (isinstance(example, tuple | list) and len(example) == 2):
            raise ConfigError(f"{where}: the example must be (inputs, target)")
        return UserModel(module, loss, (example[0], example[1]))
    raise ConfigError(f"{where} must return a flexpipe.UserModel or (model, (inputs, target), "
                      f"loss_fn), got {type(obj).__name__}")


def load_factory(path: str, seed: int = 0) -> UserModel:
    """Call ``package.module:function`` (after seeding torch with ``seed``, so every rank
    builds the same weights) and return its ``UserModel``."""
    mod_name, _, fn_name = path.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"--model {path!r}: expected package.module:function")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"--model {path!r}: cannot import {mod_name!r} ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"--model {path!r}: {mod_name} has no function {fn_name!r}")
    torch.manual_seed(seed)
    try:
        made = fn()
    except Exception as exc:  # noqa: BLE001 - the user's code: named, its error kept as cause
        raise ConfigError(f"--model {path!r}: {fn_name}() raised {type(exc).__name__}: "
                          f"{exc}") from exc
    return as_user_model(made, f"--model {path}")


def layer_list(module: object) -> list[nn.Module] | None:
    """The layers of a chain model (Sequential, ModuleList, list/tuple of modules), else
    None."""
    if isinstance(module, nn.Sequential | nn.ModuleList):
        return list(module)
    if isinstance(module, list | tuple):
        bad = [i for i, m in enumerate(module) if not isinstance(m, nn.Module)]
        if bad or not module:
            raise ConfigError(f"a list of layers must hold nn.Modules (item {bad[0] if bad else 0}"
                              " is not)" if bad else "the list of layers is empty")
        return list(module)
    return None


def model_segments(module: nn.Module | Sequence[nn.Module], points: Sequence[str] = (),
                   example: object = None, recompute: Recompute | None = None) -> list[Segment]:
    """The model as segments: one chain segment of its layers, or one segment per traced
    stage when split points are given (``example``: the inputs of one micro-batch, to export
    a model torch.fx cannot trace)."""
    return cut_model(module, points, example, recompute=recompute)[0]


def cut_model(module: nn.Module | Sequence[nn.Module], points: Sequence[str] = (),
              example: object = None, stages: int | None = None,
              recompute: Recompute | None = None) -> tuple[list[Segment], Interface]:
    """``model_segments`` and the model's ``Interface`` (a chain's is empty: inputs by
    position, outputs as they are). A model that is not a chain needs split points to make
    several stages; without them it is traced whole, one stage (``stages``: how many the
    schedule has, when known). ``recompute``: the regions SR drops, in a traced model."""
    layers = layer_list(module)
    if points or (layers is None and isinstance(module, nn.Module) and stages in (None, 1)):
        if not isinstance(module, nn.Module):
            module = nn.Sequential(*(layers or []))
        inputs = None if example is None else as_example(example)
        traced = traced_split(module, points, inputs, recompute)
        return list(traced.segments), traced.interface
    if recompute is not None and (recompute.drop or recompute.keep):
        raise ConfigError("recompute=Recompute(drop=...) selects modules of a traced model; "
                          "a chain of layers is not traced: give split points, or recompute "
                          "whole stages with a schedule's R ('1f1b-recompute')")
    if layers is None:
        raise ConfigError(f"{type(module).__name__} is not a chain of layers: give split points "
                          "(the modules that start stages 1, 2, ...; e.g. "
                          "split_points=('layers.2',)), or pass an nn.Sequential")
    return [Segment("", tuple(layers))], Interface()  # a chain of layers, cut by a partition


@dataclass(frozen=True)
class Cut:
    """A model cut for a schedule (``cut_for``)."""

    points: tuple[str, ...]
    """The split points it was cut at (its own or the automatic ones; none: a chain)."""
    segments: list[Segment]
    interface: Interface
    traced: bool
    """Cut at split points, one stage per segment (else a chain of layers, cut by a
    partition)."""


def cut_for(module: nn.Module | Sequence[nn.Module], points: Sequence[str], example: object,
            schedule: Schedule, counted: bool = True, recompute: Recompute | None = None
            ) -> Cut:
    """The one cut of a model for ``schedule`` (``flexpipe.pipeline`` and ``Job`` both cut
    here): at its split points; an ``nn.Module`` that is not a chain of layers and names none
    is cut, under a schedule of several stages, at the points balancing the ranks
    (``auto_points``: counted FLOPs on ``example``, else parameters); a chain of layers is one
    segment, cut by a partition. With ``counted``, a model cut at split points must make as
    many stages as the schedule has. A model computing under autocast is refused under a
    schedule with a W pass (``regions.refuse_split``). ``recompute``: the regions SR drops
    (``cut_model``)."""
    chain = layer_list(module) is not None
    if not points and schedule.num_stages > 1 and isinstance(module, nn.Module) and not chain:
        points = auto_points(module, schedule.placement.stage_rank, example)
    segments, interface = cut_model(module, tuple(points), example, schedule.num_stages,
                                    recompute)
    refuse_split((layer for seg in segments for layer in seg.layers), schedule.kinds())
    traced = bool(points) or not chain
    if counted and traced and len(segments) != schedule.num_stages:
        raise ConfigError(f"{len(segments) - 1} split points make {len(segments)} stages; the "
                          f"schedule has {schedule.num_stages}")
    return Cut(tuple(points), segments, interface, traced)


def original_names(module: nn.Module | Sequence[nn.Module]) -> dict[int, str]:
    """id(parameter) -> its name in the user's model (of the model cut, for eager stages)."""
    root = module if isinstance(module, nn.Module) else nn.ModuleList(module)
    root = getattr(root, "source", None) or root
    return {id(p): n for n, p in root.named_parameters()}


def fit_graph(schedule: Schedule, graph: StageGraph) -> Schedule:
    """``schedule`` with the model's stage graph when the schedule is a chain and every model
    edge goes forward (a chain order then keeps every dependency), else unchanged."""
    if schedule.graph == graph or not schedule.graph.is_chain or \
            graph.num_stages != schedule.num_stages or any(a >= b for a, b in graph.edges):
        return schedule
    from flexpipe.sim.validate import check

    fitted = replace(schedule, graph=graph)
    check(fitted)
    return fitted


def model_graph(segments: Sequence[Segment], partition: Sequence[int] | None,
                num_stages: int) -> StageGraph:
    """The stage graph of ``segments`` cut into ``num_stages`` stages."""
    return plan_stages(segments, partition, num_stages).graph
