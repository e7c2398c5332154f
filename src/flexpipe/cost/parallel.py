"""Costs of tensor parallelism (tp) and data parallelism (dp, plain or sharded) around a
pipeline stage: the one home of these formulas (the planner's ``flexpipe.plan.parallel3d``
applies them per layer).

Collectives are ring collectives on the group's slowest link (bandwidth term only: the messages
here are megabytes to gigabytes, so the per-step latency is under a percent):

- all-reduce of ``n`` bytes over ``k`` ranks: ``2 (k - 1) / k * n / bandwidth``;
- all-gather (each rank ends with all ``n`` bytes) and reduce-scatter (each rank ends with its
  ``n / k``): ``(k - 1) / k * n / bandwidth``.

Tensor parallelism, Megatron-LM style (Shoeybi et al. 2019; Narayanan et al. 2021, "Efficient
large-scale language model training on GPU clusters using Megatron-LM", SC'21, section 2.3):
each transformer layer's attention and MLP are split column- then row-wise over ``tp`` ranks,
so its FLOPs and parameters divide by ``tp``, and each layer does 2 all-reduces of its output
(``2 s b h`` bytes, the layer's ``out_bytes``) in the forward and 2 in the backward (the
``f``/``g`` conjugate operators). Activations (Korthikanti et al. 2022, "Reducing activation
recomputation in large transformer models", without sequence parallelism): of the
``s b (34 h + 5 a s)`` bytes, ``10 s b h`` (layer-norm inputs, dropout masks, the residual:
5 x the ``2 s b h`` output) stay replicated and the rest divides by ``tp``; of what W reads
(``32 s b h``), the two layer-norm outputs feeding the column-parallel products (2 x the
output) stay replicated.

Data parallelism over ``dp`` replicas (Rajbhandari et al. 2020, "ZeRO: memory optimizations
toward training trillion parameter models", SC'20, section 7): plain data parallelism keeps
every replica's full static memory and all-reduces the gradients once per step (volume 2 Psi);
ZeRO-3 / FSDP shards weights, gradients and optimizer state over the ``dp`` ranks, all-gathers
the stage's weights before its forward and again before its backward and reduce-scatters its
gradients (volume 3 Psi: 1.5x plain data parallelism), and holds the stage's gathered weights
while it computes. Static memory is counted as mixed-precision Adam's 16 bytes per parameter,
of which the fp16 weights are 2 and the fp16 gradients 2.
"""

from __future__ import annotations

STATIC_BYTES_PER_PARAM = 16  # fp16 weights + fp16 gradients + fp32 master weights and Adam state
WEIGHT_SHARE = 2 / STATIC_BYTES_PER_PARAM  # fp16 weights in the static bytes
GRAD_SHARE = 2 / STATIC_BYTES_PER_PARAM  # fp16 gradients in the static bytes
TP_ALL_REDUCES = 2  # per transformer layer, in each of the forward and the backward
TP_REPLICATED_ACT = 5.0  # activation kept whole on every tp rank, in output sizes (10 s b h)
TP_REPLICATED_WACT = 2.0  # weight-gradient inputs kept whole, in output sizes (4 s b h)
FSDP_GATHERS = 2  # all-gathers of a stage's weights per step: before F and before B


def ring_all_reduce(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``ranks`` ranks:
    ``2 (k - 1) / k * nbytes / bandwidth`` (0 for one rank)."""
    return 2.0 * ring_gather(nbytes, ranks, bandwidth)


def ring_gather(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Time of a ring all-gather or reduce-scatter whose whole buffer is ``nbytes``:
    ``(k - 1) / k * nbytes / bandwidth`` (0 for one rank)."""
    if ranks <= 1 or nbytes == 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth


def tp_times(f: float, b: float, w: float, out_bytes: float, tp: int,
             bandwidth: float) -> tuple[float, float, float]:
    """(F, B, W) of one layer split over ``tp`` ranks (Megatron-LM): compute divided by ``tp``;
    F and B each add ``TP_ALL_REDUCES`` all-reduces of the layer's output over the tp group's
    ``bandwidth``; W needs none. ``tp = 1`` returns the times unchanged."""
    if tp == 1:
        return f, b, w
    comm = TP_ALL_REDUCES * ring_all_reduce(out_bytes, tp, bandwidth)
    return f / tp + comm, b / tp + comm, w / tp


def tp_comm(out_bytes: float, tp: int, bandwidth: float) -> float:
    """Time of one layer's tensor-parallel all-reduces in F and B together (one sample)."""
    return 2 * TP_ALL_REDUCES * ring_all_reduce(out_bytes, tp, bandwidth)


def tp_memory(act: float, wact: float, params: float, out_bytes: float,
              tp: int) -> tuple[float, float, float]:
    """(act, wact, params) of one layer on one of ``tp`` ranks: parameters divide by ``tp``;
    activations keep their replicated part (``TP_REPLICATED_ACT`` / ``TP_REPLICATED_WACT``
    output sizes, at most the whole) and divide the rest (Korthikanti et al. 2022)."""
    if tp == 1:
        return act, wact, params
    return (_split(act, TP_REPLICATED_ACT * out_bytes, tp),
            _split(wact, TP_REPLICATED_WACT * out_bytes, tp), params / tp)


def _split(total: float, replicated: float, tp: int) -> float:
    kept = min(total, replicated)
    return kept + (total - kept) / tp


def dp_static(params: float, dp: int, sharded: bool) -> float:
    """Static bytes one of ``dp`` replicas holds for ``params`` static bytes: all of them with
    plain data parallelism; with ZeRO-3 / FSDP its ``1 / dp`` shard plus the gathered fp16
    weights it computes with."""
    if not sharded or dp == 1:
        return params
    return params / dp + WEIGHT_SHARE * params


def dp_step_time(params: float, dp: int, bandwidth: float, sharded: bool) -> float:
    """Data-parallel communication of one step for a rank holding ``params`` static bytes:
    plain, one all-reduce of the fp16 gradients; ZeRO-3 / FSDP, ``FSDP_GATHERS`` all-gathers of
    the fp16 weights and one reduce-scatter of the gradients (0 for one replica)."""
    if dp == 1:
        return 0.0
    if not sharded:
        return ring_all_reduce(GRAD_SHARE * params, dp, bandwidth)
    return (FSDP_GATHERS * ring_gather(WEIGHT_SHARE * params, dp, bandwidth)
            + ring_gather(GRAD_SHARE * params, dp, bandwidth))
