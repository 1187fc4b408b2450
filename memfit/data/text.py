"""A byte-level text corpus made from the Python standard library's own ``.py`` files.

Every Python install carries a few tens of megabytes of well-formed source text, so a
language model can train on real data without a download. The corpus is built at run time:
the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` skipped) are
read in sorted order of their relative paths, concatenated as bytes up to ``max_bytes``,
and the last ``val_fraction`` of the bytes becomes the validation split.

The result is cached on disk (``$MEMFIT_CACHE`` or ``~/.cache/memfit/``) under a name
that includes the Python version and the size limit; the cache file carries a SHA-256 of
its payload, so a truncated or damaged file is detected and rebuilt.

Example::

    corpus = TextCorpus.load(max_bytes=2_000_000)
    batch = corpus.batch("train", batch_size=8, block_size=128, generator=0)
    inputs, targets = batch[:, :-1], batch[:, 1:]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import torch

from memfit.errors import ConfigError
from memfit.savefile import write_atomically

Split = Literal["train", "val"]

#: Bumped whenever the way the corpus is assembled or stored changes, so old caches are ignored.
FORMAT_VERSION = 1
#: The default size limit: large enough for a small model to learn from, quick to build.
DEFAULT_MAX_BYTES = 20_000_000
_MAGIC = b"MEMFITTC"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def default_cache_dir() -> Path:
    """The cache directory: ``$MEMFIT_CACHE`` when set, else ``~/.cache/memfit``.

    Example::

        os.environ["MEMFIT_CACHE"] = "/tmp/memfit-cache"
        default_cache_dir()  # PosixPath('/tmp/memfit-cache')
    """
    env = os.environ.get("MEMFIT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "memfit"


def stdlib_dir() -> Path:
    """Where this interpreter's standard library lives (the corpus's default source)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path, include_tests: bool = False) -> list[Path]:
    """The ``.py`` files under ``root`` in sorted order of their relative POSIX paths.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` are always skipped (they differ
    between installs of the same Python); the test suites unless ``include_tests``.

    Example::

        files = list_source_files(stdlib_dir())
        files[0].name  # '__future__.py'
    """
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into the skipped trees at all.
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    # Sorting the relative paths (not os.walk's order, which depends on the file system)
    # makes the corpus the same bytes on every machine with the same Python.
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


@dataclass(frozen=True)
class CorpusKey:
    """What identifies one built corpus; a cache file is only reused when all of it matches."""

    python: str
    """Implementation and full version, e.g. ``"cpython-3.11.7"``: the stdlib differs per version."""
    source: str
    """The absolute path of the directory the files were read from."""
    max_bytes: int | None
    """The size limit the corpus was cut to (``None``: every file)."""
    include_tests: bool
    """Whether the standard library's test suites were included."""
    format: int = FORMAT_VERSION
    """The on-disk format and assembly rules version (:data:`FORMAT_VERSION`)."""

    def filename(self) -> str:
        """A readable cache file name that still changes whenever any field changes."""
        digest = hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()
        limit = "all" if self.max_bytes is None else str(self.max_bytes)
        tests = "-tests" if self.include_tests else ""
        return f"stdlib-{self.python}-{limit}B{tests}-{digest[:10]}.bin"


def _python_tag() -> str:
    return f"{platform.python_implementation().lower()}-{'.'.join(map(str, sys.version_info[:3]))}"


def _build(files: list[Path], max_bytes: int | None) -> tuple[bytes, int]:
    """Concatenate ``files`` up to ``max_bytes``; return the bytes and how many files were used."""
    parts: list[bytes] = []
    total = 0
    used = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            # An unreadable file (permissions, a dangling link) is skipped, not fatal; the
            # order of the rest is unchanged, so the corpus stays deterministic per machine.
            continue
        parts.append(data)
        total += len(data)
        used += 1
    blob = b"".join(parts)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    return blob, used


def _write_cache(path: Path, key: CorpusKey, blob: bytes, num_files: int) -> None:
    header = json.dumps(
        {
            "key": key.__dict__,
            "num_bytes": len(blob),
            "num_files": num_files,
            "sha256": hashlib.sha256(blob).hexdigest(),
        },
        sort_keys=True,
    ).encode()

    def write(f: BinaryIO) -> None:
        f.write(_MAGIC)
        f.write(len(header).to_bytes(4, "little"))
        f.write(header)
        f.write(blob)

    # Atomic: a reader (or a second process building the same corpus) never sees a
    # half-written cache file.
    write_atomically(path, write)


