"""Splitting any ``nn.Module`` into pipeline stages at named split points, by tracing it.

The model is traced with ``torch.fx`` (symbolic tracing: ``torch.nn`` layers stay whole, so the
user's own ``nn.Linear``/``nn.MultiheadAttention`` objects run in the stages, the weight-gradient
store splits their backward into B and W, and every parameter keeps its identity and name),
then cut with ``torch.fx.passes.split_module``: a split point ``"layers.2"`` starts a new stage
at the first operation inside module ``layers.2``. ``torch.export`` lowers the model to aten
operations and lifts the parameters out of their modules (the B/W split then computes every
weight gradient in B), so it is the fallback for a model ``torch.fx`` cannot trace (Python
control flow on tensors, as in Hugging Face models): torch.distributed.pipelining's tracer
exports it on an example micro-batch and splits it the same way.

What a stage needs from earlier stages becomes stage-graph edges: a skip connection from stage
0 to stage 2 is an edge ``0>2`` carrying the tensor, so the schedule's chain order still holds
and nothing is threaded through stage 1. Batch inputs used after the first stage travel from
stage 0 (only the first stage reads the batch). Each stage is a ``Segment`` of one
``TracedStage`` layer; a consumer takes, in ascending stage order, the outputs of each producer
that it reads (``Segment.takes``: an edge carries nothing else), and a value that depends on
no trainable parameter (a mask, rotary tables: the batch and buffers alone) returns no gradient
(``Segment.grads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.user import modes, wiring
from flexpipe.runtime.user.checkpoints import checkpointed
from flexpipe.runtime.user.interface import (
    Example,
    Interface,
    as_example,
    interface_of,
)
from flexpipe.runtime.user.randomness import key_random_ops
from flexpipe.runtime.user.recompute import Recompute, module_paths, outline, selected
from flexpipe.runtime.user.regions import (
    close_regions,
    functions_refused,
    hidden_in_regions,
    kept,
)

OWN = "flexpipe_checkpointed"
"""A traced graph's meta key: the modules the model checkpoints itself (``checkpoints``)."""


@dataclass(frozen=True)
class Traced:
    """A traced model cut into stages: one ``Segment`` per stage (in stage order), and how the
    model is called and what it returns (``Interface``)."""

    segments: tuple[Segment, ...]
    points: tuple[str, ...]
    interface: Interface = field(default_factory=Interface)


def trace(module: nn.Module) -> fx.GraphModule:
    """``module`` traced by ``torch.fx`` (a ``ConfigError`` naming why it cannot be)."""
    tracer = fx.Tracer()
    try:
        with checkpointed(module) as own, kept(tracer):
            graph = tracer.trace(module)
        gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
        gm.meta[OWN] = tuple(own)
        return gm
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot trace {type(module).__name__} with torch.fx ({type(exc).__name__}: "
            f"{first}); give the model as an nn.Sequential or a list of layers, or keep "
            "data-dependent control flow inside torch.nn layers") from None


def candidates(gm: fx.GraphModule) -> list[str]:
    """Every module path the traced forward enters, in the order it first enters it."""
    seen: dict[str, None] = {}
    for node in gm.graph.nodes:
        for path in module_paths(node):
            seen.setdefault(path)
    return list(seen)


def _assign(gm: fx.GraphModule, points: Sequence[str]) -> dict[fx.Node, int]:
    """The stage of every node: a split point starts its stage at the first node inside it."""
    known = candidates(gm)
    missing = [p for p in points if p not in known]
    if missing:
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        raise ConfigError(f"split point {missing[0]!r} is not a module the model's forward "
                          f"calls (split points name modules: {shown}){hidden_in_regions(gm)}")
    if len(set(points)) != len(points):
        raise ConfigError(f"split points {list(points)} name a module twice")
    stage_of: dict[fx.Node, int] = {}
    stage, pending = 0, list(points)
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_function", "call_method", "get_attr"):
            while pending and pending[0] in module_paths(node):
                pending.pop(0)
                stage += 1
        if any(p in module_paths(node) for p in pending):
            raise ConfigError(f"split points {list(points)} are not in the order the forward "
                              f"runs them ({pending[0]!r} runs before an earlier point)")
        stage_of[node] = stage
    return stage_of


