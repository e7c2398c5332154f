"""The one description of a model to train: ``ModelSpec`` names a built-in model (``gpt``,
``mlp``, ``clip``) with its size, dtype, seed and micro-batch size, or your own (``user``: a
``flexpipe.UserModel`` object or a factory ``package.module:function``). Every path that trains
or measures a model (the CLI's training loop, the profiler, the memory check, checkpoints)
takes a ``ModelSpec``; the helpers here turn a ``user`` spec into its ``UserModel``, its
segments and its stage graph."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.execution.stage import LossFn
from flexpipe.runtime.models.gpt import GPTConfig
from flexpipe.runtime.user.model import (
    UserModel,
    cut_for,
    fit_graph,
    layer_list,
    load_factory,
    model_graph,
    model_segments,
)


@dataclass(frozen=True)
class ModelSpec:
    """Which built-in model, its size, dtype, seed and micro-batch size."""

    name: str = "gpt"
    """``gpt``, ``mlp``, ``clip``, ``gpt-vocab``, ``moe`` or ``user`` (your own: ``factory``
    or ``user``)."""
    layers: int = 4
    """Transformer blocks (gpt), hidden layers (mlp), MoE layers (moe) or blocks per tower
    (clip); the layer list (of each tower) adds 2 more."""
    hidden: int = 64
    """Hidden size."""
    heads: int = 4
    """Attention heads (gpt)."""
    vocab: int = 256
    """Vocabulary (gpt) or number of classes (mlp)."""
    seq: int = 32
    """Sequence length (gpt)."""
    micro_batch: int = 4
    """Samples per micro-batch."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32 or float64."""
    seed: int = 0
    """Seed of the initial weights and of the data."""
    dropout: float = 0.0
    """Dropout probability (gpt; 0: none)."""
    experts: int = 8
    """Experts of each MoE layer (moe: top-2 routed, ``flexpipe.runtime.models.moe``)."""
    shards: int = 2
    """Vocabulary shards (``gpt-vocab``: its embedding and head each split into this many
    stages, one per pipeline rank)."""
    factory: str = ""
    """Your own model (name ``user``): ``package.module:function`` returning a
    ``flexpipe.UserModel`` or ``(model, (inputs, target), loss_fn)``, called on every rank
    after seeding torch with ``seed``."""
    user: UserModel | None = field(default=None, compare=False, repr=False)
    """Your own model (name ``user``) as a ``flexpipe.UserModel`` object (``Job(schedule,
    UserModel(...))``); takes precedence over ``factory``."""
    cut: tuple[str, ...] = ()
    """Where a ``user`` model that names no split points (and is not a chain of layers) is
    cut: ``Job`` fills it in with the automatic split points for its schedule's placement
    (``fit_job``)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a torch dtype."""
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r} (float32, float64, bfloat16)")
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def gpt(self) -> GPTConfig:
        """The GPT shape."""
        return GPTConfig(self.vocab, self.hidden, self.heads, self.layers, self.seq,
                         self.dropout)


def spec_model(spec: ModelSpec) -> UserModel:
    """The ``UserModel`` of a ``ModelSpec`` named ``user``: its object, or its factory's."""
    if spec.user is not None:
        return spec.user
    if not spec.factory:
        raise ConfigError("model 'user' needs a factory (package.module:function) or a "
                          "UserModel")
    return load_factory(spec.factory, spec.seed)


def seeded_segments(spec: ModelSpec,
                    make: Callable[[ModelSpec], list[Segment]]) -> list[Segment]:
    """A built-in graph model's segments: ``make(spec)`` after seeding torch with
    ``spec.seed``, every layer cast to ``spec.dtype``."""
    torch.manual_seed(spec.seed)
    segments = make(spec)
    for seg in segments:
        for layer in seg.layers:
            layer.to(spec.torch_dtype)
    return segments


def spec_segments(spec: ModelSpec) -> tuple[list[Segment], LossFn]:
    """A ``user`` ``ModelSpec`` as segments (a copy of the object, or the factory's fresh
    model; the regions its ``recompute`` selects outlined for SR) and its loss."""
    user = spec_model(spec)
    module = _copied(user.module) if spec.user is not None else user.module
    example = None if user.example is None else user.example[0]
    return model_segments(module, user.split_points or spec.cut, example,
                          recompute=user.recompute), user.loss_fn


def _copied(module: nn.Module | Sequence[nn.Module]) -> nn.Module | Sequence[nn.Module]:
    """A copy of your model object (the job cuts and trains the copy), or an error naming the
    way round one that torch cannot copy."""
    try:
        return copy.deepcopy(module)
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot copy the model ({exc.args[0].splitlines()[0] if exc.args else exc}): the "
            "older nn.utils.weight_norm / spectral_norm keep a computed tensor as an "
            "attribute, which torch cannot copy; use torch.nn.utils.parametrizations."
            "weight_norm / spectral_norm, or give the model as a factory every rank calls "
            "(ModelSpec('user', factory='package.module:function'))") from exc


def as_spec(model: object) -> ModelSpec:
    """``Job``'s model as a ``ModelSpec`` (itself, when it is one): a ``UserModel`` becomes a
    ``user`` ``ModelSpec``; a bare module or list of layers is refused (it has no loss and no
    data)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, UserModel):
        return ModelSpec("user", micro_batch=model.micro_batch, user=model)
    if isinstance(model, nn.Module | list | tuple):
        raise ConfigError(f"Job(schedule, model) got a bare {type(model).__name__}: a Job "
                          "trains on its own data and needs a loss; give "
                          "flexpipe.UserModel(model, loss_fn, example=(inputs, target)), or "
                          "call flexpipe.pipeline(model, schedule, loss_fn=...) in your own "
                          "training loop")
    raise ConfigError(f"Job's model must be a ModelSpec or a flexpipe.UserModel, got "
                      f"{type(model).__name__}")


def fit_job(schedule: Schedule, spec: ModelSpec, partition: Sequence[int] | None
            ) -> tuple[ModelSpec, Schedule]:
    """A ``Job``'s own model and its schedule on the model's stage graph (``fit_graph``), cut
    where ``flexpipe.pipeline`` cuts it (``cut_for``): a model that is not a chain of layers
    and names no split points takes the automatic ones for the schedule's placement
    (``ModelSpec.cut``, so that every rank cuts it there)."""
    user = spec_model(spec)
    points = user.split_points or spec.cut
    if partition is not None and not points and isinstance(user.module, nn.Module) \
            and layer_list(user.module) is None and schedule.num_stages > 1:
        raise ConfigError("a partition (layers per stage, --partition) cuts a chain of layers; "
                          f"the model ({type(user.module).__name__}) is not one, so it is cut "
                          "at split points, automatically when it names none: drop the "
                          "partition, or give split_points (the modules that start stages 1, "
                          "2, ...; e.g. split_points=('layers.2',))")
    example = None if user.example is None else user.example[0]
    cut = cut_for(user.module, points, example, schedule, counted=partition is None,
                  recompute=user.recompute)
    if not cut.traced:
        return spec, schedule  # a chain of layers, cut by the partition when it is built
    if not points:
        spec = replace(spec, cut=cut.points)
    return spec, fit_graph(schedule, model_graph(cut.segments, partition, schedule.num_stages))
