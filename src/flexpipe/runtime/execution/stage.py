"""Stages built from a model given as a sequence of layers and a partition (layers per stage).

A layer takes the tensors the previous one returned (a tuple is spread over its arguments) and
returns a tensor or a tuple of tensors; a stage boundary may therefore carry several tensors of
any shape and dtype. The first stage takes the inputs, the last one's output goes to the loss.

A model that is not a chain is a list of ``Segment``s (towers, branches, a head), each a
sequence of layers fed by the batch inputs or by other segments' outputs;
``flexpipe.runtime.execution.segments`` cuts it into stages and their ``StageGraph``. A chain is the
one-segment case: ``segments.build_stages`` is that case of ``build_graph_stages``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flexpipe.cost.partition import sizes, uniform_cuts
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.rng import layer_seed, seeded

Tensors = tuple[torch.Tensor, ...]
LossFn = Callable[..., torch.Tensor]
"""``loss_fn(*outputs, target)``: the mean loss of one micro-batch."""
Batch = list[tuple[Tensors, torch.Tensor]]
"""A step's micro-batches, one ``(inputs, target)`` each."""
IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"
"""What autograd says when an operation writes into a leaf that requires a gradient."""
Route = tuple[tuple[int, bool], ...]
"""What one consumer stage reads of a stage's outputs: (output index, whether a gradient comes
back for it), in the order the consumer takes them."""


