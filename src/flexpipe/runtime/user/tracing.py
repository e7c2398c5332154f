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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.execution.wgrad_aten import mark_computed
from flexpipe.runtime.user import modes
from flexpipe.runtime.user.checkpoints import checkpointed
from flexpipe.runtime.user.devices import compute_device, retarget
from flexpipe.runtime.user.interface import (
    Example,
    Interface,
    as_example,
    interface_of,
    output_leaves,
)
from flexpipe.runtime.user.randomness import key_random_ops, training
from flexpipe.runtime.user.recompute import Recompute, module_paths, outline, selected
from flexpipe.runtime.user.regions import (
    close_regions,
    functions_refused,
    hidden_in_regions,
    kept,
)

OWN = "flexpipe_checkpointed"
"""A traced graph's meta key: the modules the model checkpoints itself (``checkpoints``)."""
Ref = tuple[str, int, int]  # ("in", 0, input), ("out", stage, output) or ("attr", -1, attr)


class TracedStage(nn.Module):
    """One traced stage: takes its producers' outputs (or, on stage 0, the batch inputs) as one
    flat tuple, calls its piece of the graph on the ones it uses and returns the values later
    stages (or the loss) need."""

    def __init__(self, piece: nn.Module, args: tuple[int, ...], outs: tuple[int, ...],
                 multi: bool, name: str, consts: Sequence[torch.Tensor] = (),
                 const_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.piece = piece
        self.args, self.outs, self.multi, self.name = args, outs, multi, name
        self.consts = nn.Module()
        """Parameters and buffers the model reads outside a submodule (``self.pos``; all of
        them in an exported graph), which the piece takes as arguments: ``args`` index -1 is
        ``c0``, -2 ``c1``, ... Those of one repeated block of the model (``const_names``, the
        model's names: ``model.layers.3.mlp.up_proj.weight``) sit together in a module
        ``consts.<k>`` of their own (the k-th block), so that FSDP2 can shard each block as a
        unit (``engines.blocks``)."""
        self.holders: list[nn.Module] = []
        """Per constant ``c{j}``, the module holding it."""
        groups: dict[str, nn.Module] = {}
        for j, t in enumerate(consts):
            key = block_key(const_names[j]) if j < len(const_names) else None
            if key is not None and key not in groups:
                groups[key] = nn.Module()
                self.consts.add_module(str(len(groups) - 1), groups[key])
            self._hold(j, t, self.consts if key is None else groups[key])
        self.placed: torch.device | None = None
        """The device the piece's graphs create their tensors on, once known (``retarget``)."""
        self.eval_piece: nn.Module | None = None
        """The piece of the model's eval-mode graph, where it differs (``modes``)."""
        self.eval_args: tuple[int, ...] = args

    def _hold(self, j: int, t: torch.Tensor, holder: nn.Module) -> None:
        """Register constant ``c{j}`` (a parameter or a buffer) on ``holder``."""
        if isinstance(t, nn.Parameter):
            holder.register_parameter(f"c{j}", t)
        else:
            holder.register_buffer(f"c{j}", t)
        self.holders.append(holder)

    def keep_eval(self, other: TracedStage) -> None:
        """Run ``other``'s piece (the same stage of the eval-mode graph) in eval mode; the
        parameters and buffers it reads outside submodules are taken from this stage's."""
        mine = {id(t): j for j, t in enumerate(self._consts())}
        theirs = other._consts()
        for t in theirs:
            if id(t) not in mine:
                mine[id(t)] = len(mine)
                self._hold(mine[id(t)], t, self.consts)
        self.eval_piece = other.piece
        self.eval_args = tuple(i if i >= 0 else -1 - mine[id(theirs[-i - 1])]
                               for i in other.args)

    def _consts(self) -> list[torch.Tensor]:
        """The parameters and buffers the piece takes as arguments, ``c0`` first."""
        return [getattr(holder, f"c{j}") for j, holder in enumerate(self.holders)]

    def _place(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Before a forward on a new device: the graphs create their tensors there."""
        device = compute_device(self, flat)
        if device is not None and device != self.placed:
            for piece in (self.piece, self.eval_piece):
                if piece is not None:
                    retarget(piece, device)
            self.placed = device

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the piece; pick the exported values from (inputs + own outputs). An exported
        graph switches gradient mode itself (``_set_grad_enabled`` around a model's
        ``no_grad`` blocks); the mode it found is restored even when the graph raises."""
        self._place(flat)
        piece, args = (self.piece, self.args) if self.training or self.eval_piece is None \
            else (self.eval_piece, self.eval_args)
        with training(self.training), torch.set_grad_enabled(torch.is_grad_enabled()):
            res = piece(*(flat[i] if i >= 0 else getattr(self.holders[-i - 1], f"c{-i - 1}")
                          for i in args))
        table = tuple(flat) + (tuple(res) if self.multi else (res,))
        out = tuple(table[i] for i in self.outs)
        bad = [i for i, t in enumerate(out) if not isinstance(t, torch.Tensor)]
        if bad:
            raise ConfigError(f"{self.name}: value {bad[0]} it hands on is a "
                              f"{type(out[bad[0]]).__name__}, not a tensor; only tensors "
                              "cross stage boundaries (move the split point)")
        return out


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
    """``graph_of`` with its random operations keyed and its computed weights marked."""
    gm = graph_of(module, example)
    key_random_ops(gm)  # the graph module's own copy of the module tree: yours is unchanged
    mark_computed(gm.graph)  # weights computed from parameters, known before the cut
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
    segments = _segments(split, calls, gm)
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
        with checkpointed(module) as own, functions_refused(module):
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


def _refs(split: fx.GraphModule, calls: list[fx.Node]) -> tuple[list[list[Ref]], list[Ref],
                                                                  list[int], dict[str, int]]:
    """Per stage the values its piece takes, the model's outputs, each piece's output count
    (as ``Ref``s), and the model attributes read outside submodules (``("attr", -1, j)``)."""
    index = {n: k for k, n in enumerate(calls)}
    inputs = [n for n in split.graph.nodes if n.op == "placeholder"]
    counts = [_outputs(getattr(split, str(n.target))) for n in calls]
    attrs: dict[str, int] = {}

    def ref(node: object) -> Ref:
        if isinstance(node, fx.Node) and node in inputs:
            return ("in", 0, inputs.index(node))
        if isinstance(node, fx.Node) and node.op == "get_attr":
            return ("attr", -1, attrs.setdefault(str(node.target), len(attrs)))
        if isinstance(node, fx.Node) and node in index:
            return ("out", index[node], 0)
        if isinstance(node, fx.Node) and node.op == "call_function" and node.args \
                and node.args[0] in index:
            return ("out", index[node.args[0]], int(node.args[1]))  # type: ignore[index,arg-type]
        raise ConfigError(f"the model passes {node!r} between stages, which is not a tensor "
                          "computed by a stage (move the split point)")

    args = [[ref(a) for a in n.args] for n in calls]
    if any(n.kwargs for n in calls):
        raise ConfigError("a traced stage takes keyword arguments (unsupported)")
    final = [ref(a) for a in output_leaves(split)]
    return args, final, counts, attrs


def _outputs(piece: fx.GraphModule) -> int:
    """How many values a split piece returns (1 unless it returns a tuple)."""
    out = next(n for n in piece.graph.nodes if n.op == "output").args[0]
    return len(out) if isinstance(out, tuple | list) else 1


def _owner(r: Ref) -> int:
    return 0 if r[0] == "in" else r[1]


def _segments(split: fx.GraphModule, calls: list[fx.Node], module: nn.Module) -> list[Segment]:
    """One ``Segment`` per stage; edges from every stage whose values a later one uses."""
    args, final, counts, attrs = _refs(split, calls)
    if any(r[0] == "attr" for r in final):
        raise ConfigError("the model returns one of its parameters or buffers unchanged")
    n = len(calls)
    needs = [[r for r in dict.fromkeys(a) if r[0] != "attr"] for a in args]
    needs[-1] = list(dict.fromkeys(needs[-1] + final))
    exports: list[list[Ref]] = []
    for k in range(n - 1):
        later = [r for j in range(k + 1, n) for r in needs[j] if _owner(r) == k]
        exports.append(list(dict.fromkeys(later)))
    exports.append(final)
    grad = _differentiable(split, calls, args, module, attrs)
    segments: list[Segment] = []
    for k, call in enumerate(calls):
        preds = sorted({_owner(r) for r in needs[k]} - {k}) if k else []
        takes = [tuple(i for i, r in enumerate(exports[p]) if r in needs[k]) for p in preds]
        flat: list[Ref] = [("in", 0, i) for i in range(_n_inputs(split))] if k == 0 else \
            [exports[p][i] for p, picks in zip(preds, takes, strict=True) for i in picks]
        own = [("out", k, i) for i in range(counts[k])]
        table = flat + own
        where = {r: i for i, r in reversed(list(enumerate(table)))}
        consts = [r for r in dict.fromkeys(args[k]) if r[0] == "attr"]
        where |= {r: -1 - j for j, r in enumerate(consts)}
        names = {j: t for t, j in attrs.items()}
        stage = TracedStage(getattr(split, str(call.target)), tuple(where[r] for r in args[k]),
                            tuple(where[r] for r in exports[k]),
                            _returns_tuple(getattr(split, str(call.target))), f"stage {k}",
                            [_attr(module, names[r[2]]) for r in consts],
                            [names[r[2]] for r in consts])
        if not exports[k]:
            raise ConfigError(f"nothing stage {k} computes is used later; move the split "
                              "points so that every stage feeds the next ones")
        if k and not preds:
            raise ConfigError(f"stage {k} uses nothing computed before it; move split point "
                              f"{k} so that every stage continues the previous ones")
        segments.append(Segment(f"s{k}", (stage,), after=tuple(f"s{p}" for p in preds),
                                takes=tuple(takes) if k else None,
                                grads=tuple(grad[r] for r in flat) if k else None))
    return segments


def _differentiable(split: fx.GraphModule, calls: list[fx.Node], args: list[list[Ref]],
                    module: nn.Module, attrs: dict[str, int]) -> dict[Ref, bool]:
    """Whether each value may depend on a trainable parameter (so a gradient flows back to
    it): not the batch inputs, nor what a stage computes from them and buffers alone (a
    model's masks and rotary tables). Conservative: anything downstream of a node that reads
    a trainable parameter counts."""
    names = {j: t for t, j in attrs.items()}
    grad: dict[Ref, bool] = {("attr", -1, j): _trainable(_attr(module, names[j]))
                             for j in names}
    grad |= {("in", 0, i): False for i in range(_n_inputs(split))}  # the batch: data
    for k, call in enumerate(calls):
        piece = getattr(split, str(call.target))
        given = iter(args[k])
        seen: dict[fx.Node, bool] = {}
        for node in piece.graph.nodes:
            if node.op == "placeholder":
                ref = next(given)
                seen[node] = grad[ref]
            elif node.op in ("get_attr", "call_module"):
                seen[node] = _trainable(_attr(piece, str(node.target))) or \
                    any(seen[n] for n in node.all_input_nodes)
            elif node.op == "output":
                outs = node.args[0]
                for i, n in enumerate(outs if isinstance(outs, tuple | list) else (outs,)):
                    grad[("out", k, i)] = isinstance(n, fx.Node) and seen[n]
            else:
                seen[node] = any(seen[n] for n in node.all_input_nodes)
    return grad


def _trainable(obj: object) -> bool:
    """Whether a parameter, or a module's parameters, take a gradient."""
    if isinstance(obj, nn.Module):
        return any(p.requires_grad for p in obj.parameters())
    return isinstance(obj, torch.Tensor) and obj.requires_grad


def block_key(name: str) -> str | None:
    """The repeated block a model name is in: its path up to the first index
    (``model.layers.3`` of ``model.layers.3.mlp.up_proj.weight``); None outside any."""
    parts = name.split(".")
    at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return None if at is None else ".".join(parts[:at + 1])


def _attr(module: nn.Module, target: str) -> Any:
    """The parameter, buffer or submodule at dotted path ``target`` of ``module``."""
    obj: object = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _n_inputs(split: fx.GraphModule) -> int:
    return sum(1 for n in split.graph.nodes if n.op == "placeholder")


def _returns_tuple(piece: fx.GraphModule) -> bool:
    out = next(n for n in piece.graph.nodes if n.op == "output").args[0]
    return isinstance(out, tuple | list)
