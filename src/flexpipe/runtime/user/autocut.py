"""Split points chosen for you: where a model that is not a chain of layers (any
``nn.Module``, a Hugging Face model exported by ``torch.export``) is cut when no split points
are given.

The candidates are the starts of the modules the forward enters, each named by the outermost
module starting there (``blocks.2`` rather than ``blocks.2.linear1``): the model's own
children, the blocks of its lists of modules and those blocks' children (a cut may fall
between a block's attention and its MLP, ``h.1.ln_2``, which the stage graph carries like any
skip, where no more crosses than at the block's start), or, where those are too few for
the stages or their best cut leaves a rank nearly idle (``IDLE``), any module where no more
crosses than at its parent's start. The cut balances the RANKS'
work (``flexpipe.cost.partition.balanced_partition``: under a V placement rank 0 holds the
first and the last stage, so an embedding and an LM head share a rank). The work of a piece is
its counted floating-point operations on one micro-batch (``example``: the model run once,
node by node, on fake tensors under ``torch.utils.flop_counter``: shapes only, nothing
computed; counted, not timed, so every rank and every run cut the same way) or, without
example inputs, its parameters. Parameters mislead on language models: an embedding table
holds as many as the head but computes nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
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
    first = entries(nodes)
    every = {p: p.rpartition(".")[0] or None for p in first}
    tiers: list[Mapping[str, str | None]] = [coarse(module), every]
    if example is None:
        work = node_params(gm)
    else:
        work, sizes = node_flops(gm, module, example)
        cross = crossing(nodes, sizes)
        tiers = [thin(tiers[0], first, cross), thin(every, first, cross), every]
    # the first tier with enough candidates (blocks, then any module, where no more crosses)
    # whose cut leaves no rank nearly idle; else the one whose idlest rank has the most work
    cuts = [_cut(got, nodes, work, stage_rank) for got in (_starts(first, t) for t in tiers)
            if len(got) + 1 >= len(stage_rank)]
    if not cuts:
        raise ConfigError(f"{type(module).__name__} calls too few modules to be cut into "
                          f"{len(stage_rank)} stages; give split points or fewer stages")
    return next((points for points, loads in cuts if _busy(loads, stage_rank)),
                max(cuts, key=lambda cut: min(_ranks(cut[1], stage_rank)))[0])


IDLE = 0.1
"""A cut that gives some rank less than this share of the mean rank's work (or a stage
nothing) is passed over for a finer tier's: ALBERT, whose one layer serves every block, cut
at its own children left one rank all of the encoder and another only the classifier (at 3
ranks, a rank only its dropout, and no parameters)."""


def _busy(loads: Sequence[float], stage_rank: Sequence[int]) -> bool:
    """Whether every stage has work and every rank at least ``IDLE`` of the mean rank's."""
    ranks = _ranks(loads, stage_rank)
    return min(loads) > 0 and min(ranks) >= IDLE * sum(ranks) / len(ranks)


def _ranks(loads: Sequence[float], stage_rank: Sequence[int]) -> list[float]:
    """Each rank's work: the ``loads`` of its stages."""
    ranks = [0.0] * (max(stage_rank) + 1)
    for load, r in zip(loads, stage_rank, strict=True):
        ranks[r] += load
    return ranks


