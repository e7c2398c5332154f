"""The eager path: a model cut into stages that run your own modules as they are, without
tracing, for a model torch.fx cannot trace nor torch.export export (data-dependent control
flow, a Hugging Face mixture of experts returning its router logits, ...).

``eager_stages(model, split_points, example)`` gives the model as a chain of stages (an
``EagerModel``, an ``nn.ModuleList`` with one entry per stage), which ``flexpipe.pipeline`` and
``UserModel`` cut one stage per entry. The split points name blocks of one ``nn.ModuleList``
(or ``nn.Sequential``) that the model's forward runs in turn (``"layers.2"``: block 2 starts
stage 1). Each stage is the model itself, copied shallowly (its modules and parameters are
the model's own objects, so tied weights stay one parameter, its gradient summed over the
stages that use it) with the modules other stages own replaced (``eager_cut``), and it runs
the model's own forward on the batch inputs, which every stage receives:

- stage 0 takes the batch inputs; a later stage takes what its predecessor handed it (the
  hidden state entering its first block, and that block's other inputs that depend on
  parameters) and then the batch inputs, and puts what it received back into the call of its
  first block, its embeddings replaced by stubs (their result is dropped there);
- the first block after the stage's own ends its forward: the inputs of that call are what it
  hands on, followed by the batch inputs;
- the last stage returns the model's output as tensors (a tuple's, dict's or
  ``ModelOutput``'s entries in order), for ``loss_fn(*outputs, target)``.

The forward may branch on values (``if h.mean() > 0``): nothing is traced. The cut holds for a
forward in which the blocks pass their state along through their inputs and results: every
cut is checked on the example before it is used (the stages in turn must give the model's
own output, in eval mode), and one that does not is refused by name. Random operations draw
from each rank's generator, not as one process would (the tests train without dropout).

``collect`` carries values the model gathers on the way (a mixture of experts' router logits,
for a loss over every layer's): the outputs of modules of a class, concatenated stage after
stage, as the last output of every stage (``hf_eager`` uses it). ``part_stages`` cuts one run
of a forward, for models run as several (``hf_seq2seq``: an encoder's, then a decoder's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flexpipe.errors import ConfigError
from flexpipe.runtime.user import eager_cut as cut
from flexpipe.runtime.user.interface import as_inputs

Finish = Callable[[Any, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
"""A part's last stage's model output and the batch inputs -> the tensors it returns."""


@dataclass(frozen=True)
class Collect:
    """Outputs to carry to the last stage: output ``index`` of every module of class
    ``kind`` (a tensor each, concatenated along dimension 0)."""

    kind: type[nn.Module]
    index: int = 0


@dataclass(frozen=True)
class Ends:
    """Where a stage starts and ends: the first block it owns, with the boundary of its
    inputs (None on a part's first stage, which takes the batch inputs), and the boundary it
    hands on (None on a part's last stage, which ``finish``es)."""

    entry: tuple[nn.Module, cut.Boundary] | None
    exit: cut.Boundary | None


class EagerStage(nn.Module):
    """Stage ``index`` of ``count``: the model with the modules of other stages replaced,
    run by ``call`` on the batch inputs."""

    def __init__(self, model: nn.Module, index: int, count: int, ends: Ends,
                 call: cut.Call, slot: cut.Slot, collect: Collect | None = None,
                 finish: Finish | None = None) -> None:
        super().__init__()
        self.model = model
        self.index, self.count, self.collect = index, count, collect
        self.ends, self.call, self.slot, self.finish = ends, call, slot, finish
        self.takes = 0 if ends.entry is None else len(ends.entry[1].keys)
        """How many inputs before the batch inputs the stage takes."""

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """(what the previous stage handed on, batch inputs, [collected]) -> (what this one
        hands on, batch inputs, [collected]) or, on a part's last stage, ``finish``'s."""
        got = list(xs)
        before = got.pop() if self.collect is not None and self.index else None
        held, batch = tuple(got[:self.takes]), tuple(got[self.takes:])
        found: list[torch.Tensor] = [] if before is None else [before]
        hooks = self._hooks(held, found)
        self.slot.value = held[0] if held else None
        try:
            out = self.call(self.model, batch)
        except cut.Exited as done:
            assert self.ends.exit is not None
            return (*self.ends.exit.take(done.call), *batch, *self._collected(found))
        finally:
            self.slot.value = None
            for h in hooks:
                h.remove()
        if self.ends.exit is not None:
            raise ConfigError(f"eager stage {self.index}: the forward returned before the "
                              f"next stage's first block {self.ends.exit.block!r} (is it a "
                              "block the forward calls?)")
        leaves = self.finish(out, batch) if self.finish is not None else leaves_of(out)
        return (*leaves, *self._collected(found))

    def _hooks(self, held: tuple[torch.Tensor, ...], found: list[torch.Tensor]
               ) -> list[Any]:
        hooks = [] if self.collect is None else [
            m.register_forward_hook(lambda _m, _a, out: found.append(_pick(out, self.collect)))
            for m in self.model.modules() if isinstance(m, self.collect.kind)]
        if self.ends.entry is not None:
            block, bound = self.ends.entry
            hooks.append(block.register_forward_pre_hook(
                lambda _m, args, kwargs: bound.put(args, kwargs, held), with_kwargs=True))
        return hooks

    def _collected(self, found: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.collect is None:
            return ()
        return (torch.cat(found) if found else torch.zeros(0),)


def _pick(out: Any, collect: Collect | None) -> torch.Tensor:
    assert collect is not None
    value = out[collect.index] if isinstance(out, tuple | list) else out
    return value.reshape(-1, value.shape[-1])


def leaves_of(out: Any) -> tuple[torch.Tensor, ...]:
    """A model's output as tensors: a tuple's, dict's or ``ModelOutput``'s, in order."""
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
    blocks, starts = find_blocks(model, split_points)
    stages = EagerModel(model)
    stages.extend(part_stages(model, blocks, starts, inputs, plain_call, (0, len(starts) + 1),
                              collect=collect, finish=finish))
    if check:
        check_stages(model, stages, inputs, lambda: _wanted(model, inputs, finish))
    return stages


def plain_call(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    """``model(*batch)``."""
    return model(*batch)


def _wanted(model: nn.Module, inputs: tuple[torch.Tensor, ...], finish: Finish | None
            ) -> tuple[torch.Tensor, ...]:
    out = model(*inputs)
    return finish(out, inputs) if finish is not None else leaves_of(out)


def part_stages(model: nn.Module, blocks: cut.Blocks, starts: Sequence[int],
                batch: tuple[torch.Tensor, ...], call: cut.Call, place: tuple[int, int],
                collect: Collect | None = None, finish: Finish | None = None
                ) -> list[EagerStage]:
    """The stages of one run of ``call(model, batch)`` cut at blocks ``starts`` of
    ``blocks``; ``place``: the index of its first stage in the chain and the chain's length.
    Its first stage takes ``batch``, its last returns ``finish``'s (else the output's
    tensors)."""
    seen = cut.watch(model, blocks, starts, call, batch)
    bounds = [0, *starts, len(blocks[1])]
    out = []
    for k in range(len(bounds) - 1):
        lo, hi, last = bounds[k], bounds[k + 1], k == len(bounds) - 2
        slot = cut.Slot()
        swap: dict[str, nn.Module] = {n: cut.Missing(n) for n in seen.unused}
        swap.update({n: cut.Stub(n, slot) for n in (seen.before if k else [])})
        swap.update({n: cut.Skip(n) for n in ([] if last else seen.after)})
        swap[blocks[0]] = cut.owned(blocks, lo, hi, seen.arity)
        ends = Ends(None if k == 0 else (blocks[1][lo], seen.bounds[lo]),
                    None if last else seen.bounds[hi])
        out.append(EagerStage(cut.swapped(model, swap), place[0] + k, place[1], ends, call,
                              slot, collect, finish))
    return out


def find_blocks(model: nn.Module, points: Sequence[str]) -> tuple[cut.Blocks, list[int]]:
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


def check_stages(model: nn.Module, stages: nn.ModuleList,
                 inputs: tuple[torch.Tensor, ...],
                 want: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    """Refuse a cut whose stages, run in turn on ``inputs`` (in eval mode, no gradients), do
    not give ``want()``, the model's own output."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            wanted = want()
            got: tuple[torch.Tensor, ...] = inputs
            for stage in stages:
                got = stage(*got)
    except cut.Exited as exc:
        raise ConfigError("eager stages: the forward calls a block outside its loop") from exc
    finally:
        for m, mode in modes:
            m.train(mode)
    last = stages[-1]
    if isinstance(last, EagerStage) and last.collect is not None:
        got = got[:-1]
    same = len(got) >= len(wanted) and all(
        g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6) if
        g.is_floating_point() else torch.equal(g, w) for g, w in zip(got, wanted, strict=False))
    if not same:
        raise ConfigError(
            f"{type(model).__name__} cannot be cut eagerly at these split points: its stages "
            "run in turn do not give the model's output (its blocks must pass their state "
            "along through their inputs and results, and a later stage's input must enter "
            "through the first block it owns); give the model as an nn.Sequential of its "
            "layers instead")