def _read_cache(path: Path, key: CorpusKey) -> tuple[np.ndarray, int] | None:
    """The cached bytes and file count, or None when the file is missing, stale or damaged."""
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        warnings.warn(f"cannot read corpus cache {path} ({e}); rebuilding it", stacklevel=3)
        return None
    problem = None
    try:
        if raw[: len(_MAGIC)] != _MAGIC:
            problem = "not a memfit corpus file"
        else:
            start = len(_MAGIC) + 4
            n = int.from_bytes(raw[len(_MAGIC) : start], "little")
            header = json.loads(raw[start : start + n])
            payload = memoryview(raw)[start + n :]
            if header.get("key") != key.__dict__:
                problem = "it was built for different settings"
            elif len(payload) != header["num_bytes"]:
                problem = f"it is truncated ({len(payload)} of {header['num_bytes']} bytes)"
            elif hashlib.sha256(payload).hexdigest() != header["sha256"]:
                problem = "its checksum does not match (the file is damaged)"
    except (ValueError, KeyError, TypeError, AttributeError):
        problem = "its header cannot be parsed"
    if problem is not None:
        warnings.warn(f"corpus cache {path} is unusable: {problem}; rebuilding it", stacklevel=3)
        return None
    return np.frombuffer(payload, dtype=np.uint8).copy(), int(header["num_files"])


