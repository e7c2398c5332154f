"""The memory a model will take, estimated from its shapes before anything is allocated, so a
run too big for the machine is refused before it starts (``flexpipe run``'s size guard):

- built-in models (``gpt``, ``mlp``, ``clip``): parameters counted from the spec's sizes with
  each model's layer formulas (``PARAMS``; within a few parameters of the built model, checked
  in the tests), activations as one micro-batch's saved tensors per layer (``ACTS``);
- your own model (``user``): its factory is called under torch's ``meta`` device, which gives
  every parameter's shape and allocates nothing.

Static memory = parameters x (weight + gradient + optimizer states) x dtype bytes; the
activations count once per micro-batch in flight (at most the stage count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flexpipe.runtime.processes.ckdir import state_copies

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


@dataclass(frozen=True)
class Estimate:
    """The model's parameter count and the bytes training it takes on all ranks together."""

    params: int
    static_bytes: int
    """Weights, gradients and optimizer state."""
    activation_bytes: int
    """Saved activations of the micro-batches in flight."""

    @property
    def total(self) -> int:
        """Static plus activation bytes."""
        return self.static_bytes + self.activation_bytes


def _gpt_params(spec: object) -> int:
    h, v, s, n = _dims(spec)
    return v * h + s * h + n * (12 * h * h + 13 * h) + 2 * h + h * v


def _mlp_params(spec: object) -> int:
    h, v, _, n = _dims(spec)
    return (2 * h * h + 2 * h) + n * (6 * h * h + 3 * h) + (3 * h * v + v + 8 * v)


def _clip_params(spec: object) -> int:
    from flexpipe.runtime.models.zoo import IMAGE

    h, v, s, n = _dims(spec)
    image = IMAGE[0] * 16 * h + h + n * (4 * h * h + 5 * h) + 2 * h
    text = v * h + s * h + n * (12 * h * h + 13 * h) + 2 * h
    return image + text + 2 * (h * h + h) + 1


def _gpt_acts(spec: object) -> int:
    h, v, s, n = _dims(spec)
    b, heads = int(getattr(spec, "micro_batch", 1)), int(getattr(spec, "heads", 1))
    return b * s * (n * (16 * h + 2 * heads * s) + 3 * v)


def _mlp_acts(spec: object) -> int:
    h, v, _, n = _dims(spec)
    return int(getattr(spec, "micro_batch", 1)) * (n * 10 * h + 3 * v)


def _dims(spec: object) -> tuple[int, int, int, int]:
    """(hidden, vocab, seq, layers) of ``spec``."""
    return tuple(int(getattr(spec, k, 1)) for k in ("hidden", "vocab", "seq", "layers"))  # type: ignore[return-value]


PARAMS: dict[str, Callable[[object], int]] = {"gpt": _gpt_params, "mlp": _mlp_params,
                                              "clip": _clip_params}
ACTS: dict[str, Callable[[object], int]] = {"gpt": _gpt_acts, "mlp": _mlp_acts,
                                            "clip": lambda spec: 2 * _gpt_acts(spec)}


def factory_params(load: Callable[[], object]) -> int | None:
    """Parameters of the model ``load()`` builds, built on the ``meta`` device (no memory);
    None when the factory cannot run there."""
    try:
        with torch.device("meta"):
            user = load()
    except Exception:  # noqa: BLE001 - a factory that needs real tensors: no estimate
        return None
    module: Any = getattr(user, "module", user)
    modules = module if isinstance(module, list | tuple) else [module]
    try:
        return sum(p.numel() for m in modules for p in m.parameters())
    except (AttributeError, TypeError):
        return None


def estimate(spec: object, in_flight: int, optimizer: str,
             params: int | None = None) -> Estimate | None:
    """The memory of training ``spec`` (a ``ModelSpec``) with ``in_flight`` micro-batches'
    activations held and ``optimizer``'s state; ``params`` when already counted (a user
    model). None when it cannot be estimated."""
    name = str(getattr(spec, "name", ""))
    nbytes = DTYPE_BYTES.get(str(getattr(spec, "dtype", "float32")), 4)
    count = params if params is not None else PARAMS[name](spec) if name in PARAMS else None
    if count is None:
        return None
    acts = ACTS[name](spec) * max(1, in_flight) * nbytes if name in ACTS else 0
    static = count * nbytes * (2 + state_copies(optimizer))
    return Estimate(count, static, acts)
