"""The eager path: a model cut into stages that run your own modules as they are, without
tracing, for a model torch.fx cannot trace nor torch.export export (data-dependent control
flow, a Hugging Face mixture of experts returning its router logits, ...).

``eager_stages(model, split_points, example)`` gives the model as a chain of stages (an
``EagerModel``, an ``nn.ModuleList`` with one entry per stage), which ``flexpipe.pipeline`` and
``UserModel`` cut one stage per entry. The split points name blocks of one ``nn.ModuleList``
(or ``nn.Sequential``) that the model's forward runs in turn (``"layers.2"``: block 2 starts
stage 1). Each stage is the model itself, copied shallowly (its modules and parameters are
the model's own objects, so tied weights stay one parameter) with the modules other stages
own replaced, and it runs the model's own forward:

- the blocks before the stage's first one are skipped (``Skip`` returns its first input);
- a stage that is not the first skips the modules with parameters that the forward calls
  before the blocks (the embedding: it returns its first input, which is the hidden state the
  stage received, since the stage calls the model with it in place of the first batch input);
- the first block after the stage's last one ends the forward: what it would have been given
  (its first input) is the stage's output (``Exit``), with the batch inputs after the first
  (masks, ...) carried unchanged to the next stage, which calls the model with them;
- the last stage returns the model's output as tensors (a tuple's, dict's or
  ``ModelOutput``'s entries in order), for ``loss_fn(*outputs, target)``.

The forward may branch on values (``if h.mean() > 0``): nothing is traced. Stage ``k``'s
input is stage ``k - 1``'s output, so the cut holds only for a forward in which the blocks
pass one hidden state along and what precedes them depends on the first input through the
embedding alone: every cut is checked on the example before it is used (the stages in turn
must give the model's own output, in eval mode), and one that does not is refused by name.

``collect`` carries values the model gathers on the way (a mixture of experts' router logits,
for a loss over every layer's): the outputs of modules of a class, concatenated stage after
stage, as the last output of every stage (``hf_eager`` uses it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flexpipe.errors import ConfigError
from flexpipe.runtime.user.interface import as_inputs

Finish = Callable[[Any, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
"""The last stage's model output and the batch inputs after the first -> the tensors it
returns."""


class Skip(nn.Module):
    """A module another stage owns: returns its first input."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first input (positional, else the first keyword)."""
        return _first(args, kwargs, self.name)


