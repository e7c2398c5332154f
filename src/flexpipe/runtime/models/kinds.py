"""The models FlexPipe trains, by ``ModelSpec.name``, in one table (``MODELS``): for each, how it
is built (its layers, for a chain of built-in layers, or its segments), where its micro-batches
come from, its tensor-parallel plan, the parallel layouts it refuses, and whether it is your own
(``user``: its factory is called once per rank, and a ``Job`` cuts it for its schedule).
``kind(spec)`` is the one look-up (an unknown name is refused, naming the known ones); the
functions below are what every path that trains, profiles or checks a model calls."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.runtime.execution.segments import Segment, check_graph, plan_stages
from flexpipe.runtime.execution.stage import Batch, LossFn
from flexpipe.runtime.models import gpt, moe, zoo
from flexpipe.runtime.models.graph import clip_model
from flexpipe.runtime.models.spec import ModelSpec, spec_model, spec_segments
from flexpipe.runtime.models.vocab import check_vocab_job, gpt_vocab
from flexpipe.runtime.transport.experts import planned_experts
from flexpipe.runtime.user.experts import family_plan
from flexpipe.runtime.user.model import UserModel

Sampler = Callable[[ModelSpec, int], zoo.Sample]


@dataclass(frozen=True)
class ModelKind:
    """What FlexPipe does with one kind of model."""

    sample: Sampler
    """Micro-batch ``index`` of the model's data."""
    layers: Callable[[ModelSpec], tuple[list[nn.Module], LossFn]] | None = None
    """A built-in chain of layers: its layers (not yet seeded or cast) and loss."""
    segments: Callable[[ModelSpec], tuple[list[Segment], LossFn]] | None = None
    """Any other model: its segments (seeded, in ``spec.dtype``) and loss."""
    plan: Callable[[ModelSpec, int], dict[str, str]] | None = None
    """Its tensor-parallel plan for ``tp`` ranks (None: tp > 1 is refused)."""
    limits: Callable[[ModelSpec, int, int, int], None] | None = None
    """Raise ``ConfigError`` for a layout (pp, dp, tp) it cannot run on (None: any)."""
    own: bool = False
    """Your own model (``ModelSpec.user`` or ``factory``)."""
    experts: Callable[[ModelSpec], tuple[dict[str, str], dict[str, int]]] | None = None
    """Its expert-parallel plan and the experts of each module it matches (None: no
    experts, ep > 1 is refused)."""


MODELS: Mapping[str, ModelKind] = MappingProxyType({
    "gpt": ModelKind(zoo.text_sample, layers=zoo.gpt_chain,
                     plan=lambda spec, tp: gpt.tp_plan(spec.gpt(), tp)),
    "mlp": ModelKind(zoo.mlp_sample, layers=zoo.mlp_chain),
    "moe": ModelKind(zoo.text_sample, layers=zoo.moe_chain, experts=lambda spec: (
        dict(moe.PLAN), {f"{1 + b}.moe": spec.experts for b in range(spec.layers)})),
    "clip": ModelKind(zoo.pair_sample, segments=clip_model),
    "gpt-vocab": ModelKind(zoo.text_sample, segments=gpt_vocab, limits=check_vocab_job),
    "user": ModelKind(zoo.user_sample, segments=spec_segments,
                      plan=lambda spec, tp: dict(spec_model(spec).tp_plan), own=True,
                      experts=lambda spec: user_experts(spec_model(spec))),
})
"""Every model by name: ``gpt`` (the small GPT), ``mlp`` (the two-stream MLP), ``moe`` (a
mixture of experts, ``models.moe``), ``clip`` (two towers, ``models.graph``), ``gpt-vocab``
(the vocabulary-sharded GPT, ``models.vocab``) and ``user`` (your own model, a chain or cut at
split points, ``flexpipe.runtime.user.model``)."""


def kind(spec: ModelSpec) -> ModelKind:
    """The table's entry of ``spec``'s model."""
    found = MODELS.get(spec.name)
    if found is None:
        raise ConfigError(f"unknown model {spec.name!r} ({', '.join(MODELS)})")
    return found


def build_model(spec: ModelSpec) -> tuple[list[nn.Module], LossFn]:
    """A built-in chain model's layers (seeded, in ``spec.dtype``) and its loss."""
    make = kind(spec).layers
    if make is None:
        chains = [name for name, k in MODELS.items() if k.layers is not None]
        raise ConfigError(f"{spec.name!r} is not a built-in chain of layers "
                          f"({', '.join(chains)})")
    torch.manual_seed(spec.seed)
    layers, loss = make(spec)
    return [layer.to(spec.torch_dtype) for layer in layers], loss