def _cut(named: Mapping[int, str], nodes: Sequence[fx.Node], work: Mapping[fx.Node, float],
         stage_rank: Sequence[int]) -> tuple[tuple[str, ...], list[float]]:
    """The split points among the candidates ``named`` (node index -> module) that balance
    the ranks' ``work``, and each stage's work."""
    starts = sorted(named)
    bounds = [0, *starts, len(nodes)]
    costs = [sum(work.get(n, 0.0) for n in nodes[a:b])
             for a, b in zip(bounds, bounds[1:], strict=False)]
    counts = balanced_partition(costs, stage_rank)
    cuts = [sum(counts[:k]) for k in range(1, len(counts))]  # the unit that starts stage k
    names = ["", *(named[i] for i in starts)]  # unit u starts at module names[u]
    units = settle(cuts, costs, names)
    edges = [0, *units, len(costs)]
    loads = [sum(costs[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
    return tuple(names[c] for c in units), loads


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


def coarse(module: nn.Module) -> dict[str, str | None]:
    """The modules a cut may start at first, each -> the block it is a part of (None for a
    block): the model's own children, the blocks of every list or ``nn.Sequential`` of
    modules (``h.2``) and those blocks' children (``h.2.mlp``), not deeper (a cut between a
    block's query and key projections sends three tensors where one would do)."""
    out: dict[str, str | None] = {name: None for name, _ in module.named_children()}
    for name, sub in module.named_modules():
        kids = list(sub.named_children())
        if isinstance(sub, nn.ModuleList | nn.Sequential) and len(kids) > 1:
            prefix = f"{name}." if name else ""
            for kid, block in kids:
                out[prefix + kid] = None
                out.update((f"{prefix}{kid}.{part}", prefix + kid)
                           for part, _ in block.named_children())
    return out


def crossing(nodes: Sequence[fx.Node], sizes: Mapping[fx.Node, float]) -> list[float]:
    """Bytes that cross a cut before each node: the values made before it and read at or
    after it (parameters excluded: they stay with their stage)."""
    index = {n: i for i, n in enumerate(nodes)}
    delta = [0.0] * (len(nodes) + 1)
    for i, node in enumerate(nodes):
        last = max((index[u] for u in node.users if u in index), default=i)
        if node.op != "get_attr" and last > i:
            delta[i + 1] += sizes.get(node, 0.0)
            delta[last + 1] -= sizes.get(node, 0.0)
    out, total = [], 0.0
    for d in delta[:-1]:
        total += d
        out.append(total)
    return out


def entries(nodes: Sequence[fx.Node]) -> dict[str, int]:
    """Module path -> the index of the first node that runs inside it."""
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for path in module_paths(node):
            first.setdefault(path, i)
    return first


def thin(allowed: Mapping[str, str | None], first: Mapping[str, int],
         cross: Sequence[float]) -> dict[str, str | None]:
    """``allowed`` without the parts of blocks where more crosses than at the block's start
    (between an MLP's two products its wide hidden layer would cross beside the residual);
    ``first``: where each module starts (``entries``)."""

    def keeps(part: str, block: str | None) -> bool:
        return block is None or part not in first or block not in first \
            or cross[first[part]] <= cross[first[block]]
    return {p: b for p, b in allowed.items() if keeps(p, b)}


def _starts(first: Mapping[str, int], allowed: Mapping[str, object]) -> dict[int, str]:
    """Node index -> the outermost module of ``allowed`` that starts there (``first``: where
    each module starts; the first module excluded)."""
    mine = {path: i for path, i in first.items() if path in allowed}
    begin = min(mine.values(), default=0)
    named: dict[int, str] = {}
    for path, i in sorted(mine.items(), key=lambda kv: kv[0].count(".")):
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
    """Runs a graph node by node, noting the FLOPs each node adds to ``counter`` and the
    bytes of its output."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.flops: dict[fx.Node, float] = {}
        self.bytes: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> object:
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = float(self.counter.get_total_flops() - before)
        self.bytes[n] = float(sum(t.numel() * t.element_size()
                                  for t in pytree.tree_leaves(out)
                                  if isinstance(t, torch.Tensor)))
        return out


Counts = tuple[dict[fx.Node, float], dict[fx.Node, float]]


def node_flops(gm: fx.GraphModule, module: nn.Module, example: object) -> Counts:
    """Forward FLOPs of each node of ``gm`` (``module``'s graph) on one micro-batch, and the
    bytes of its output, counted on fake tensors (shapes only: nothing is computed, however
    large the model), or on the example itself where an operation needs values (a shape that
    depends on the data)."""
    try:
        values = _placeholder_values(gm, module, example)
    except TypeError as exc:
        raise ConfigError(f"the example inputs do not fit {type(module).__name__}.forward "
                          f"({exc}); give split points") from None
    try:
        with _unchanged(module), FakeTensorMode(allow_non_fake_inputs=True) as fake:
            return _count(gm, [fake.from_tensor(v) if isinstance(v, torch.Tensor) else v
                               for v in values])
    except Exception:  # noqa: BLE001 - an op that needs real values: count on the example
        pass
    try:
        with _unchanged(module):
            return _count(gm, values)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot run {type(module).__name__} on the example inputs to "
                          f"count its FLOPs for the automatic split points ({first}); give "
                          "split points") from None


@contextlib.contextmanager
def _unchanged(module: nn.Module) -> Iterator[None]:
    """Counting leaves your model as it was: its buffers (a BatchNorm's running statistics
    and batch count) are put back, and torch's random state (dropout) too."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, value in saved:
                    buf.copy_(value)


def _count(gm: fx.GraphModule, inputs: Sequence[object]) -> Counts:
    counting = _Counting(gm, FlopCounterMode(display=False))
    with counting.counter, torch.no_grad():
        counting.run(*inputs)
    return counting.flops, counting.bytes


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