def as_tuple(x: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    """A layer's result as a tuple of tensors."""
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


@dataclass(frozen=True)
class Tie:
    """One parameter object used by several stages (tied weights: an input embedding and the
    output head, an encoder and a decoder sharing one embedding): ``uses`` gives, per stage,
    the parameter's name inside that stage's ``StageModule``; ``name`` the first of them in
    model terms (for messages)."""

    name: str
    uses: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages that use the parameter."""
        return tuple(s for s, _ in self.uses)


class StageModule(nn.Module):
    """Consecutive layers ``first .. first + len(layers) - 1`` of the model."""

    def __init__(self, layers: Sequence[nn.Module], first: int, prefix: str = "",
                 feeds: tuple[int, ...] | None = None, ties: tuple[Tie, ...] = ()) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.prefix = prefix
        """Start of its parameters' global names (the segment's name and a dot, or "")."""
        self.feeds = feeds
        """On a source stage: which batch inputs it reads (None: all, in order)."""
        self.ties = ties
        """Every tied parameter of the whole model (``Tie``: used by several
        stages), the same on every stage: the worker keeps each one's copies in step."""
        self.routes: dict[int, Route] = {}
        """Per consumer stage that reads only some outputs (a traced model's skip edges), what
        it reads; a consumer not here reads every output and returns a gradient for each float
        one."""
        self.copies_inputs = False
        """Whether the layers get copies of the inputs (they write into one in place)."""
        self.ran = False
        """Whether a forward that builds a graph on its inputs has run through (they need no
        copy)."""
        self.grad_inputs: tuple[bool, ...] | None = None
        """Per input, whether its gradient flows back to its producer (None: every float
        input's; a traced model's rotary tables and masks depend on no parameter)."""

    def forward(self, *inputs: torch.Tensor) -> Tensors:  # type: ignore[override]
        """Run the layers in turn (each with its own seed inside ``rng.drawing``). A stage
        whose layers write into an input in place (an ``nn.ReLU(inplace=True)`` first) gets
        copies of its inputs: its inputs are leaves of its graph, which autograd keeps from
        being overwritten; the stage finds out on its first forward (``copies_inputs``), and
        what that failed forward printed (torch.fx prints the failing line of a traced
        graph to stderr) is dropped, since the run with copies succeeds."""
        if self.copies_inputs:
            return self._run(tuple(t.clone() if t.requires_grad else t for t in inputs))
        if self.ran:
            return self._run(tuple(inputs))
        buffers = [(b, b.clone()) for b in self.buffers()]  # put back if it runs again
        said = io.StringIO()  # what the first run prints: shown unless it is run again
        try:
            with contextlib.redirect_stderr(said):
                out = self._run(tuple(inputs))
        except RuntimeError as exc:
            if IN_PLACE_ON_LEAF not in str(exc):
                sys.stderr.write(said.getvalue())
                raise
            for b, kept in buffers:  # a BatchNorm before the in-place op counted this batch
                b.copy_(kept)
            self.copies_inputs = True
            return self.forward(*inputs)  # torch.fx's report of the failed run is dropped
        except BaseException:
            sys.stderr.write(said.getvalue())
            raise
        sys.stderr.write(said.getvalue())
        self.ran = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        return out

    def _run(self, inputs: Tensors) -> Tensors:
        x: Tensors = inputs
        for i, layer in enumerate(self.layers):
            seed = layer_seed(f"{self.prefix}{self.first + i}")
            if seed is None:
                x = as_tuple(layer(*x))
                continue
            with seeded(seed, x[0].device if x else torch.device("cpu")):
                x = as_tuple(layer(*x))
        return x

    def named_global_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters named by their layer index in the whole model (or segment, after its
        name), e.g. ``3.qkv.weight`` or ``text.3.qkv.weight``."""
        return {f"{self.prefix}{self.first + int(name.split('.')[1])}.{name.split('.', 2)[2]}": p
                for name, p in self.named_parameters()}

    def handed(self, consumer: int, outputs: Tensors) -> Tensors:
        """The outputs ``consumer`` reads (every one unless routed). A value routed without a
        gradient that requires one would lose it: refused (the cut misjudged it)."""
        route = self.routes.get(consumer)
        if route is None:
            return outputs
        lost = [i for i, back in route if not back and outputs[i].requires_grad]
        if lost:
            raise ConfigError(f"stage of layers {self.prefix}{self.first}..: output {lost[0]} "
                              f"needs a gradient, but stage {consumer} was cut to return none")
        return tuple(outputs[i] for i, _ in route)

    def returned(self, consumer: int, outputs: Tensors) -> list[int]:
        """The outputs whose gradients ``consumer`` sends back, in its order."""
        route = self.routes.get(consumer)
        pairs = route if route is not None else tuple((i, True) for i in range(len(outputs)))
        return [i for i, back in pairs if back and outputs[i].is_floating_point()]

    def leaves(self, inputs: Sequence[torch.Tensor], source: bool = False) -> Tensors:
        """``inputs`` as leaves of this stage's graph: those whose gradient flows back require
        one (float ones, unless ``grad_inputs`` says otherwise; none on a ``source`` stage,
        which reads batch data)."""
        flags = self.grad_inputs or (True,) * len(inputs)
        if len(flags) != len(inputs):
            raise ConfigError(f"stage of layers {self.prefix}{self.first}.. takes {len(flags)} "
                              f"inputs, got {len(inputs)}")
        return tuple(t.detach().requires_grad_(t.is_floating_point() and flag and not source)
                     for t, flag in zip(inputs, flags, strict=True))

    def pick_inputs(self, inputs: Sequence[torch.Tensor]) -> Tensors:
        """The batch inputs this (source) stage reads."""
        if self.feeds is None:
            return tuple(inputs)
        bad = [i for i in self.feeds if not 0 <= i < len(inputs)]
        if bad:
            raise ConfigError(f"stage of layers {self.prefix}{self.first}.. reads batch inputs "
                              f"{list(self.feeds)}, but a sample has only {len(inputs)}")
        return tuple(inputs[i] for i in self.feeds)


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages get the extra layers)."""
    if num_layers < num_stages:
        raise ConfigError(f"the model has {num_layers} layers, fewer than the {num_stages} "
                          f"stages of the schedule; use a deeper model or fewer stages")
    return sizes(uniform_cuts(num_layers, num_stages))
