"""How the eager path cuts a model (``eager.py`` builds the stages): the modules a stage does
not own, what a stage hands the next one, and the one forward on the example that finds both.

A stage runs the model's own forward on the batch inputs with its model's modules replaced:

- a block another stage owns is a ``Skip``: it returns its first input (padded with ``None``
  to the length of the tuple the block returns, so a loop unpacking it goes on);
- the first block after the stage's own ends the forward (``Exit``): the tensors it would have
  been called with at its ``Boundary`` keys are what the stage hands the next one;
- a stage that is not the first replaces the modules with parameters called before the blocks
  (the embeddings) by ``Stub``s returning the hidden state it received, and puts what it
  received back into the call of its first block (``Boundary.put``): whatever the forward
  computed from the stubs is dropped there, while masks, positions and rotary tables are the
  model's own, computed from the real batch inputs, which every stage receives;
- a module with parameters the example's forward never called is ``Missing`` (no stage holds
  its parameters; calling it is an error naming it).

``Boundary.keys`` are the first input of the block (the hidden state) and every other input
of its call that depends on parameters (requires a gradient in the example's forward: T5's
position bias, an encoder's output for cross-attention); other inputs are computed again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError

Key = int | str
"""A positional input of a call by its index, a keyword input by its name."""
Call = Callable[[nn.Module, tuple[torch.Tensor, ...]], Any]
"""How a stage calls its model on the batch inputs (``model(*batch)`` unless told)."""
Blocks = tuple[str, nn.ModuleList | nn.Sequential]
"""The path of the list of blocks and the list."""


@dataclass
class Slot:
    """The hidden state a stage received, for its stubs, during its forward."""

    value: torch.Tensor | None = None


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The first input of a call (positional, else the first keyword)."""
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise ConfigError(f"eager stages: {name!r} was called without inputs")


class Skip(nn.Module):
    """A block another stage owns: returns its first input (in a tuple of ``arity`` padded
    with None where the block returns a tuple)."""

    def __init__(self, name: str, arity: int | None = None) -> None:
        super().__init__()
        self.name, self.arity = name, arity

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first input, shaped like the block's result."""
        x = first_input(args, kwargs, self.name)
        return x if self.arity is None else (x, *(None,) * (self.arity - 1))


class Stub(nn.Module):
    """A module before the blocks that another stage owns: returns the received hidden state."""

    def __init__(self, name: str, slot: Slot) -> None:
        super().__init__()
        self.name, self.slot = name, slot

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The hidden state the stage received (dropped again at its first block)."""
        if self.slot.value is None:
            raise ConfigError(f"eager stages: {self.name!r} belongs to an earlier stage but "
                              "was called outside a stage's forward")
        return self.slot.value


class Missing(nn.Module):
    """A module with parameters the example's forward never called: on no stage."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse: no stage holds the module's parameters."""
        raise ConfigError(f"eager stages: the forward called {self.name!r}, which the "
                          "example's forward did not call, so no stage holds it; give an "
                          "example that takes every path the model takes")


class Exited(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The stage's last block ran: the call of the next block, caught by the stage."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("the stage's last block ran")
        self.call = args, kwargs


class Exit(Skip):
    """The first block of the next stage: ends the stage's forward with its call."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Raise the call the block would take."""
        raise Exited(args, kwargs)


