"""Selective recompute for any traced model: what to drop, named by the user, and the regions of
the graph that SR then drops and recomputes.

``Recompute(drop=..., keep=..., every=n)`` names modules by type (``MyMLP``: every instance) or
by name pattern (``fnmatch`` on the module path, ``"layers.*.mlp"``, or on its last part,
``"mlp"``); ``every=n`` keeps only every n-th of the dropped modules (the first, the n+1-th,
...; counted in the model's order, a dropped module's own submodules not counted), and ``keep``
names modules never dropped even inside a dropped one (drop the blocks, keep their attention).
A model's own checkpoints (``torch.utils.checkpoint`` of a module, Hugging Face's
``gradient_checkpointing_enable()``) add the modules they checkpoint (``checkpoints``).
``policy=fn`` (torch's ``create_selective_checkpoint_contexts`` policy, ``fn(ctx, op, *args,
**kwargs) -> CheckpointPolicy``) or ``save_ops=[torch.ops.aten.mm.default, ...]``
(torchtitan's op-level SAC) keeps, inside the regions, the outputs of the operations it saves
and recomputes the rest (``flexpipe.runtime.execution.op_policy``); without ``drop`` every
module is a region.

``outline`` turns the selection into regions of the traced graph (torch.fx or torch.export:
each node knows its modules from ``nn_module_stack``): a region is a run of consecutive
operations inside one dropped module (and in no kept one) of one stage's piece; it becomes one
``Core`` calling a graph of its own operations, so in a forward marked SR its saved tensors
are dropped and SR recomputes them (``flexpipe.runtime.execution.selective``). Its random
operations were keyed before (``randomness``), so the recompute draws the forward's masks.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.op_policy import OpPolicy, check_ops, saving_ops
from flexpipe.runtime.execution.selective import Core

Name = str | type
"""A module name pattern or a module type."""
BARRIERS = (torch.amp._enter_autocast, torch.amp._exit_autocast,  # noqa: SLF001 - export's own
            torch._C._set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)
"""Operations a region never holds (they change the mode of what follows)."""


@dataclass(frozen=True)
class Recompute:
    """Which modules' saved activations SR drops and recomputes (the module docstring)."""

    drop: tuple[Name, ...] = ()
    keep: tuple[Name, ...] = ()
    every: int = 1
    checkpoints: bool = True
    """The modules the model checkpoints itself are dropped too."""
    policy: OpPolicy | None = None
    """torch's per-operation policy (``create_selective_checkpoint_contexts``'s):
    ``fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``; inside the dropped regions, the
    outputs of the operations it saves are kept, the rest recomputed (without ``drop``: every
    module of the model is a region)."""
    save_ops: tuple[object, ...] = ()
    """The policy that saves these operations' outputs (``torch.ops.aten.mm.default``, ...)."""

    def __post_init__(self) -> None:
        if isinstance(self.save_ops, list):
            object.__setattr__(self, "save_ops", tuple(self.save_ops))
        check_ops(self.save_ops)
        if self.policy is not None and self.save_ops:
            raise ConfigError("Recompute(policy=..., save_ops=...): give one of them (save_ops "
                              "is the policy that saves those operations)")
        if self.policy is not None and not callable(self.policy):
            raise ConfigError(f"Recompute(policy={self.policy!r}): the policy must be a "
                              "function fn(ctx, op, *args, **kwargs) -> CheckpointPolicy")
        if (self.policy is not None or self.save_ops) and not self.drop:
            object.__setattr__(self, "drop", ("*",))
        self._names()
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"Recompute(every={self.every!r}): every must be a positive "
                              "integer (1: every dropped module)")

    def op_policy(self) -> OpPolicy | None:
        """The per-operation policy of the regions (``policy``, or ``save_ops``'), or None."""
        return saving_ops(self.save_ops) if self.save_ops else self.policy

    def _names(self) -> None:
        for field_name in ("drop", "keep"):
            value = getattr(self, field_name)
            if isinstance(value, str | type):
                object.__setattr__(self, field_name, (value,))
            bad = [v for v in getattr(self, field_name) if not isinstance(v, str | type)]
            if bad:
                raise ConfigError(f"Recompute({field_name}=...): {bad[0]!r} is neither a module "
                                  "name pattern nor a module type")


def as_recompute(value: object) -> Recompute | None:
    """``recompute=`` as a ``Recompute``: one, None, a name or type, or a tuple of them (drop)."""
    if value is None or isinstance(value, Recompute):
        return value
    if isinstance(value, str | type):
        return Recompute(drop=(value,))
    if isinstance(value, tuple | list):
        return Recompute(drop=tuple(value))
    raise ConfigError(f"recompute must be a flexpipe.Recompute, a module name pattern, a module "
                      f"type or a tuple of them, got {type(value).__name__}")


