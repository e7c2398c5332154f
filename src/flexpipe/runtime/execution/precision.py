"""Mixed precision, as torchtitan, Megatron-LM and DeepSpeed train large models: float32
master weights (what the optimizer steps and its state), every pass computed on bfloat16 copies
of them, each micro-batch's bfloat16 gradient added into the masters' float32 gradient, and the
data-parallel reduction in float32.

A policy (``MixedPrecision``) names three dtypes, as FSDP2's ``MixedPrecisionPolicy`` does: the
parameters' compute dtype, the dtype gradients are reduced in, and the dtype of the model's
outputs (what the loss reads and ``eval`` returns). ``policy("bf16")`` is bfloat16 compute with
float32 reduction and outputs.

Where a stage is sharded by FSDP2 (``engines.Sharded``) the policy becomes torch's
``MixedPrecisionPolicy``: FSDP2 all-gathers bfloat16 parameters and reduce-scatters in float32.
Elsewhere ``Casting`` gives the same semantics: at the start of a step every float32 parameter
of this rank's unsharded stages computes with a bfloat16 copy of its value (cast into one
storage kept for the run: one cast per step, after the optimizer's update, as FSDP2 casts once
per all-gather), the float32 value and gradient are put aside, and they come back at the
step's end. Not ``torch.autocast``: autocast casts per
op (LayerNorm, softmax and additions stay float32 on the CPU) and again at every use, which is
neither FSDP2's arithmetic nor its memory.

Accumulation is hooked on the executor's dispatch table (``Casting.wrap``): after every op of
a stage, whatever bfloat16 gradient its parameters hold (autograd's in B or BW, or the B/W
split's W, which adds into ``param.grad``) is added into the
float32 gradient and cleared. An op is one micro-batch, so each micro-batch's gradient is
rounded to bfloat16 once and summed in float32, as FSDP2 accumulates an unsharded gradient
between reduce-scatters (``Sharded.accumulate`` does the same for a sharded stage). The
parameters FSDP2 leaves alone in a sharded stage (the experts under expert parallelism:
``engines.Sharded.ignored``) are cast and accumulated here, as an unsharded stage's.

Under expert parallelism the experts take the same path: their compute copies run on the
tokens every ``ep`` rank sent them (bfloat16 on the all-to-all), each micro-batch's bfloat16
gradient (of every ``ep`` rank's tokens of that micro-batch) is added into float32, and their
reduction over the ``dp`` replicas runs in the policy's reduce dtype
(``worker.RankWorker._reduce_experts``).

Every stage casts its floating inputs to the compute dtype (FSDP2's ``cast_forward_inputs``);
a sink stage casts its outputs to the output dtype, so the loss is computed in float32. Stage
boundaries therefore carry bfloat16 activations and gradients (half the bytes on the wire).
Buffers (BatchNorm's running statistics) keep their dtype, as under FSDP2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import fsdp_mixed_precision, policy_dtypes

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
})
"""The dtypes a policy takes, by the names torchtitan's job files and the CLI use."""


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy: ``param_dtype`` the dtype every pass computes in (the
    parameters' copies, the stage boundaries), ``reduce_dtype`` the dtype gradients are
    reduced over data-parallel replicas in, ``output_dtype`` the dtype of the model's outputs
    (the loss's input). Master weights, their gradients and the optimizer state stay float32."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        """Refuse a dtype the policy does not take, naming the field."""
        allowed = set(DTYPES.values())
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"mixed precision: {name} {value} is not bfloat16 or "
                                  "float32 (float16 would need loss scaling, which FlexPipe "
                                  "does not do)")

    def fsdp_policy(self) -> Any:
        """torch's FSDP2 ``MixedPrecisionPolicy`` of the same semantics (the outputs are cast
        by the sink stage, as on unsharded stages)."""
        return fsdp_mixed_precision(self.param_dtype, self.reduce_dtype)


BF16 = MixedPrecision()
"""``"bf16"``: bfloat16 compute, float32 masters, gradients, reduction and outputs."""


def dtype_named(text: str, where: str) -> torch.dtype:
    """The dtype called ``text`` (``bfloat16``/``bf16``, ``float32``/``fp32``)."""
    dtype = DTYPES.get(str(text).strip().lower())
    if dtype is None:
        raise ConfigError(f"{where}: {text!r} is not a dtype mixed precision takes "
                          f"({', '.join(DTYPES)})")
    return dtype


def policy(value: Any) -> MixedPrecision | None:
    """The policy ``value`` names: None, ``"no"``, ``"fp32"`` or ``"float32"`` (none: train in
    the model's dtype), ``"bf16"``/``"bfloat16"``, a ``MixedPrecision``, torch's
    ``MixedPrecisionPolicy`` (an unset dtype: float32), or a mapping with keys ``param``,
    ``reduce``, ``output`` (dtype names; a missing one: ``"bf16"``'s). A policy computing in
    float32 is none."""
    if value is None or isinstance(value, MixedPrecision):
        chosen = value
    elif isinstance(value, str):
        key = value.strip().lower()
        chosen = None if key in ("no", "none") else \
            MixedPrecision(param_dtype=dtype_named(key, "mixed precision"))
    elif policy_dtypes(value) is not None:
        chosen = MixedPrecision(*(d or torch.float32 for d in policy_dtypes(value) or ()))
    elif isinstance(value, Mapping):
        chosen = _from_mapping(value)
    else:
        raise ConfigError(f"mixed_precision must be 'bf16', 'fp32', a MixedPrecision or a "
                          f"mapping of dtypes, got {type(value).__name__}")
    if chosen is not None and chosen == MixedPrecision(torch.float32, torch.float32):
        return None
    return chosen


def _from_mapping(value: Mapping[str, Any]) -> MixedPrecision:
    """A policy from ``{"param": ..., "reduce": ..., "output": ...}``."""
    bad = sorted(set(value) - {"param", "reduce", "output"})
    if bad:
        raise ConfigError(f"mixed precision: unknown key(s) {bad} (param, reduce, output)")
    pick = {k: dtype_named(v, f"mixed precision {k}") for k, v in value.items()}
    return MixedPrecision(pick.get("param", BF16.param_dtype),
                          pick.get("reduce", BF16.reduce_dtype),
                          pick.get("output", BF16.output_dtype))


class Casting:
    """One rank's compute copies under ``policy``: the unsharded stages' parameters are cast
    for a step (``computing``), their gradients added into the float32 ones after every op
    (``wrap``); sharded stages (``shards``) accumulate through FSDP2."""

    def __init__(self, policy: MixedPrecision, stages: Mapping[int, torch.nn.Module],
                 shards: Mapping[int, Any], sinks: Sequence[int]) -> None:
        self.policy = policy
        self.shards = dict(shards)
        self.stage_params = {s: [p for p in _cast_here(m, self.shards.get(s))
                                 if p.is_floating_point()] for s, m in stages.items()}
        self.params = list({id(p): p for ps in self.stage_params.values() for p in ps}.values())
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        """Per parameter (by id) during a step: its float32 value and gradient."""
        self.copies = {id(p): torch.empty_like(p.data, dtype=policy.param_dtype)
                       for p in self.params}
        """Per parameter (by id): its compute copy, one storage for the whole run (a meter
        of activations leaves it out, as it leaves out the parameters)."""
        cast_boundaries(stages, policy, sinks)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """A step on the compute copies: cast on entry, the float32 values and gradients
        back on exit (also when the step fails)."""
        for p in self.params:
            self.kept[id(p)] = (p.data, p.grad)
            p.grad = None
            copy = self.copies[id(p)]
            copy.copy_(p.data)
            p.data = copy
        try:
            yield
        finally:
            for p in self.params:
                data, grad = self.kept.pop(id(p))
                p.grad = None
                p.data = data
                p.grad = grad

    def accumulate(self, stage: int) -> None:
        """Add the compute gradient ``stage``'s parameters hold into their float32 one."""
        shard = self.shards.get(stage)
        if shard is not None:
            shard.accumulate()
        for p in self.stage_params.get(stage, ()):
            grad = p.grad
            if grad is None:
                continue
            data, total = self.kept[id(p)]
            if total is None:
                total = grad.to(data.dtype)
            else:
                total.add_(grad)
            self.kept[id(p)] = (data, total)
            p.grad = None

    def wrap(self, handlers: Mapping[str, Any]) -> dict[str, Any]:
        """``handlers`` with every op followed by ``accumulate`` of its stage."""
        return {kind: _Accumulating(h, self) for kind, h in handlers.items()}


def _cast_here(module: torch.nn.Module, shard: Any) -> list[torch.Tensor]:
    """The parameters of a stage ``Casting`` casts itself: all of an unsharded one's, and of
    a sharded one (``shard``) those FSDP2 leaves alone (``engines.Sharded.ignored``: the
    experts of expert parallelism)."""
    return list(module.parameters()) if shard is None else list(shard.ignored)


def cast_boundaries(stages: Mapping[int, torch.nn.Module], policy: MixedPrecision,
                    sinks: Sequence[int]) -> None:
    """Every stage casts its floating inputs to the compute dtype, a sink stage its outputs
    to the output dtype (forward hooks, for good)."""
    def inputs(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return _cast(args, policy.param_dtype)  # type: ignore[no-any-return]

    def outputs(_module: torch.nn.Module, _args: Any, out: Any) -> Any:
        return _cast(out, policy.output_dtype)

    for s, m in stages.items():
        m.register_forward_pre_hook(inputs)
        if s in sinks:
            m.register_forward_hook(outputs)


def measured_as_run(stages: Mapping[int, torch.nn.Module], policy: MixedPrecision | None,
                    sinks: Sequence[int]) -> None:
    """Make ``stages`` (built to be measured, not trained) compute as a run under ``policy``
    does: parameters in the compute dtype, boundaries cast (``cast_boundaries``); nothing
    without a policy."""
    if policy is None:
        return
    for m in stages.values():
        m.to(policy.param_dtype)
    cast_boundaries(stages, policy, sinks)


def static_bytes(param_bytes: float, copies: int, policy: MixedPrecision | None) -> float:
    """A stage's static memory from its parameters' bytes as measured (``measured_as_run``)
    and the ``copies`` a float32 parameter takes (weight, gradient, optimizer state): without
    a policy those copies; with one, the compute copy plus the float32 masters' copies."""
    if policy is None:
        return param_bytes * copies
    per = torch.finfo(torch.float32).bits / torch.finfo(policy.param_dtype).bits
    return param_bytes * (1 + per * copies)


class _Accumulating:
    """An op handler followed by the accumulation of its stage's compute gradient."""

    def __init__(self, handler: Any, casting: Casting) -> None:
        self.handler, self.casting = handler, casting

    def __call__(self, ex: Any, op: Op) -> None:
        self.handler(ex, op)
        self.casting.accumulate(op.stage)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (a tensor or a tuple of them) with its floating tensors in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def check_masters(stages: Mapping[int, torch.nn.Module], where: str) -> None:
    """Mixed precision keeps float32 master weights: refuse a model built in another dtype,
    naming the first such parameter."""
    for s, m in sorted(stages.items()):
        for name, p in m.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ConfigError(f"{where}: mixed precision keeps float32 master weights, "
                                  f"but stage {s}'s parameter {name} is {p.dtype}; build the "
                                  "model in float32")


def reduce_mean(grads: Sequence[torch.Tensor], group: object, size: int,
                dtype: torch.dtype | None) -> None:
    """Average ``grads`` in place over the data-parallel ``group`` in ``dtype`` (None: their
    own), as FSDP2 reduces in its policy's ``reduce_dtype``."""
    if dtype is None or size == 1 or all(g.dtype == dtype for g in grads):
        comm.all_reduce_mean(grads, group, size)
        return
    low = [g.to(dtype) for g in grads]
    comm.all_reduce_mean(low, group, size)
    for g, reduced in zip(grads, low, strict=True):
        g.copy_(reduced)