class TextCorpus:
    """A byte-level corpus split into ``train`` and ``val`` uint8 tensors.

    Build one with :meth:`load`; sample with :meth:`batch`; evaluate with
    :meth:`iter_val_batches`. Values are bytes, so a model's ``vocab_size`` is 256.

    Example::

        corpus = TextCorpus.load(max_bytes=1_000_000)
        corpus.train.dtype, len(corpus)  # (torch.uint8, 1000000)
        x = corpus.batch("train", batch_size=4, block_size=64, generator=1)  # (4, 65) int64
    """

    vocab_size: int = 256

    def __init__(
        self,
        data: torch.Tensor,
        val_fraction: float = 0.05,
        num_files: int = 0,
        source: Path | None = None,
        cache_path: Path | None = None,
    ) -> None:
        """Split ``data`` (a 1-D uint8 tensor) into its first and last ``val_fraction`` part."""
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ConfigError(
                f"corpus data must be a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
        n_val = int(round(len(data) * val_fraction))
        self.data = data
        # Both splits are views of one buffer: the validation split is a contiguous tail, so
        # no training window can contain a validation byte.
        self.train = data[: len(data) - n_val]
        self.val = data[len(data) - n_val :]
        self.val_fraction = val_fraction
        self.num_files = num_files
        self.source = source
        self.cache_path = cache_path

    @classmethod
    def load(
        cls,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        cache_dir: str | os.PathLike[str] | None = None,
        val_fraction: float = 0.05,
        include_tests: bool = False,
        source_dir: str | os.PathLike[str] | None = None,
        use_cache: bool = True,
        rebuild: bool = False,
    ) -> TextCorpus:
        """Read the corpus from the cache, or build it from the stdlib sources and cache it.

        Args:
            max_bytes: Cut the corpus to this many bytes (``None``: every file). Part of the
                cache key, so different limits are cached side by side.
            cache_dir: Where cache files live; default :func:`default_cache_dir`.
            val_fraction: The share of bytes, taken from the end, that forms ``val``. Not part
                of the cache key: the split is made after loading.
            include_tests: Also read the standard library's test suites.
            source_dir: Read ``.py`` files from here instead of the standard library.
            use_cache: ``False`` builds in memory and neither reads nor writes the cache.
            rebuild: Ignore an existing cache file and overwrite it.

        Raises:
            ConfigError: When no ``.py`` sources exist (a stripped install), or an argument is
                out of range.

        Example::

            corpus = TextCorpus.load(max_bytes=5_000_000, cache_dir="/tmp/memfit")
        """
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive or None, got {max_bytes}")
        source = Path(source_dir) if source_dir is not None else stdlib_dir()
        source = source.resolve()
        key = CorpusKey(
            python=_python_tag(),
            source=str(source),
            max_bytes=max_bytes,
            include_tests=include_tests,
        )
        path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        path = path / key.filename()

        if use_cache and not rebuild:
            cached = _read_cache(path, key)
            if cached is not None:
                array, num_files = cached
                return cls(torch.from_numpy(array), val_fraction, num_files, source, path)

        files = list_source_files(source, include_tests) if source.is_dir() else []
        blob, num_files = _build(files, max_bytes)
        if not blob:
            raise ConfigError(
                f"no Python source files (*.py) found under {source}: this Python install "
                "seems to ship without its standard library sources (only .pyc, or stripped). "
                "Use synthetic data instead, e.g. build_model('gpt', data='synthetic') or "
                "memfit.data.synthetic.token_batch(...), or pass source_dir= a folder of .py files"
            )
        if use_cache:
            try:
                _write_cache(path, key, blob, num_files)
            except OSError as e:
                # A read-only home or full disk should not stop training: the corpus is
                # already in memory, it just gets rebuilt next time.
                warnings.warn(
                    f"cannot write corpus cache {path} ({e}); continuing without it", stacklevel=2
                )
                path = None
        array = np.frombuffer(blob, dtype=np.uint8).copy()
        return cls(
            torch.from_numpy(array), val_fraction, num_files, source, path if use_cache else None
        )

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return (
            f"TextCorpus({len(self.data):,} bytes from {self.num_files} files; "
            f"train {len(self.train):,}, val {len(self.val):,})"
        )

    def split(self, split: Split) -> torch.Tensor:
        """The ``"train"`` or ``"val"`` bytes."""
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise ConfigError(f"unknown split {split!r}; use 'train' or 'val'")

    def batch(
        self,
        split: Split,
        batch_size: int,
        block_size: int,
        generator: torch.Generator | int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``batch_size`` random windows of ``block_size + 1`` bytes as an int64 tensor.

        Column ``t + 1`` is the target of column ``t``: use ``batch[:, :-1]`` as inputs and
        ``batch[:, 1:]`` as targets. The same generator state (or integer seed) gives the same
        batch; ``None`` draws from torch's global generator.

        Example::

            b = corpus.batch("train", 8, 128, generator=torch.Generator().manual_seed(0))
            b.shape  # torch.Size([8, 129])
        """
        data = self.split(split)
        _check_sizes(batch_size, block_size)
        span = block_size + 1
        if len(data) < span:
            raise ConfigError(
                f"the {split} split has {len(data)} bytes, fewer than block_size + 1 = {span}; "
                "load a larger corpus (max_bytes) or use a smaller block_size"
            )
        if isinstance(generator, int):
            generator = torch.Generator().manual_seed(generator)
        starts = torch.randint(0, len(data) - span + 1, (batch_size,), generator=generator)
        out = data[starts[:, None] + torch.arange(span)].long()
        return out if device is None else out.to(device)

    def iter_val_batches(
        self,
        batch_size: int,
        block_size: int,
        max_batches: int | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[torch.Tensor]:
        """Walk the validation split in order, in windows of ``block_size + 1`` bytes.

        Windows start every ``block_size`` bytes, so every validation byte is predicted
        exactly once. The last batch may be smaller than ``batch_size``. Deterministic: no
        randomness is involved.

        Example::

            losses = [gpt_loss(model, b) for b in corpus.iter_val_batches(16, 128, max_batches=10)]
        """
        _check_sizes(batch_size, block_size)
        span = block_size + 1
        n_windows = max(0, (len(self.val) - 1) // block_size)
        if n_windows == 0:
            raise ConfigError(
                f"the val split has {len(self.val)} bytes, fewer than block_size + 1 = {span}; "
                "load a larger corpus or raise val_fraction"
            )
        offsets = torch.arange(span)
        emitted = 0
        for first in range(0, n_windows, batch_size):
            if max_batches is not None and emitted >= max_batches:
                return
            starts = torch.arange(first, min(first + batch_size, n_windows)) * block_size
            out = self.val[starts[:, None] + offsets].long()
            yield out if device is None else out.to(device)
            emitted += 1


def _check_sizes(batch_size: int, block_size: int) -> None:
    if batch_size <= 0 or block_size <= 0:
        raise ConfigError(
            f"batch_size and block_size must be positive, got {batch_size} and {block_size}"
        )
