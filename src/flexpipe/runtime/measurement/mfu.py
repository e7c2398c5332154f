"""Model FLOPs utilisation (MFU) of ``flexpipe run``: the model's counted floating-point
operations of a step (forward and backward of every micro-batch of every replica, counted by
``torch.utils.flop_counter`` layer by layer on the ``meta`` device: nothing is computed or
allocated) over the step time and the peak FLOP/s of the devices the run holds. A device's peak
is ``--peak-flops``, else a table of known GPUs' dense bf16 peaks (by name), else for the CPU a
measured rate: the best of a few float32 matrix products with the rank's thread count."""

from __future__ import annotations

import time

import torch

from flexpipe.runtime.measurement.balance import layer_flops
from flexpipe.runtime.models.kinds import build_model, make_batch
from flexpipe.runtime.models.spec import ModelSpec

GPU_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L4", 121e12), ("A10", 125e12), ("MI300X", 1307e12), ("MI250X", 383e12),
)
"""Dense bf16 peak FLOP/s by (a part of) the device name, the first match winning."""


def step_flops(spec: ModelSpec, microbatches: int, replicas: int) -> float | None:
    """The counted forward + backward FLOPs of one step of the built-in ``spec`` (None: a
    model that is not a chain of built-in layers)."""
    if spec.name not in ("gpt", "mlp"):
        return None
    with torch.device("meta"):
        layers = build_model(spec)[0]
    inputs = [t.to("meta") for t in make_batch(spec, 0, 1)[0][0]]
    return sum(layer_flops(layers, inputs)) * microbatches * replicas


def gpu_peak(name: str) -> float | None:
    """The table's peak for a GPU named ``name`` (None: not in the table)."""
    return next((peak for key, peak in GPU_PEAKS if key.lower() in name.lower()), None)


def cpu_peak(threads: int, size: int = 512, tries: int = 5) -> float:
    """This process's measured float32 matmul FLOP/s with ``threads`` threads (the best of
    ``tries`` products of two ``size`` x ``size`` matrices)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm up
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2.0 * size**3 / max(best, 1e-9)


def device_peak(given: float | None, backend: str, threads: int) -> tuple[float | None, str]:
    """One device's peak FLOP/s and where it comes from (``--peak-flops``, the GPU table, or
    ``measured``); None when a GPU is not in the table."""
    if given is not None:
        return given, "--peak-flops"
    if backend == "nccl" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return gpu_peak(name), f"table ({name})"
    return cpu_peak(threads), "measured CPU matmul"