@dataclass(frozen=True)
class Boundary:
    """What a stage hands the next one: the inputs at ``keys`` of the call of ``block``."""

    block: str
    keys: tuple[Key, ...]

    def take(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        """The tensors at the keys of a call."""
        args, kwargs = call
        got = [args[k] if isinstance(k, int) and k < len(args) else
               kwargs.get(k) if isinstance(k, str) else None for k in self.keys]
        tensors = [t for t in got if isinstance(t, torch.Tensor)]
        if len(tensors) != len(got):
            bad = next(k for k, t in zip(self.keys, got, strict=True)
                       if not isinstance(t, torch.Tensor))
            raise ConfigError(f"eager stages: {self.block!r} was called without a tensor at "
                              f"input {bad!r}, which it took in the example's forward")
        return tuple(tensors)

    def put(self, args: tuple[Any, ...], kwargs: dict[str, Any],
            values: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with ``values`` at the keys (a forward pre-hook's result)."""
        listed, named = list(args), dict(kwargs)
        for k, v in zip(self.keys, values, strict=True):
            if isinstance(k, int):
                listed[k] = v
            else:
                named[k] = v
        return tuple(listed), named


@dataclass
class Seen:
    """What the example's forward showed: the outer modules with parameters it called before
    the first block and after, those it never called, every block's result arity and the
    boundary at every start."""

    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    arity: dict[int, int | None] = field(default_factory=dict)
    bounds: dict[int, Boundary] = field(default_factory=dict)


def watch(model: nn.Module, blocks: Blocks, starts: Sequence[int], call: Call,
          batch: tuple[torch.Tensor, ...]) -> Seen:
    """Run ``call(model, batch)`` once (with gradients, to see what depends on parameters)
    and record what ``Seen`` holds."""
    name, holder = blocks
    inside = {id(m) for m in holder.modules()}
    outer = [(n, m) for n, m in tops(model, name) if id(m) not in inside and
             any(True for _ in m.parameters())]
    order: list[int] = []
    seen = Seen()
    hooks = [m.register_forward_pre_hook(lambda mod, _a: order.append(id(mod))) for _, m in outer]
    for i, block in enumerate(holder):
        hooks.append(block.register_forward_pre_hook(_noter(order, seen, name, i, starts),
                                                     with_kwargs=True))
        hooks.append(block.register_forward_hook(_arity(seen, i)))
    try:
        with torch.enable_grad():
            call(model, batch)
    finally:
        for h in hooks:
            h.remove()
    start = order.index(id(holder[0])) if id(holder[0]) in order else len(order)
    early, late = set(order[:start]), set(order[start:])
    seen.before = [n for n, m in outer if id(m) in early]
    seen.after = [n for n, m in outer if id(m) in late and id(m) not in early]
    seen.unused = [n for n, m in outer if id(m) not in early | late]
    missed = [s for s in starts if s not in seen.bounds]
    if missed:
        raise ConfigError(f"eager stages: the example's forward never called block "
                          f"{name}.{missed[0]}")
    return seen


def _noter(order: list[int], seen: Seen, name: str, i: int, starts: Sequence[int]
           ) -> Callable[..., None]:
    def note(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if i == 0:
            order.append(id(mod))
        if i in starts and i not in seen.bounds:
            first: Key = 0 if args else next(iter(kwargs), 0)
            calls: list[tuple[Key, Any]] = [*enumerate(args), *kwargs.items()]
            keys = [first] + [k for k, v in calls
                              if k != first and isinstance(v, torch.Tensor) and v.requires_grad]
            seen.bounds[i] = Boundary(f"{name}.{i}", tuple(keys))
    return note


def _arity(seen: Seen, i: int) -> Callable[..., None]:
    def note(_mod: nn.Module, _args: Any, out: Any) -> None:
        seen.arity.setdefault(i, len(out) if isinstance(out, tuple) else None)
    return note


def tops(model: nn.Module, blocks: str) -> list[tuple[str, nn.Module]]:
    """The children of the model and of every module holding the blocks (not those)."""
    path = blocks.split(".")
    holders = {".".join(path[:i]) for i in range(len(path))}
    return [(f"{h}.{c}" if h else c, m) for h in sorted(holders, key=len)
            for c, m in model.get_submodule(h).named_children()
            if (f"{h}.{c}" if h else c) not in holders | {blocks}]


def owned(blocks: Blocks, lo: int, hi: int, arity: dict[int, int | None]) -> nn.Module:
    """The block list with blocks ``lo .. hi - 1`` kept: the ones before skipped, the next
    one the stage's exit, the rest skipped."""
    name, holder = blocks
    kept: list[nn.Module] = []
    for i, block in enumerate(holder):
        where, n = f"{name}.{i}", arity.get(i)
        kept.append(block if lo <= i < hi else Exit(where, n) if i == hi else Skip(where, n))
    return type(holder)(*kept) if isinstance(holder, nn.Sequential) else nn.ModuleList(kept)


def swapped(model: nn.Module, swap: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``model`` with the modules at the paths of ``swap`` replaced (the
    modules on those paths copied, every other module and parameter the model's own)."""
    root = _shallow(model)
    for path, new in swap.items():
        *up, leaf = path.split(".")
        holder = root
        for part in up:
            child = _shallow(holder._modules[part])  # noqa: SLF001 - copy along the path
            holder._modules[part] = child  # noqa: SLF001
            holder = child
        holder._modules[leaf] = new  # noqa: SLF001
    return root


def _shallow(module: nn.Module | None) -> nn.Module:
    if module is None:
        raise ConfigError("eager stages: a path names no module")
    out = copy.copy(module)
    out._modules = dict(module._modules)  # noqa: SLF001 - its own children table
    return out

