"""State files: atomic writes, integrity digests, clear errors on bad files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from memfit.errors import StateFileError
from memfit.savefile import FORMAT, VERSION, atomic_save, atomic_write, digest, safe_load

pytestmark = pytest.mark.usefixtures("one_thread")


# A tensor whose raw bytes are easy to find in the file.
MARKER = torch.arange(1000, 1256, dtype=torch.float32) + 0.5


def _payload(version: int = 0) -> dict:
    return {
        "step": 3 + version,
        "lr": 0.125,
        "name": "run",
        "none": None,
        "flags": [True, False],
        "pair": (1, 2.5),
        "nested": {"a": {1: torch.ones(2, 3)}, "b": [torch.zeros(0), torch.tensor(7)]},
        "half": torch.linspace(-1, 1, 5).to(torch.bfloat16),
        "int": torch.arange(4, dtype=torch.int64),
        "bool": torch.tensor([True, False]),
        "marker": MARKER + version,
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    assert atomic_save(_payload(), path) == path
    _assert_same(safe_load(path), _payload())
    _assert_same(safe_load(str(path)), _payload())
    assert _leftovers(tmp_path) == []


def test_loads_with_weights_only(tmp_path: Path) -> None:
    path = atomic_save(_payload(), tmp_path / "ckpt.pt")
    record = torch.load(path, weights_only=True)
    assert record["format"] == FORMAT and record["version"] == VERSION
    assert record["sha256"] == digest(_payload())
    _assert_same(record["payload"], _payload())


def test_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "last.pt"
    atomic_save({"x": 1}, path)
    assert safe_load(path) == {"x": 1}


def test_overwrites_atomically(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    atomic_save(_payload(0), path)
    atomic_save(_payload(1), path)
    _assert_same(safe_load(path), _payload(1))
    assert _leftovers(tmp_path) == []


def test_digest_is_deterministic_and_sensitive() -> None:
    base = _payload()
    assert digest(base) == digest(_payload())
    assert len(digest(base)) == 64
    # Key order does not matter; values, dtypes, shapes and structure do.
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    variants = [
        {**base, "step": 4},
        {**base, "marker": MARKER.clone().index_fill_(0, torch.tensor([7]), 0.0)},
        {**base, "marker": MARKER.double()},
        {**base, "marker": MARKER.reshape(16, 16)},
        {**base, "pair": (1, 2.25)},
        {**base, "extra": None},
        {k: v for k, v in base.items() if k != "none"},
        {**base, "flags": [True, False, True]},
    ]
    digests = {digest(v) for v in variants}
    assert len(digests) == len(variants)
    assert digest(base) not in digests
    # A non-contiguous tensor digests as its values.
    t = torch.arange(12.0).reshape(3, 4)
    assert digest({"t": t.t()}) == digest({"t": t.t().contiguous()})


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("written", [0, 10, 5000])
def test_a_failed_write_leaves_the_previous_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: int
) -> None:
    path = tmp_path / "last.pt"
    atomic_save(_payload(0), path)
    before = path.read_bytes()
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Write part of a real state file, then die (disk full, killed, ...).
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[:written])
        raise _Boom("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(_Boom):
        atomic_save(_payload(1), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    _assert_same(safe_load(path), _payload(0))
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_a_failed_first_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        f.write(b"PK\x03\x04partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"x": 1}, tmp_path / "new.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.99])
def test_truncated_file_raises_naming_it(tmp_path: Path, keep: float) -> None:
    good = atomic_save(_payload(0), tmp_path / "step1.pt")
    bad = atomic_save(_payload(1), tmp_path / "step2.pt")
    data = bad.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(StateFileError) as info:
        safe_load(bad)
    assert str(bad) in str(info.value)
    _assert_same(safe_load(good), _payload(0))


def test_flipped_bytes_in_tensor_data_raise_naming_the_file(tmp_path: Path) -> None:
    good = atomic_save(_payload(0), tmp_path / "step1.pt")
    bad = atomic_save(_payload(1), tmp_path / "step2.pt")
    data = bytearray(bad.read_bytes())
    raw = (MARKER + 1).numpy().tobytes()
    start = data.find(raw)
    assert start >= 0, "tensor data not stored raw in the file"
    data[start + 400] ^= 0x40  # one bit in the middle of the tensor's data
    bad.write_bytes(bytes(data))
    with pytest.raises(StateFileError) as info:
        safe_load(bad)
    assert str(bad) in str(info.value)
    _assert_same(safe_load(good), _payload(0))


def test_changed_tensor_with_the_old_digest_fails_the_integrity_check(tmp_path: Path) -> None:
    good = atomic_save(_payload(0), tmp_path / "step1.pt")
    bad = atomic_save(_payload(1), tmp_path / "step2.pt")
    record = torch.load(bad, weights_only=True)
    record["payload"]["nested"]["a"][1][0, 0] = 2.0  # a valid file, but not what was written
    torch.save(record, bad)
    with pytest.raises(StateFileError, match="integrity") as info:
        safe_load(bad)
    assert str(bad) in str(info.value)
    assert "earlier state file" in str(info.value)
    _assert_same(safe_load(good), _payload(0))


def test_missing_foreign_and_future_files(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="does not exist"):
        safe_load(tmp_path / "nope.pt")
    with pytest.raises(StateFileError, match="does not exist"):
        safe_load(tmp_path)  # a directory is not a state file
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, foreign)
    with pytest.raises(StateFileError, match="not a memfit state file") as info:
        safe_load(foreign)
    assert str(foreign) in str(info.value)
    future = tmp_path / "future.pt"
    torch.save({"format": FORMAT, "version": VERSION + 1, "sha256": "", "payload": {}}, future)
    with pytest.raises(StateFileError, match="version") as info:
        safe_load(future)
    assert str(future) in str(info.value)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(256))
    with pytest.raises(StateFileError, match="cannot be read") as info:
        safe_load(garbage)
    assert str(garbage) in str(info.value)


def test_refuses_pickled_code(tmp_path: Path) -> None:
    # weights_only loading: a file that needs arbitrary unpickling is not a state file.
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "version": VERSION, "payload": {"obj": _Boom("x")}}, path)
    with pytest.raises(StateFileError, match="cannot be read"):
        safe_load(path)


def test_new_files_get_the_usual_permissions(tmp_path: Path) -> None:
    # Like torch.save or open(): readable by whoever the umask allows, not owner-only.
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    path = atomic_save({"x": 1}, tmp_path / "ckpt.pt")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    # Overwriting keeps the mode the file already had.
    path.chmod(0o640)
    atomic_save({"x": 2}, path)
    assert path.stat().st_mode & 0o777 == 0o640


def test_atomic_write_writes_a_plain_file_and_fails_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.pt"
    state = {"w": torch.arange(4.0)}
    assert atomic_write(state, path) == path
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == ["w"] and torch.equal(loaded["w"], state["w"])  # no header
    before = path.read_bytes()

    def failing_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        f.write(b"partial")
        raise _Boom("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(_Boom):
        atomic_write({"w": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
