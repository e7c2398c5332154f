"""Split points chosen for you: where a model that is not a chain of layers (any
``nn.Module``, a Hugging Face model exported by ``torch.export``) is cut when no split points
are given.

The candidates are the starts of the modules the forward enters, each named by the outermost
module starting there (``blocks.2`` rather than ``blocks.2.linear1``); a cut may fall inside a
block (``h.1.mlp``), which the stage graph carries like any skip. The cut balances the RANKS'
work (``flexpipe.cost.partition.balanced_partition``: under a V placement rank 0 holds the
first and the last stage, so an embedding and an LM head share a rank). The work of a piece is
its counted floating-point operations on one micro-batch (``example``: the model run once,
node by node, under ``torch.utils.flop_counter``; counted, not timed, so every rank and every
run cut the same way) or, without example inputs, its parameters. Parameters mislead on
language models: an embedding table holds as many as the head but computes nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from flexpipe.cost.partition import balanced_partition
from flexpipe.errors import ConfigError
from flexpipe.runtime.user.interface import as_example
from flexpipe.runtime.user.tracing import graph_of, module_paths


def auto_points(module: nn.Module, stage_rank: Sequence[int], example: object = None
                ) -> tuple[str, ...]:
    """Split points for ``len(stage_rank)`` stages that balance the ranks' counted FLOPs on
    ``example`` (one micro-batch's inputs), or their parameters without it."""
    gm = graph_of(module, example)
    nodes = list(gm.graph.nodes)
    named = _starts(nodes)
    starts = sorted(named)
    if len(starts) + 1 < len(stage_rank):
        raise ConfigError(f"{type(module).__name__} calls too few modules to be cut into "
                          f"{len(stage_rank)} stages; give split points or fewer stages")
    work = node_params(gm) if example is None else node_flops(gm, module, example)
    bounds = [0, *starts, len(nodes)]
    costs = [sum(work.get(n, 0.0) for n in nodes[a:b])
             for a, b in zip(bounds, bounds[1:], strict=False)]
    counts = balanced_partition(costs, stage_rank)
    cuts = [sum(counts[:k]) for k in range(1, len(counts))]  # the unit that starts stage k
    names = ["", *(named[i] for i in starts)]  # unit u starts at module names[u]
    return tuple(names[c] for c in settle(cuts, costs, names))


def settle(cuts: Sequence[int], costs: Sequence[float], names: Sequence[str]) -> list[int]:
    """Each cut moved, across units that cost nothing (so no rank's work changes), to the
    outermost module there: a block's start (``h.2``, where one tensor crosses) rather than
    the dropout ending the block before (``h.1.mlp.dropout``, where the residual crosses
    beside the block's output)."""
    out = list(cuts)
    for k, c in enumerate(out):
        low = out[k - 1] + 1 if k else 1
        high = out[k + 1] - 1 if k + 1 < len(out) else len(costs) - 1
        lo = c
        while lo - 1 >= low and costs[lo - 1] == 0:
            lo -= 1
        hi = c
        while hi + 1 <= high and costs[hi] == 0:
            hi += 1
        out[k] = min(range(lo, hi + 1), key=lambda u: (names[u].count("."), abs(u - c)))
    return out


def _starts(nodes: Sequence[fx.Node]) -> dict[int, str]:
    """Node index -> the outermost module that starts there (the first module excluded)."""
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for path in module_paths(node):
            first.setdefault(path, i)
    begin = min(first.values(), default=0)
    named: dict[int, str] = {}
    for path, i in sorted(first.items(), key=lambda kv: kv[0].count(".")):
        if i > begin:
            named.setdefault(i, path)
    return named


def node_params(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """Parameters each node uses (a called module's, or a parameter it reads)."""
    out: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            out[node] = float(sum(p.numel() for p in sub.parameters()))
        elif node.op == "get_attr":
            obj: object = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            out[node] = float(obj.numel()) if isinstance(obj, nn.Parameter) else 0.0
    return out


class _Counting(fx.Interpreter):
    """Runs a graph node by node, noting the FLOPs each node adds to ``counter``."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.flops: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> object:
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = float(self.counter.get_total_flops() - before)
        return out


def node_flops(gm: fx.GraphModule, module: nn.Module, example: object) -> dict[fx.Node, float]:
    """Forward FLOPs of each node of ``gm`` (``module``'s graph) on one micro-batch."""
    counting = _Counting(gm, FlopCounterMode(display=False))
    try:
        inputs = _placeholder_values(gm, module, example)
        with counting.counter, torch.no_grad():
            counting.run(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot run {type(module).__name__} on the example inputs to "
                          f"count its FLOPs for the automatic split points ({first}); give "
                          "split points") from None
    return counting.flops


def _placeholder_values(gm: fx.GraphModule, module: nn.Module, example: object
                        ) -> list[object]:
    """The values of ``gm``'s placeholders for ``example``: an exported graph takes the
    flattened (args, kwargs); a traced one the forward's parameters, by name."""
    args, kwargs = as_example(example)
    if getattr(gm.graph._codegen, "pytree_info", None) is not None:
        return list(pytree.tree_leaves((tuple(args), dict(kwargs))))
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    return [values[str(n.target)] for n in gm.graph.nodes if n.op == "placeholder"]