class _Exited(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("the stage's last block ran")
        self.value = value


class Exit(Skip):
    """The first block of the next stage: ends the stage's forward with its input."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Raise the value the block would take, caught by ``EagerStage``."""
        raise _Exited(_first(args, kwargs, self.name))


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise ConfigError(f"eager stages: {name!r} was called without inputs")


@dataclass(frozen=True)
class Collect:
    """Outputs to carry to the last stage: output ``index`` of every module of class
    ``kind`` (a tensor each, concatenated along dimension 0)."""

    kind: type[nn.Module]
    index: int = 0


class EagerStage(nn.Module):
    """Stage ``index`` of ``count``: the model with the modules of other stages replaced."""

    def __init__(self, model: nn.Module, index: int, count: int, collect: Collect | None,
                 finish: Finish | None) -> None:
        super().__init__()
        self.model = model
        self.index, self.count, self.collect = index, count, collect
        self.finish = finish

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """Stage 0 takes the batch inputs, a later one the previous stage's outputs; returns
        (hidden, batch inputs after the first, [collected]) or, on the last stage, the
        model's output as tensors ([collected] last)."""
        got = list(xs)
        before = got.pop() if self.collect is not None and self.index else None
        found: list[torch.Tensor] = [] if before is None else [before]
        hooks = [] if self.collect is None else [
            m.register_forward_hook(lambda _m, _a, out: found.append(_pick(out, self.collect)))
            for m in self.model.modules() if isinstance(m, self.collect.kind)]
        try:
            out = self.model(*got)
        except _Exited as done:
            return (done.value, *got[1:], *self._collected(found))
        finally:
            for h in hooks:
                h.remove()
        if self.index != self.count - 1:
            raise ConfigError(f"eager stage {self.index}: the forward returned before the "
                              "next stage's first block (is it a block the forward calls?)")
        leaves = self.finish(out, tuple(got[1:])) if self.finish is not None else _leaves(out)
        return (*leaves, *self._collected(found))

    def _collected(self, found: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.collect is None:
            return ()
        return (torch.cat(found) if found else torch.zeros(0),)


def _pick(out: Any, collect: Collect | None) -> torch.Tensor:
    assert collect is not None
    value = out[collect.index] if isinstance(out, tuple | list) else out
    return value.reshape(-1, value.shape[-1])


def _leaves(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    leaves = [v for v in tree_flatten(dict(out) if hasattr(out, "keys") else out)[0]
              if v is not None]
    if not all(isinstance(v, torch.Tensor) for v in leaves):
        raise ConfigError("eager stages: the model's output must be tensors (in a tuple, a "
                          "dict or a ModelOutput)")
    return tuple(leaves)


class EagerModel(nn.ModuleList):
    """A model as its eager stages, one per entry: a chain of layers, one layer per stage.
    ``source`` is the model cut (its parameters keep their names there)."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.__dict__["source"] = source  # not a submodule: its parameters are the stages'


def eager_stages(model: nn.Module, split_points: Sequence[str], example: object,
                 collect: Collect | None = None, finish: Finish | None = None,
                 check: bool = True) -> EagerModel:
    """``model`` cut at ``split_points`` (blocks of one ``nn.ModuleList``/``nn.Sequential``,
    in order) into eager stages; ``example``: one micro-batch's inputs (a tensor or a tuple),
    run once to see which modules the forward calls before and after the blocks, and to
    check the cut (``check``)."""
    inputs = as_inputs(example, "eager stages: example")
    blocks, starts = _blocks(model, split_points)
    before, after = _outside(model, blocks, inputs)
    bounds = [0, *starts, len(blocks[1])]
    stages = EagerModel(model)
    for k in range(len(bounds) - 1):
        swap: dict[str, nn.Module] = {name: Skip(name) for name in (before if k else []) +
                (after if k < len(bounds) - 2 else [])}
        swap[blocks[0]] = _owned(blocks, bounds[k], bounds[k + 1])
        stages.append(EagerStage(_swapped(model, swap), k, len(bounds) - 1, collect, finish))
    if check:
        check_stages(model, stages, inputs)
    return stages


Blocks = tuple[str, nn.ModuleList | nn.Sequential]
"""The path of the list of blocks and the list."""


def _blocks(model: nn.Module, points: Sequence[str]) -> tuple[Blocks, list[int]]:
    """The block list the split points name, and the index each starts."""
    if not points:
        raise ConfigError("eager stages need split points: the blocks that start stages 1, "
                          "2, ... (e.g. split_points=('layers.2',))")
    names = dict(model.named_modules())
    parents, starts = set(), []
    for point in points:
        parent, _, idx = point.rpartition(".")
        holder = names.get(parent)
        if point not in names or not isinstance(holder, nn.ModuleList | nn.Sequential) or \
                not idx.isdigit():
            raise ConfigError(f"split point {point!r}: not a block of an nn.ModuleList or "
                              f"nn.Sequential of {type(model).__name__} (e.g. 'layers.2')")
        parents.add(parent)
        starts.append(int(idx))
    if len(parents) > 1:
        raise ConfigError(f"split points {list(points)} name blocks of several lists "
                          f"({sorted(parents)}); the eager path cuts one list of blocks")
    parent = parents.pop()
    holder = names[parent]
    assert isinstance(holder, nn.ModuleList | nn.Sequential)
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ConfigError(f"split points {list(points)}: blocks in increasing order, after "
                          f"block 0 of {parent!r}")
    return (parent, holder), starts


def _outside(model: nn.Module, blocks: Blocks, inputs: tuple[torch.Tensor, ...]
             ) -> tuple[list[str], list[str]]:
    """The modules with parameters outside the blocks (and not holding them) that the forward
    first calls before the first block, and those it calls after (on ``inputs``)."""
    name, holder = blocks
    inside = {id(m) for m in holder.modules()}
    outer = [(n, m) for n, m in _tops(model, name) if id(m) not in inside]
    order: list[int] = []
    first_block = holder[0]
    hooks = [m.register_forward_pre_hook(lambda mod, _a: order.append(id(mod)))
             for _, m in outer] + [first_block.register_forward_pre_hook(
                 lambda mod, _a: order.append(id(mod)))]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    start = order.index(id(first_block)) if id(first_block) in order else len(order)
    early = {i for i in order[:start]}
    own = [(n, m) for n, m in outer if any(True for _ in m.parameters())]
    return [n for n, m in own if id(m) in early], [n for n, m in own if id(m) not in early]


def _tops(model: nn.Module, blocks: str) -> list[tuple[str, nn.Module]]:
    """The children of the model and of every module holding the blocks (not those)."""
    path = blocks.split(".")
    holders = {".".join(path[:i]) for i in range(len(path))}
    return [(f"{h}.{c}" if h else c, m) for h in sorted(holders, key=len)
            for c, m in model.get_submodule(h).named_children()
            if (f"{h}.{c}" if h else c) not in holders | {blocks}]


def _owned(blocks: Blocks, lo: int, hi: int) -> nn.Module:
    """The block list with blocks ``lo .. hi - 1`` kept: the ones before skipped, the next
    one the stage's exit, the rest skipped."""
    name, holder = blocks
    kept: list[nn.Module] = []
    for i, block in enumerate(holder):
        where = f"{name}.{i}"
        kept.append(block if lo <= i < hi else Exit(where) if i == hi else Skip(where))
    return type(holder)(*kept) if isinstance(holder, nn.Sequential) else nn.ModuleList(kept)


def _swapped(model: nn.Module, swap: Mapping[str, nn.Module]) -> nn.Module:
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


def check_stages(model: nn.Module, stages: EagerModel, inputs: tuple[torch.Tensor, ...]
                 ) -> None:
    """Refuse a cut whose stages, run in turn on ``inputs`` (in eval mode, no gradients), do
    not give the model's own output."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            out = model(*inputs)
            last = stages[-1]
            assert isinstance(last, EagerStage)
            finish = last.finish
            want = finish(out, inputs[1:]) if finish is not None else _leaves(out)
            got: tuple[torch.Tensor, ...] = inputs
            for stage in stages:
                got = stage(*got)
    except _Exited as exc:
        raise ConfigError("eager stages: the forward calls a block outside its loop") from exc
    finally:
        for m, mode in modes:
            m.train(mode)
    if last.collect is not None:
        got = got[:-1]
    same = len(got) >= len(want) and all(
        g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6) if
        g.is_floating_point() else torch.equal(g, w) for g, w in zip(got, want, strict=False))
    if not same:
        raise ConfigError(
            f"{type(model).__name__} cannot be cut eagerly at these split points: its stages "
            "run in turn do not give the model's output (its forward must pass one hidden "
            "state from block to block, and a later stage's input must enter through the "
            "first module it calls); give the model as an nn.Sequential of its layers instead")