def model_segments(spec: ModelSpec) -> tuple[list[Segment], LossFn]:
    """The model of ``spec`` as segments (seeded, in ``spec.dtype``) and its loss: a chain
    model is the one-segment case, so training has one code path."""
    make = kind(spec).segments
    if make is not None:
        return make(spec)
    layers, loss = build_model(spec)
    return [Segment("", tuple(layers))], loss


def make_batch(spec: ModelSpec, step: int, microbatches: int, replica: int = 0,
               replicas: int = 1) -> Batch:
    """Micro-batches of ``step`` for data-parallel ``replica`` (of ``replicas``): the
    replicas' batches together are the single-device batch of that step."""
    return batch_at(spec, (step * replicas + replica) * microbatches, microbatches)


def batch_at(spec: ModelSpec, first: int, microbatches: int) -> Batch:
    """The ``microbatches`` micro-batches of the synthetic data from global micro-batch
    ``first`` on (``make_batch``; a resumed run reads on from its data position)."""
    sample = kind(spec).sample
    return [sample(spec, first + j) for j in range(microbatches)]


def tp_plan(spec: ModelSpec, tp: int) -> dict[str, str]:
    """The model's tensor-parallel plan for ``tp`` ranks (module-name pattern -> ``colwise`` /
    ``rowwise``): the built-in GPT's Megatron split, your ``UserModel.tp_plan``; none for the
    other built-in models (tp > 1 is then refused)."""
    if tp == 1:
        return {}
    make = kind(spec).plan
    plan = make(spec, tp) if make is not None else {}
    if not plan:
        raise ConfigError(f"tp = {tp}: the model {spec.name!r} has no tensor-parallel plan "
                          "(the built-in gpt has one; give your UserModel a tp_plan)")
    return plan


def user_experts(user: UserModel) -> tuple[dict[str, str], dict[str, int]]:
    """Your model's expert-parallel plan (its ``ep_plan``, else its Hugging Face MoE family's
    built-in one) and the experts of each module the plan matches."""
    module = user.module
    plan = dict(user.ep_plan) or family_plan(module)
    root = module if isinstance(module, nn.Module) else nn.ModuleList(module)
    return plan, planned_experts(root, plan)


def ep_plan(spec: ModelSpec, ep: int) -> dict[str, str]:
    """The model's expert-parallel plan for ``ep`` ranks (none when ep = 1), once each planned
    module's experts divide evenly over them: a ``ConfigError`` names the model without
    experts, or the module whose experts ``ep`` does not divide."""
    if ep == 1:
        return {}
    make = kind(spec).experts
    plan, counts = make(spec) if make is not None else ({}, {})
    if not plan or not counts:
        raise ConfigError(f"ep = {ep}: the model {spec.name!r} has no experts to share out "
                          "(the built-in moe has; give your UserModel an ep_plan, or use a "
                          "Hugging Face MoE family: Mixtral, Qwen2-MoE, DeepSeek-V3)")
    bad = {name: n for name, n in counts.items() if n % ep}
    if bad:
        name, n = next(iter(bad.items()))
        raise ConfigError(f"ep = {ep} does not divide the {n} experts of {name!r} (each ep "
                          f"rank holds experts / ep of every MoE layer; {len(bad)} of "
                          f"{len(counts)} MoE layers are uneven)")
    return plan


def check_parallel(spec: ModelSpec, pp: int, dp: int, tp: int) -> None:
    """``ConfigError`` when the model cannot run on ``pp`` pipeline ranks x ``dp`` replicas x
    ``tp``: tp > 1 without a tensor-parallel plan (``tp_plan``), or outside its limits (only
    ``gpt-vocab`` has them: a plain pipeline, one shard per rank)."""
    tp_plan(spec, tp)
    limits = kind(spec).limits
    if limits is not None:
        limits(spec, pp, dp, tp)


def check_model_graph(spec: ModelSpec, partition: tuple[int, ...] | None,
                      graph: StageGraph) -> None:
    """Raise ``ConfigError`` unless ``graph`` (a schedule's) is the stage graph of the model
    cut by ``partition``; a built-in chain model is checked without building its layers."""
    make = kind(spec).layers
    if make is None:
        segments, _ = model_segments(spec)
        model = plan_stages(segments, partition, graph.num_stages).graph
    else:
        if partition is not None:  # its layers counted on the meta device (no memory)
            with torch.device("meta"):
                layers, _ = make(spec)
            plan_stages([Segment("", tuple(layers))], partition, graph.num_stages)
        model = StageGraph.chain(graph.num_stages)
    check_graph(model, graph)