def split_points(module: nn.Module, points: Sequence[str], example: object = None,
                 recompute: Recompute | None = None) -> Traced:
    """Cut ``module`` at ``points`` (module names, in forward order) into len(points) + 1
    stages, each a one-layer ``Segment``. A model ``torch.fx`` cannot trace is exported
    instead (``torch.export``) when ``example`` (one micro-batch's inputs: a tensor, a tuple
    of tensors, a dict of keyword inputs, or ``as_example``'s (positional, keyword)) is
    given. A model whose eval-mode graph differs keeps it per stage (``modes``). The modules
    ``recompute`` selects, and those the model checkpoints itself, become regions that SR
    drops and recomputes (``recompute.outline``; None: only the model's own)."""
    train, evaluated, where = modes.graphs(module, lambda: _graph(module, example))
    rc = recompute or Recompute()
    drop, keep = selected(module, rc, train.meta.get(OWN, ()))
    cut = _cut(train, points)
    if evaluated is None:
        return _outlined(cut, drop, keep, rc)
    try:
        other = _cut(evaluated, points)
    except ConfigError as exc:
        raise ConfigError(f"{type(module).__name__} reads self.training in module {where!r}; "
                          f"its eval-mode graph cannot be cut so: {exc}") from None
    modes.merge(cut.segments, other.segments, cut.interface == other.interface, module, where)
    return _outlined(cut, drop, keep, rc)


def _outlined(cut: Traced, drop: set[str], keep: set[str], rc: Recompute) -> Traced:
    """``cut`` with the regions of each stage's training piece outlined for SR (the modules
    ``drop`` names, but those ``keep`` names, keeping what ``rc``'s per-operation policy
    saves: ``recompute.outline``)."""
    for seg in cut.segments if drop else ():
        piece = seg.layers[0].piece
        if isinstance(piece, fx.GraphModule):
            outline(piece, drop, keep, rc.op_policy())
    return cut


def _graph(module: nn.Module, example: object) -> fx.GraphModule:
    """``graph_of`` with its random operations keyed."""
    gm = graph_of(module, example)
    key_random_ops(gm)  # the graph module's own copy of the module tree: yours is unchanged
    return gm


def _cut(gm: fx.GraphModule, points: Sequence[str]) -> Traced:
    """``gm`` cut at ``points`` (``split_points``)."""
    stage_of = _assign(gm, points)
    close_regions(gm.graph, stage_of)
    split = split_module(gm, gm, lambda n: stage_of[n], keep_original_order=True)
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    if len(calls) != len(points) + 1:
        raise ConfigError(f"split points {list(points)} leave a stage with no operations "
                          f"({len(calls)} stages instead of {len(points) + 1})")
    segments = wiring.segments(split, calls, gm)
    return Traced(tuple(segments), tuple(points), interface_of(gm, split))


def graph_of(module: nn.Module, example: object = None) -> fx.GraphModule:
    """``module`` as one graph: traced by ``torch.fx``, or, where it cannot be and ``example``
    (one micro-batch's inputs) is given, exported by ``torch.export`` on it."""
    try:
        return trace(module)
    except ConfigError as exc:
        if example is None:
            raise ConfigError(f"{exc}; or give example inputs (one micro-batch) to export it "
                              "with torch.export instead") from None
        return exported(module, as_example(example))


def exported(module: nn.Module, example: Example) -> fx.GraphModule:
    """``module`` exported with ``torch.export`` on ``example`` (one micro-batch's positional
    and keyword inputs) as one flat graph of aten operations that reads the model's own
    parameters and buffers (the same objects, tied weights included) by their names; every
    node keeps the path of the module it runs in. Shapes are those of the example: every
    micro-batch must have its size. A Hugging Face model's key/value cache is off while it is
    exported (training never reads it)."""
    args, kwargs = example
    configs: list[Any] = [c for c in {id(c): c for c in (getattr(m, "config", None)
                                                         for m in module.modules())}.values()
                          if getattr(c, "use_cache", False) is True]  # T5's decoder has its own
    try:
        for config in configs:
            config.use_cache = False
        with checkpointed(module) as own, functions_refused(module), _no_stack_traces():
            program = torch.export.export(module, tuple(args), dict(kwargs), strict=False)
        gm = program.module()
        gm.meta[OWN] = tuple(own)
        return gm  # type: ignore[return-value]
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any export failure becomes one clear error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot trace {type(module).__name__} with torch.fx nor export it "
                          f"with torch.export ({type(exc).__name__}: {first}); run it "
                          "eagerly instead: flexpipe.runtime.user.eager.eager_stages(model, "
                          "split_points, example) (a Hugging Face causal LM: "
                          "hf_eager.hf_causal_stages; an encoder-decoder: "
                          "hf_seq2seq.hf_seq2seq_stages) gives its stages as a chain of layers "
                          "for flexpipe.pipeline, untraced") from None
    finally:
        for config in configs:
            config.use_cache = True


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Within: torch.fx records no Python stack per node (``torch.fx.config``), about a tenth
    of an export's time; nothing here reads a node's ``stack_trace``."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", False)
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before
