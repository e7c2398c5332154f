"""The host memory allocator of FlexPipe's own rank processes.

glibc's ``malloc`` hands large freed buffers back to the system and maps them again at a later
allocation, so a CPU step whose tensors are a few hundred kilobytes pays a page fault for every
4 KiB it touches again. The B/W split pays more of them than a fused backward (W's products are
made apart from B's buffers): ``benchmarks/bw_split.py --allocator system`` shows the cost at
small widths, ``tests/runtime/test_allocator.py`` counts the faults. ``keep_freed_memory``
tells glibc to keep what is freed for reuse instead, as a GPU's caching allocator does and as
PyTorch's CPU tuning guide obtains with jemalloc or tcmalloc. Called in the processes FlexPipe
starts (the local launcher's ranks, a torchrun rank running ``flexpipe run``), never in a
user's own process; ``FLEXPIPE_SYSTEM_MALLOC=1`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_BELOW = 32 << 20
"""Bytes: buffers below this come from (and return to) the heap (glibc's largest setting)."""
TRIM_ABOVE = 1 << 30
"""Bytes: the heap is given back to the system only when this much lies free at its top."""
OFF_ENV = "FLEXPIPE_SYSTEM_MALLOC"


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring); False where the C
    library is not glibc or ``$FLEXPIPE_SYSTEM_MALLOC`` is set to 1."""
    if os.environ.get(OFF_ENV) == "1":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to set
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                      TRIM_ABOVE))
