"""The profiler times each pass with the CPU caches evicted (``runtime.measurement.caches``):
the cache size read from sysfs (or a fallback), a buffer twice that size written before every
timed pass on a CPU, nothing on other devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.runtime.measurement import caches, profile
from flexpipe.runtime.models.spec import ModelSpec

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def _sysfs(root: Path, sizes: dict[str, str]) -> Path:
    for index, size in sizes.items():
        (root / index).mkdir(parents=True)
        (root / index / "size").write_text(size + "\n")
    return root


def test_the_largest_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, {"index0": "48K", "index2": "2048K", "index3": "32M"})
    assert caches.largest_cache(root) == 32 << 20


def test_without_sysfs_the_fallback_is_assumed(tmp_path: Path) -> None:
    assert caches.largest_cache(tmp_path / "absent") == caches.FALLBACK
    root = _sysfs(tmp_path / "odd", {"index0": "lots"})
    assert caches.largest_cache(root) == caches.FALLBACK


@pytest.mark.parametrize(("text", "size"), [("512", 512), ("64K", 64 << 10), ("2m", 2 << 20),
                                            ("1G", 1 << 30), ("", 0), ("K", 0)])
def test_sysfs_sizes_parse(text: str, size: int) -> None:
    assert caches._size(text) == size


def test_a_cpu_evictor_writes_twice_the_cache_and_others_nothing() -> None:
    cpu = caches.Evictor(torch.device("cpu"), cache_bytes=1 << 20)
    assert cpu.buffer is not None and cpu.buffer.nbytes == 2 << 20
    cpu()
    assert float(cpu.buffer[0]) == 1.0 and float(cpu.buffer[-1]) == 1.0
    assert caches.Evictor(torch.device("meta")).buffer is None


def test_a_cold_round_evicts_before_every_timed_pass() -> None:
    """Four timed passes a cold round (F, B, W, BW): four evictions, each just before its pass;
    a hot round evicts nothing, and also times F right after its W and F of a fused micro-batch
    (``StageCost.after_w``, ``fused``)."""
    items, _, _ = profile._stages_of((TINY, Placement.linear(1), None), 0, torch.device("cpu"))
    events: list[str] = []
    clock = iter(range(1000))

    def now() -> float:
        events.append("clock")
        return float(next(clock))

    got = profile._round(items[0], now, lambda: events.append("evict"))
    assert set(got) == {"F", "B", "W", "BW"}
    assert events == ["evict", "clock", "clock"] * 4  # evicted, then the pass's two readings
    events.clear()
    got = profile._round(items[0], now)
    assert set(got) == {"F", "B", "W", "BW", profile.AFTER_W, profile.FUSED}
    assert events == ["clock", "clock"] * 6  # and the two forwards in their contexts


def test_the_profile_gives_cold_times_on_a_cpu() -> None:
    items, _, _ = profile._stages_of((TINY, Placement.vshape(1), None), 0, torch.device("cpu"))
    got = profile.time_stages(items, reps=1)
    assert len(got) == 2
    for stage in got:
        assert set(stage["cold"]) == {"F", "B", "W", "BW"}
        assert set(stage["after_w"]) == set(stage["fused"]) == {"F"}
        assert all(v > 0 for t in ("cold", "after_w", "fused") for v in stage[t].values())


def test_zeroing_the_gradients_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round zeroes the gradients after its last reading, outside every timed pass (inside
    BW it read Llama's BW 25 ms longer than B + W in a scratch build)."""
    items, _, _ = profile._stages_of((TINY, Placement.linear(1), None), 0, torch.device("cpu"))
    stage = items[0][0]
    events: list[str] = []
    real = stage.zero_grad

    def zero(*args: object, **kwargs: object) -> None:
        events.append("zero")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stage, "zero_grad", zero)

    def now() -> float:
        events.append("clock")
        return 0.0

    profile._round(items[0], now)
    assert events.count("zero") == 1 and events[-1] == "zero"


def test_a_stated_cache_size_is_evicted_and_a_bad_one_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``FLEXPIPE_CACHE_BYTES`` sets what an evictor writes (twice it); anything but one
    positive size is refused naming the variable."""
    monkeypatch.setenv(caches.CACHE_ENV, "2MiB")
    assert caches.Evictor(torch.device("cpu")).buffer.numel() * 4 == 4 << 20
    assert caches.Evictor(torch.device("cpu"), cache_bytes=1 << 20).buffer.numel() * 4 == 2 << 20
    for bad in ("8", "lots", "1MiB,2MiB", "0B"):
        monkeypatch.setenv(caches.CACHE_ENV, bad)
        with pytest.raises(ConfigError, match=f"FLEXPIPE_CACHE_BYTES={bad!r}: expected one size"):
            caches.Evictor(torch.device("cpu"))
    monkeypatch.delenv(caches.CACHE_ENV)
    assert caches.stated_cache() is None
