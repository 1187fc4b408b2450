"""State files (saved training state) that are written atomically and checked when read.

A file is written to a temporary name in the same directory, flushed and fsynced, then
renamed over the target: a crash leaves either the old file or the new one, never half of
one (:func:`write_atomically`, which other files are written with too). The payload
carries a SHA-256 digest of its contents; a file that was truncated or changed fails with
an error that names it. Files load with ``torch.load(weights_only=True)``.

Example::

    atomic_save({"step": 3, "w": torch.ones(2)}, "run/last.pt")
    state = safe_load("run/last.pt")
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from memfit.errors import StateFileError

#: The header every state file carries. It keeps its old name ("checkpoint" in memfit now
#: means activation checkpointing only): every state file written with it must still load.
FORMAT = "memfit-checkpoint"
VERSION = 1


def _digest(value: Any, sha: Any) -> None:
    # Walks the payload in a fixed order; tensors contribute dtype, shape and raw bytes.
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        sha.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        sha.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            sha.update(repr(key).encode())
            _digest(value[key], sha)
    elif isinstance(value, (list, tuple)):
        sha.update(f"L{len(value)}".encode())
        for item in value:
            _digest(item, sha)
    else:
        sha.update(f"V{value!r}".encode())


def digest(payload: Any) -> str:
    """SHA-256 of a state file payload's contents (tensors by value)."""
    sha = hashlib.sha256()
    _digest(payload, sha)
    return sha.hexdigest()


def _file_mode(path: Path) -> int:
    # The target's own mode when it exists, else 0666 less the process umask (read from
    # /proc on Linux: os.umask can only be read by setting it, which races other threads).
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def atomic_write(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` atomically (temp file, fsync, rename), with no header or
    digest: for files other tools read with ``torch.load``, such as an exported state dict.

    Example::

        atomic_write(model.state_dict(), "run/model.pt")
        model.load_state_dict(torch.load("run/model.pt", weights_only=True))
    """
    return write_atomically(path, lambda f: torch.save(obj, f))


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Make ``path`` the file ``write(f)`` writes, atomically: ``f`` is a temporary file in
    the same directory, fsynced and then renamed over ``path`` (the rename fsynced too), so
    a reader never sees half a file. The file gets the mode a plain ``open()`` would give
    it (an existing file's own). Returns the path.

    Example::

        write_atomically("cache/corpus.bin", lambda f: f.write(blob))
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates the file private (0600); give it the mode a plain open() would.
        if hasattr(os, "fchmod"):
            os.fchmod(fd, _file_mode(path))
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # Make the rename itself durable.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def atomic_save(payload: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``payload`` to ``path`` atomically with an integrity digest; return the path."""
    record = {"format": FORMAT, "version": VERSION, "sha256": digest(payload), "payload": payload}
    return atomic_write(record, path)


def _first_sentence(exc: BaseException, limit: int = 160) -> str:
    """``exc``'s type and the first sentence of its message, at most ``limit`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    head, dot, _ = text.partition(". ")
    text = head + ("." if dot else "")
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def safe_load(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Load a file written by :func:`atomic_save`, checking its format and digest."""
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"state file {path} does not exist")
    try:
        record = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        # memfit's reading first; torch's own text (for random bytes, a long note about
        # weights_only that asks to file an issue with PyTorch) cut to its first sentence
        # after it, and kept whole on the chained exception.
        raise StateFileError(
            f"state file {path} cannot be read: it is truncated or not a memfit state file. "
            f"Resume from an earlier state file. (torch.load: {_first_sentence(exc)})"
        ) from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise StateFileError(f"{path} is not a memfit state file (no '{FORMAT}' header)")
    if record.get("version") != VERSION:
        raise StateFileError(
            f"state file {path} has format version {record.get('version')}; this memfit reads "
            f"version {VERSION}. Use the memfit version that wrote it."
        )
    payload = record.get("payload")
    if digest(payload) != record.get("sha256"):
        raise StateFileError(
            f"state file {path} failed its integrity check: its contents changed after it was "
            "written. Resume from an earlier state file."
        )
    return payload
