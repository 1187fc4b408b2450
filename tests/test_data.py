"""The built-in data: the standard-library text corpus and the synthetic tasks."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import memfit.data.text as text_mod
from memfit.data import TextCorpus, class_patterns, image_batch, markov_successors, token_batch
from memfit.data.text import list_source_files
from memfit.errors import ConfigError

SMALL = 300_000  # bytes: enough for every check below, fast to build and hash


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path) -> TextCorpus:
    return TextCorpus.load(max_bytes=SMALL, cache_dir=corpus_dir)


# --- corpus building and caching ---------------------------------------------------------


def test_corpus_is_bytes_of_the_requested_size(corpus: TextCorpus) -> None:
    assert corpus.data.dtype == torch.uint8 and corpus.data.dim() == 1
    assert len(corpus) == SMALL
    assert corpus.num_files > 1
    # Python source: mostly printable ASCII, and it decodes as text.
    head = bytes(corpus.data[:5000].tolist()).decode("utf-8", errors="strict")
    assert "import" in head or "def " in head


def test_corpus_is_deterministic(corpus: TextCorpus) -> None:
    again = TextCorpus.load(max_bytes=SMALL, use_cache=False)
    assert torch.equal(corpus.data, again.data)
    assert again.cache_path is None


def test_corpus_starts_with_the_first_sorted_file(corpus: TextCorpus) -> None:
    first = list_source_files(text_mod.stdlib_dir())[0]
    expected = first.read_bytes()[:1000]
    assert bytes(corpus.data[: len(expected)].tolist()) == expected


def test_cache_is_reused(
    corpus: TextCorpus, corpus_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert corpus.cache_path is not None and corpus.cache_path.parent == corpus_dir
    assert corpus.cache_path.exists()

    def fail(*args: object) -> None:
        raise AssertionError("the corpus was rebuilt although a valid cache exists")

    monkeypatch.setattr(text_mod, "_build", fail)
    cached = TextCorpus.load(max_bytes=SMALL, cache_dir=corpus_dir)
    assert torch.equal(cached.data, corpus.data)
    # The split is made after loading, so another val_fraction reuses the same file.
    other = TextCorpus.load(max_bytes=SMALL, cache_dir=corpus_dir, val_fraction=0.2)
    assert len(other.val) == round(0.2 * SMALL)


def test_cache_key_separates_limits(corpus_dir: Path) -> None:
    a = TextCorpus.load(max_bytes=1000, cache_dir=corpus_dir)
    b = TextCorpus.load(max_bytes=2000, cache_dir=corpus_dir)
    assert a.cache_path != b.cache_path
    assert torch.equal(b.data[:1000], a.data)
    name = a.cache_path.name
    assert "1000B" in name and ".".join(map(str, sys.version_info[:2])) in name


def test_env_var_sets_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "env-cache"))
    c = TextCorpus.load(max_bytes=1000)
    assert c.cache_path is not None and c.cache_path.parent == tmp_path / "env-cache"
    assert c.cache_path.exists()
    assert not list((tmp_path / "env-cache").glob("*.tmp"))  # no temp file left behind


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path: Path, damage: str) -> None:
    good = TextCorpus.load(max_bytes=50_000, cache_dir=tmp_path)
    path = good.cache_path
    assert path is not None
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-1000]
    elif damage == "flip":
        raw[-10] ^= 0xFF
    elif damage == "garbage":
        raw = bytearray(b"not a cache file at all")
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))

    with pytest.warns(UserWarning, match="rebuilding"):
        again = TextCorpus.load(max_bytes=50_000, cache_dir=tmp_path)
    assert torch.equal(again.data, good.data)
    # The rebuilt file is whole again and loads silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = TextCorpus.load(max_bytes=50_000, cache_dir=tmp_path)
    assert torch.equal(third.data, good.data)


def test_unwritable_cache_dir_warns_and_continues(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot write corpus cache"):
        c = TextCorpus.load(max_bytes=1000, cache_dir=blocker)
    assert len(c) == 1000 and c.cache_path is None


def test_train_and_val_are_disjoint(corpus: TextCorpus) -> None:
    n_val = round(0.05 * SMALL)
    assert len(corpus.val) == n_val
    assert len(corpus.train) + len(corpus.val) == len(corpus)
    assert torch.equal(torch.cat([corpus.train, corpus.val]), corpus.data)
    train_end = corpus.train.storage_offset() + corpus.train.numel()
    assert corpus.val.storage_offset() >= train_end


def test_no_sources_raises_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "only.pyc").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match="(?s)no Python source files.*synthetic"):
        TextCorpus.load(source_dir=tmp_path, cache_dir=tmp_path / "cache")


def test_source_listing_is_sorted_and_skips_installed_packages(tmp_path: Path) -> None:
    for rel in ["b.py", "a/z.py", "a.py", "site-packages/x.py", "test/t.py", "a/notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    rel = [p.relative_to(tmp_path).as_posix() for p in list_source_files(tmp_path)]
    assert rel == ["a.py", "a/z.py", "b.py"]
    with_tests = list_source_files(tmp_path, include_tests=True)
    assert [p.relative_to(tmp_path).as_posix() for p in with_tests] == [
        "a.py",
        "a/z.py",
        "b.py",
        "test/t.py",
    ]
    c = TextCorpus.load(source_dir=tmp_path, use_cache=False, max_bytes=None, val_fraction=0.0)
    assert bytes(c.data.tolist()) == b"# a.py\n# a/z.py\n# b.py\n"


def test_bad_arguments_raise(corpus: TextCorpus) -> None:
    with pytest.raises(ConfigError):
        TextCorpus.load(max_bytes=0)
    with pytest.raises(ConfigError, match="split"):
        corpus.batch("test", 2, 8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size"):
        corpus.batch("val", 2, len(corpus.val))
    with pytest.raises(ConfigError):
        corpus.batch("train", 0, 8)


# --- batches -----------------------------------------------------------------------------


def test_batch_shape_and_windows(corpus: TextCorpus) -> None:
    b = corpus.batch("train", 6, 32, generator=0)
    assert b.shape == (6, 33) and b.dtype == torch.long
    assert int(b.min()) >= 0 and int(b.max()) < 256
    train = bytes(corpus.train.tolist())
    for row in b:
        assert bytes(row.tolist()) in train  # a contiguous window of the training bytes


def test_batch_sampling_is_deterministic(corpus: TextCorpus) -> None:
    a = corpus.batch("train", 8, 64, generator=torch.Generator().manual_seed(7))
    b = corpus.batch("train", 8, 64, generator=torch.Generator().manual_seed(7))
    c = corpus.batch("train", 8, 64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(corpus.batch("train", 8, 64, generator=7), a)  # int seed == generator
    g = torch.Generator().manual_seed(3)
    first, second = corpus.batch("val", 4, 16, g), corpus.batch("val", 4, 16, g)
    assert not torch.equal(first, second)  # the generator advances


def test_val_batches_cover_the_split_in_order(corpus: TextCorpus) -> None:
    block = 100
    batches = list(corpus.iter_val_batches(batch_size=16, block_size=block))
    again = list(corpus.iter_val_batches(batch_size=16, block_size=block))
    assert len(again) == len(batches) and all(torch.equal(x, y) for x, y in zip(batches, again))
    n_windows = (len(corpus.val) - 1) // block
    assert sum(len(b) for b in batches) == n_windows
    assert all(len(b) == 16 for b in batches[:-1]) and 1 <= len(batches[-1]) <= 16
    inputs = torch.cat([b[:, :-1] for b in batches]).reshape(-1)
    targets = torch.cat([b[:, 1:] for b in batches]).reshape(-1)
    assert torch.equal(inputs, corpus.val[: n_windows * block].long())
    assert torch.equal(targets, corpus.val[1 : n_windows * block + 1].long())
    assert len(list(corpus.iter_val_batches(16, block, max_batches=2))) == 2


# --- synthetic data ----------------------------------------------------------------------


def test_image_batches_are_deterministic() -> None:
    x1, y1 = image_batch(16, generator=torch.Generator().manual_seed(0))
    x2, y2 = image_batch(16, generator=0)
    x3, _ = image_batch(16, generator=1)
    assert x1.shape == (16, 3, 32, 32) and x1.dtype == torch.float32
    assert y1.shape == (16,) and y1.dtype == torch.long and int(y1.max()) < 10
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    x4, _ = image_batch(4, num_classes=5, image_size=16, channels=1, dtype=torch.bfloat16)
    assert x4.shape == (4, 1, 16, 16) and x4.dtype == torch.bfloat16


def test_image_task_is_learnable() -> None:
    # The class patterns are recoverable through the noise: matching each image against the
    # patterns classifies almost all correctly, so a CNN has something to learn.
    x, y = image_batch(256, generator=0)
    patterns = class_patterns(10, 3, 32)
    scores = torch.einsum("bchw,kchw->bk", x, patterns)
    assert (scores.argmax(1) == y).float().mean() > 0.95


def test_token_batches_follow_the_chain() -> None:
    a = token_batch(8, 40, generator=0)
    assert a.shape == (8, 41) and a.dtype == torch.long
    assert torch.equal(a, token_batch(8, 40, generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(a, token_batch(8, 40, generator=1))
    table = markov_successors(256, 4)
    allowed = table[a[:, :-1]]  # (B, T, branching)
    assert (allowed == a[:, 1:, None]).any(-1).all()
    small = token_batch(2, 5, vocab_size=7, branching=2, generator=0)
    assert int(small.max()) < 7


def test_synthetic_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        image_batch(0)
    with pytest.raises(ConfigError):
        token_batch(2, 0)
    with pytest.raises(ConfigError, match="branching"):
        token_batch(2, 4, vocab_size=3, branching=5)
