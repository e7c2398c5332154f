"""``flexpipe run --data``: token streams read from text (bytes or a ``tokenizers`` file),
memory-mapped ``.npy``/``.bin`` arrays and ``datasets`` folders, and the corpus cut from them:
deterministic shuffling by seed, disjoint replicas whose batches make the single-device one,
held-out windows apart from the training ones."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.errors import ConfigError
from flexpipe.runtime.data.corpus import Corpus, DataConfig, vocab_needed
from flexpipe.runtime.data.tokens import Tokens, read_tokens

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "tiny_text.txt"


def test_text_is_its_utf8_bytes_and_a_folder_its_files_in_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("zwölf", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ab", encoding="utf-8")
    got = read_tokens(str(tmp_path))
    assert got.kind == "bytes" and got.vocab == 256
    assert bytes(got.ids) == "ab\nzwölf".encode()
    assert vocab_needed(DataConfig(str(SAMPLE))) == 256


def test_a_tokenizer_file_tokenises_the_text(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "the": 1, "miller": 2, "river": 3}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "t.txt").write_text("the miller and the river", encoding="utf-8")
    got = read_tokens(str(tmp_path / "t.txt"), str(path))
    assert got.kind == "tokenizer" and got.vocab == 4
    assert got.ids.tolist() == [1, 2, 0, 1, 3]


def test_token_arrays_are_memory_mapped(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint16) % 700
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids.astype(np.int32))
    for name in ("train.bin", "train.npy"):
        got = read_tokens(str(tmp_path / name))
        assert isinstance(got.ids, np.memmap) and got.ids.tolist() == ids.tolist()
        assert vocab_needed(DataConfig(str(tmp_path / name))) == 700


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p / "none.txt", "no such file or folder"),
    (lambda p: (p / "x.txt").write_bytes(b"\xff\xfe") and p / "x.txt", "not UTF-8 text"),
    (lambda p: np.save(p / "t.npy", np.zeros((2, 2), np.int64)) or p / "t.npy",
     "expected a 1-D integer token array"),
    (lambda p: (p / "e.txt").write_text("") or p / "e.txt", "the text is empty"),
])
def test_bad_data_is_named(tmp_path: Path, make: object, words: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=words):
        read_tokens(str(path))


def test_a_datasets_folder_needs_the_extra_then_reads_its_column(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ConfigError, match="needs the datasets extra"):
        read_tokens(str(tmp_path))

    class Saved(dict[str, list[object]]):
        column_names = ["input_ids"]

    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda path: Saved(input_ids=[[1, 2], [3]])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    got = read_tokens(str(tmp_path))
    assert got.kind == "datasets" and got.ids.tolist() == [1, 2, 3]


def corpus(n: int = 1001, seq: int = 10, seed: int = 0, val: float = 0.1) -> Corpus:
    return Corpus(Tokens(np.arange(n, dtype=np.int64), None, "array"), seq, seed, val)


def test_windows_are_shifted_pairs_and_the_held_out_ones_never_train() -> None:
    c = corpus()
    assert (c.train_windows, c.val_windows) == (90, 10)
    (x,), y = c.sample(0, 3)
    assert torch.equal(x[:, 1:], y[:, :-1])
    seen = {int(c.sequence(k)[0]) // 10 for k in range(90)}
    assert seen == set(range(90))  # one pass visits every training window once
    (vx,), _ = c.sample(0, 10, held_out=True)
    assert {int(v) // 10 for v in vx[:, 0]} == set(range(90, 100))


def test_the_order_is_the_seeds_and_each_pass_reshuffles() -> None:
    a, b, other = corpus(seed=1), corpus(seed=1), corpus(seed=2)
    assert a.order(0).tolist() == b.order(0).tolist() != other.order(0).tolist()
    assert a.order(1).tolist() != a.order(0).tolist()


@settings(max_examples=40, deadline=None)
@given(step=st.integers(0, 50), m=st.integers(1, 4), size=st.integers(1, 3),
       dp=st.integers(1, 4))
def test_replicas_read_disjoint_windows_making_the_single_device_batch(
        step: int, m: int, size: int, dp: int) -> None:
    c = corpus(n=5001)
    whole = c.batch(step, m * dp, size)
    parts = [mb for r in range(dp) for mb in c.batch(step, m, size, r, dp)]
    starts = [int(x[i, 0]) for (x,), _ in parts for i in range(size)]
    assert [int(x[i, 0]) for (x,), _ in whole for i in range(size)] == starts
    if m * dp * size <= c.train_windows:
        assert len(set(starts)) == len(starts)


def test_too_little_data_is_named() -> None:
    with pytest.raises(ConfigError, match="fewer than one training window"):
        corpus(n=5, seq=10)
    with pytest.raises(ConfigError, match="too few to hold out"):
        corpus(n=41, seq=10)


def test_only_the_ranks_holding_a_first_or_last_stage_open_the_data() -> None:
    from flexpipe.runtime.processes import stepping
    from flexpipe.specs import load

    schedule = load("1f1b", 3, 3)
    job = SimpleNamespace(schedule=schedule, train=SimpleNamespace(data=DataConfig("/no/such")),
                          model=SimpleNamespace(seq=8, seed=0, micro_batch=2))
    ranks = [SimpleNamespace(stages={r: None}, replica=0, dp=1) for r in range(3)]
    assert [stepping.reads_data(job, w) for w in ranks] == [True, False, True]
    middle = stepping.step_batch(job, ranks[1], 0)  # never opens the (missing) data
    assert len(middle) == 3 and all(x == () and t.numel() == 0 for x, t in middle)
    with pytest.raises(ConfigError, match="no such file"):
        stepping.step_batch(job, ranks[0], 0)
