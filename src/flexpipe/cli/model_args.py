"""``flexpipe run``'s argparse types of the model and its cut: the seed, the model (a built-in
name or ``package.module:function``), the partition (``auto``, ``params`` or layer counts per
stage) and split points (``layers.N``), and the layer counts split points give."""

from __future__ import annotations

import argparse

from flexpipe.errors import ConfigError

SEED_MAX = 2**62
"""The largest seed (the data generator adds the step and micro-batch to it in 64 bits)."""


def seed_arg(text: str) -> int:
    """argparse type: a whole number from 0 to ``SEED_MAX``."""
    try:
        value = int(text) if text.strip().isascii() and len(text.strip()) <= 30 else None
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2**62, got "
                                         f"{text!r}")
    return value


def model_arg(text: str) -> str:
    """argparse type: a built-in model name or ``package.module:function``."""
    name = text.strip()
    if name in ("gpt", "mlp", "moe", "clip"):
        return name
    mod, _, fn = name.partition(":")
    if not (mod and fn.isidentifier() and all(p.isidentifier() for p in mod.split("."))):
        raise argparse.ArgumentTypeError(f"expected gpt, mlp, moe, clip or package.module:"
                                         "function, "
                                         f"got {text!r}")
    return name


def partition_arg(text: str) -> str | tuple[int, ...]:
    """argparse type: ``auto`` (counted FLOPs), ``params`` or positive layer counts per
    stage, e.g. ``3,2,2,3``."""
    if text.strip().lower() in ("auto", "params"):
        return text.strip().lower()
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or positive layer counts per stage "
                                         f"like 3,2,2,3, got {text!r}")
    return counts


def split_points_arg(text: str) -> tuple[int, ...]:
    """argparse type: ``layers.N`` names (or bare block numbers) in increasing order."""
    points = []
    for part in text.split(","):
        name = part.strip().strip("'\"")
        digits = name.rsplit(".", 1)[-1]
        if not digits.isdigit() or (name != digits and not name.startswith("layers.")):
            raise argparse.ArgumentTypeError(f"expected split points like layers.2,layers.4, "
                                             f"got {part.strip()!r}")
        points.append(int(digits))
    if points != sorted(set(points)) or points[0] < 1:
        raise argparse.ArgumentTypeError(f"split points must increase and start after block 0, "
                                         f"got {text!r}")
    return tuple(points)


def split_partition(points: tuple[int, ...], blocks: int, stages: int) -> tuple[int, ...]:
    """Layers per stage (embedding, blocks, head) from split points: block ``k`` starts a
    stage."""
    if len(points) != stages - 1:
        raise ConfigError(f"{len(points)} split points make {len(points) + 1} stages; the "
                          f"schedule has {stages}")
    if points[-1] >= blocks:
        raise ConfigError(f"split point layers.{points[-1]} is past the last block "
                          f"(the model has {blocks} blocks: layers.0 to layers.{blocks - 1})")
    cuts = [0, *(k + 1 for k in points), blocks + 2]
    return tuple(b - a for a, b in zip(cuts, cuts[1:], strict=False))
