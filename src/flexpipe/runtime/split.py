"""Backward split with no wasted compute: B computes only the input gradients, W only the
weight gradients that are left.

B runs ``torch.autograd.grad`` towards the stage inputs, keeping the graph. Autograd then runs
only the nodes that lead to an input (the set I) and each node computes only the gradients
those need (a Linear computes dX, not dW). Before B, the graph is analysed: a node of I with an
edge into the rest of the graph that leads to parameters (the weight side, outside I) is a
*boundary*; a pre-hook captures the gradient of its output during B. W restarts autograd at the
boundaries with the captured gradients, towards the parameters only: it runs the weight-side
edges of each boundary node and the weight-side subgraph, nothing of B again.

Boundaries are grouped so that no W call crosses an I-edge: parameters reached from several
boundaries form one group; a group with two boundaries inside I (a parameter used twice along
the input path, e.g. a shared layer) falls back to a plain backward from the stage outputs for
those parameters (correct, not free). Outputs whose graph never reaches an input (the first
stage of a language model: its inputs are token ids) are W's roots directly; B does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class WeightWork:
    """What W needs: per group the roots (gradient edges), their captured gradients and the
    parameters; ``fallback`` = parameters recomputed from the outputs (with ``outputs`` and
    ``grads``)."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list)
    fallback: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node of ``t`` (its grad accumulator for a leaf)."""
    return torch.autograd.graph.get_gradient_edge(t).node if t.requires_grad else None


def _reach(roots: Sequence[Node], targets: dict[Node, int]) -> dict[Node, int]:
    """For every node reachable from ``roots``: the bitmask of ``targets`` it leads to."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack = list(roots)
    while stack:  # iterative post-order
        node = stack[-1]
        if node in seen:
            stack.pop()
            continue
        pending = [n for n, _ in node.next_functions if n is not None and n not in seen]
        if pending:
            stack += pending
            continue
        seen.add(node)
        order.append(node)
        stack.pop()
    mask: dict[Node, int] = {}
    for node in order:
        bits = targets.get(node, 0)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                bits |= mask.get(nxt, 0)
        mask[node] = bits
    return mask


class _Groups:
    """Union-find of boundary nodes by shared parameters."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        while self.parent.setdefault(x, x) != x:
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def plan_split(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               params: Sequence[torch.Tensor]) -> tuple[list[Node], list[tuple[list[Node], int]],
                                                        int]:
    """Boundary nodes, the groups as (boundary nodes, parameter bitmask) and the fallback mask.
    A root outside I is a boundary of its own (its gradient is the output gradient)."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    in_nodes = {n: 1 for n in (grad_node(x) for x in inputs) if n is not None}
    p_nodes = {grad_node(p): 1 << i for i, p in enumerate(params) if p.requires_grad}
    reach_in = _reach(roots, in_nodes)  # type: ignore[arg-type]
    reach_p = _reach(roots, p_nodes)  # type: ignore[arg-type]
    own: dict[Node, int] = {}
    for node, bits in reach_p.items():
        if not bits:
            continue
        if not reach_in.get(node):
            continue
        mine = 0
        for nxt, _ in node.next_functions:
            if nxt is not None and not reach_in.get(nxt):
                mine |= reach_p.get(nxt, 0)
        if mine:
            own[node] = mine
    for r in roots:
        if not reach_in.get(r) and reach_p.get(r):
            own[r] = reach_p[r]
    return _group(own, reach_in)


def _group(own: dict[Node, int], reach_in: dict[Node, int]
           ) -> tuple[list[Node], list[tuple[list[Node], int]], int]:
    nodes = list(own)
    uf = _Groups()
    first: dict[int, int] = {}
    for i, node in enumerate(nodes):
        uf.find(i)
        bits = own[node]
        while bits:
            low = bits & -bits
            bits ^= low
            if low in first:
                uf.union(i, first[low])
            else:
                first[low] = i
    members: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        members.setdefault(uf.find(i), []).append(i)
    groups: list[tuple[list[Node], int]] = []
    fallback = 0
    for idx in members.values():
        mask = 0
        for i in idx:
            mask |= own[nodes[i]]
        if sum(1 for i in idx if reach_in.get(nodes[i])) > 1:
            fallback |= mask
        else:
            groups.append(([nodes[i] for i in idx], mask))
    boundary = [n for g, _ in groups for n in g]
    return boundary, groups, fallback


def _pick(params: Sequence[torch.Tensor], mask: int) -> list[torch.Tensor]:
    return [p for i, p in enumerate(params) if mask >> i & 1]


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[Grads, WeightWork]:
    """B: gradients of the stage inputs (None where an input needs none), and what W needs."""
    outs, gs = _live(outputs, grads)
    boundary, groups, fallback = plan_split(outs, inputs, params)
    captured: dict[Node, Grads] = {}
    hooks = [n.register_prehook(_capture(captured, n)) for n in boundary]
    need = [x for x in inputs if x.requires_grad]
    try:
        got = torch.autograd.grad(outs, need, gs, retain_graph=True, allow_unused=True) \
            if need and outs else ()
    finally:
        for h in hooks:
            h.remove()
    it = iter(got)
    in_grads = tuple(next(it) if x.requires_grad else None for x in inputs)
    work = WeightWork()
    root_grad: dict[Node | None, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for t, g in zip(outs, gs, strict=True):
        root_grad.setdefault(t.grad_fn, []).append((t, g))
    for nodes, mask in groups:
        edges, gvals = _roots(nodes, captured, root_grad)
        if edges:
            work.groups.append((edges, gvals, _pick(params, mask)))
    if fallback:
        work.fallback, work.outputs, work.grads = _pick(params, fallback), outs, gs
    return in_grads, work


def _capture(store: dict[Node, Grads], node: Node):  # type: ignore[no-untyped-def]
    def hook(grad_outputs: Grads) -> None:
        store[node] = tuple(grad_outputs)
    return hook


def _roots(nodes: list[Node], captured: dict[Node, Grads],
           root_grad: dict[Node | None, list[tuple[torch.Tensor, torch.Tensor]]]
           ) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """The gradient edges W starts from and their gradients."""
    edges: list[GradientEdge] = []
    gvals: list[torch.Tensor] = []
    for node in nodes:
        if node in captured:
            for k, g in enumerate(captured[node]):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    gvals.append(g)
        else:
            for t, g in root_grad.get(node, []):
                edges.append(torch.autograd.graph.get_gradient_edge(t))
                gvals.append(g)
    return edges, gvals


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the remaining weight gradients into ``param.grad``."""
    if work.fallback:
        torch.autograd.backward(work.outputs, work.grads, inputs=work.fallback,
                                retain_graph=True)
    for edges, gvals, params in work.groups:
        torch.autograd.backward(edges, gvals, inputs=params, retain_graph=True)  # type: ignore
    work.groups.clear()
    work.outputs.clear()
    work.grads.clear()


def _live(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs that carry a graph, with their gradients (ones for a scalar loss)."""
    outs, gs = [], []
    for t, g in zip(outputs, grads, strict=True):
        if t.requires_grad:
            outs.append(t)
            gs.append(g if g is not None else torch.ones_like(t))
    return outs, gs
