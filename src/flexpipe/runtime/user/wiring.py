"""How the stages of a model cut by ``torch.fx.passes.split_module`` are wired together: per
stage what it takes from the batch, from earlier stages and from the model's own attributes
(``Ref``s), what it hands on to later stages or returns as the model's output, and which of
those values may carry a gradient (``segments``: one ``Segment`` of one ``TracedStage`` per
stage)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.user.interface import output_leaves
from flexpipe.runtime.user.traced_stage import TracedStage

Ref = tuple[str, int, int]  # ("in", 0, input), ("out", stage, output) or ("attr", -1, attr)


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


def segments(split: fx.GraphModule, calls: list[fx.Node], module: nn.Module) -> list[Segment]:
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
