"""Python's cyclic garbage collector kept out of the pipeline's steps.

A full collection walks every Python object, and a model exported by torch.export brings
hundreds of thousands of them: on the CPU one took 225 ms in the middle of a 20 ms forward
(an exported Llama under ZB-V, where it stalled every rank waiting on that one). As
torchtitan and Megatron do, the automatic collector is paused while a step runs, and the
training loop collects between steps: the young generations every step (cheap), everything
every ``FULL_EVERY`` steps, so no garbage cycle outlives that.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

FULL_EVERY = 50
"""Steps between full collections (torchtitan's default ``gc_freq``)."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within: no automatic collection (the collector's state is restored after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def collect_after(step: int) -> None:
    """Between steps: the young generations, and every ``FULL_EVERY``-th step everything."""
    gc.collect(2 if (step + 1) % FULL_EVERY == 0 else 1)