def _matches(path: str, module: nn.Module, names: Iterable[Name]) -> bool:
    last = path.rsplit(".", 1)[-1]
    return any(isinstance(module, n) if isinstance(n, type)
               else fnmatch.fnmatchcase(path, n) or fnmatch.fnmatchcase(last, n)
               for n in names)


def selected(root: nn.Module, rc: Recompute, own: Sequence[str] = ()) -> tuple[set[str], set[str]]:
    """(paths of the modules dropped, paths of those kept) of ``root`` under ``rc``; ``own``:
    the modules the model checkpoints itself (dropped when ``rc.checkpoints``)."""
    mods = [(p, m) for p, m in root.named_modules() if p]
    matched = [p for p, m in mods if _matches(p, m, rc.drop)]
    outer = [p for p in matched if not any(p.startswith(q + ".") for q in matched)]
    drop = {p for i, p in enumerate(outer) if i % rc.every == 0}
    if rc.checkpoints:  # a flagged module holding flagged layers is not checkpointed itself
        drop |= {p for p in own if not any(q.startswith(p + ".") for q in own)}
    keep = {p for p, m in mods if _matches(p, m, rc.keep)}
    if rc.drop and not matched:
        shown = ", ".join(p for p, _ in mods[:10]) + (", ..." if len(mods) > 10 else "")
        raise ConfigError(f"Recompute(drop={rc.drop!r}) names no module of "
                          f"{type(root).__name__} (its modules: {shown})")
    return drop, keep


def module_paths(node: fx.Node) -> list[str]:
    """The module paths a node runs inside (outermost first; a leaf call includes itself)."""
    stack = node.meta.get("nn_module_stack", {})
    out = [str(v[0]) for v in stack.values()]
    if node.op == "call_module" and str(node.target) not in out:
        out.append(str(node.target))
    return out


def _region(node: fx.Node, drop: set[str], keep: set[str]) -> str | None:
    """The dropped module a node computes in (the innermost decision wins), or None."""
    if node.op not in ("call_function", "call_method", "call_module") or \
            node.target in BARRIERS:
        return None
    for path in reversed(module_paths(node)):
        if path in keep:
            return None
        if path in drop:
            return path
    return None


def outline(gm: fx.GraphModule, drop: set[str], keep: set[str],
            policy: OpPolicy | None = None) -> int:
    """Make every region of ``gm`` (one stage's piece of the graph: module docstring) one
    ``Core`` (keeping what ``policy`` saves: ``Recompute.op_policy``); how many regions
    there are."""
    runs: list[list[fx.Node]] = []
    last: str | None = None
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            continue  # read where it is used
        here = _region(node, drop, keep)
        if here is not None:
            if here != last:
                runs.append([])
            runs[-1].append(node)
        last = here
    for i, run in enumerate(runs):
        _outline(gm, run, f"flexpipe_sr_{i}", policy)
    if runs:
        gm.recompile()
    return len(runs)


def _outline(gm: fx.GraphModule, run: list[fx.Node], name: str,
             policy: OpPolicy | None) -> None:
    """Replace ``run`` by a call of a ``Core`` over a graph of its operations."""
    inside = set(run)
    inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes
                                if a not in inside and a.op != "get_attr"))
    outs = [n for n in run if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for j, a in enumerate(inputs):
        env[a] = sub.placeholder(f"in{j}")
        env[a].meta = dict(a.meta)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter or buffer read inside: read there too
            env[a] = sub.node_copy(a)
        return env[a]

    for n in run:
        env[n] = sub.node_copy(n, arg)
    sub.output(tuple(env[n] for n in outs))
    gm.add_submodule(name, Core(fx.GraphModule(gm, sub, "Region"), policy))
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta = {"nn_module_stack": _common(run)}
        for j, n in enumerate(outs):
            got = gm.graph.call_function(operator.getitem, (call, j))
            got.meta = dict(call.meta)
            n.replace_all_uses_with(got, delete_user_cb=lambda user: user not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)
    for a in [a for a in env if a.op == "get_attr" and not a.users]:
        gm.graph.erase_node(a)


def _common(run: list[fx.Node]) -> dict[str, object]:
    """The module stack every node of ``run`` is inside (outermost first)."""
    stacks = [list(n.meta.get("nn_module_stack", {}).items()) for n in run]
    common = []
    for entries in zip(*stacks, strict=False):
        if any(e != entries[0] for e in entries):
            break
        common.append(entries[0])
    return dict(common)


def has_regions(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` holds a region SR can drop (a ``Core``)."""
    return any(isinstance(m, Core) for module in modules for m in module.modules())
