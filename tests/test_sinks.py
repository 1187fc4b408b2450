"""Sinks write what they are given, readably, and a bad log directory fails up front."""

from __future__ import annotations

import io
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from memfit.errors import ConfigError
from memfit.monitor.sinks import (
    ConsoleSink,
    JSONLSink,
    MultiSink,
    Sink,
    TensorBoardSink,
    check_log_dir,
)


def _strict(text: str) -> Any:
    def reject(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


def test_jsonl_sink_writes_flushed_strict_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "metrics.jsonl"
    sink = JSONLSink(path)
    sink.log(10, {"loss": 2.5, "amp/scale": 8192.0, "lr": torch.tensor(1e-3)})
    # Flushed per line: readable before close.
    assert _strict(path.read_text().splitlines()[0]) == {
        "step": 10,
        "loss": 2.5,
        "amp/scale": 8192,
        "lr": pytest.approx(1e-3),
    }
    with pytest.warns(UserWarning, match="'note' is not a number"):
        sink.log(20, {"loss": math.nan, "grad/norm": math.inf, "x": -math.inf, "note": "hi"})
    sink.log(30, {"loss": 1.0, "note": "again"})  # warned once per key
    sink.close()
    sink.close()
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert rows[1] == {"step": 20, "loss": "nan", "grad/norm": "inf", "x": "-inf"}
    with pytest.raises(ConfigError, match="closed"):
        sink.log(40, {"loss": 1.0})
    # Appends to an existing file.
    again = JSONLSink(path)
    again.log(40, {"loss": 0.5})
    again.close()
    assert len(path.read_text().splitlines()) == 4


def _float32(value: float) -> float:
    """``value`` as TensorBoard stores a scalar (float32)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _records(path: Path) -> list[bytes]:
    """The TFRecords of an event file, each length and data checked against its masked
    CRC-32C as tensorboard's own pure-Python reader computes it."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert header_crc == masked_crc32c(header)
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert len(body) == length and body_crc == masked_crc32c(body)
        out.append(body)
        pos += 16 + length
    return out


def _scalars(path: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """The file_version of an event file and its scalars: tag -> [(step, value)]."""
    from tensorboard.compat.proto.event_pb2 import Event

    events = [Event.FromString(body) for body in _records(path)]
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event in events[1:]:
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return events[0].file_version, scalars


def test_crc32c_matches_published_check_values() -> None:
    from memfit.monitor.sinks import _crc32c

    # The CRC-32C check value, and iSCSI's (RFC 3720, B.4) 32 zero bytes and 32 0xFF bytes.
    assert _crc32c(b"123456789") == 0xE3069283
    assert _crc32c(bytes(32)) == 0x8A9136AA
    assert _crc32c(b"\xff" * 32) == 0x62A8AB43
    assert _crc32c(b"") == 0


def test_tensorboard_event_file_round_trips_exactly(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sink = TensorBoardSink(tmp_path / "tb")
    logged = {
        10: {"loss": 2.5, "amp/scale": 65536.0, "lr": 1e-3, "grad/norm": math.inf},
        20: {"loss": 1.0 / 3.0, "amp/scale": 32768.0, "lr": 3e-4, "grad/norm": -math.inf},
        30: {"loss": math.nan, "amp/scale": 1.0, "lr": torch.tensor(1e-4), "step": 30.0},
    }
    for step, metrics in logged.items():
        sink.log(step, metrics)
    (path,) = (tmp_path / "tb").iterdir()
    # Flushed on each log call (flush_every=1): complete before close.
    assert len(_records(path)) == 1 + len(logged)
    sink.close()
    sink.close()
    name = (
        rf"events\.out\.tfevents\.\d{{10}}\.{re.escape(socket.gethostname())}\.{os.getpid()}\.\d+"
    )
    assert re.fullmatch(name, path.name)
    version, scalars = _scalars(path)
    assert version == "brain.Event:2"
    assert set(scalars) == {"loss", "amp/scale", "lr", "grad/norm"}  # "step" is the step
    for tag, points in scalars.items():
        expected = [(s, _float32(float(m[tag]))) for s, m in logged.items() if tag in m]
        assert [step for step, _ in points] == [step for step, _ in expected], tag
        got = [value for _, value in points]
        want = [value for _, value in expected]
        assert [struct.pack("<f", v) for v in got] == [struct.pack("<f", v) for v in want], tag
    with pytest.raises(ConfigError, match="closed"):
        sink.log(40, {"loss": 1.0})


def test_tensorboard_sinks_in_one_directory_write_separate_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    first, second = TensorBoardSink(tmp_path), TensorBoardSink(tmp_path, flush_every=2)
    first.log(1, {"loss": 1.0})
    second.log(1, {"loss": 2.0})
    first.close()
    second.close()
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    assert sorted(_scalars(f)[1]["loss"][0][1] for f in files) == [1.0, 2.0]


def test_tensorboard_sink_events_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in (10, 20, 30):
        sink.log(step, {"loss": 3.0 - step / 10, "amp/scale": 8192.0})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "amp/scale"}
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [10, 20, 30]
    assert [e.value for e in events] == [_float32(3.0 - step / 10) for step in (10, 20, 30)]


# Trains a few logged steps with a log_dir, then reads the events back with tensorboard's
# own reader held to its pure-Python path (tensorboard.compat.notf), which checks every
# record's CRCs, all without TensorFlow. Prints what it found as JSON.
_ENGINE_RUN = """
    import json, sys, types
    import torch
    import memfit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = memfit.Engine(model, opt, precision="fp32", log_every=2, log_dir=sys.argv[1])
    for _ in range(6):
        engine.train_step(torch.randn(4, 4), lambda m, b: m(b).square().mean())
    engine.close()
    after_run = "tensorflow" in sys.modules

    sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(sys.argv[1] + "/tensorboard")
    acc.Reload()
    print(json.dumps({
        "tensorflow_after_run": after_run,
        "tensorflow_after_read": "tensorflow" in sys.modules,
        "loss": [[e.step, e.value] for e in acc.Scalars("loss")],
        "tags": sorted(acc.Tags()["scalars"]),
    }))
"""


def test_engine_with_log_dir_writes_events_without_tensorflow(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # were TensorFlow imported, its logs would show
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ENGINE_RUN), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["tensorflow_after_run"] is False
    assert found["tensorflow_after_read"] is False
    assert "oneDNN" not in done.stderr and "absl" not in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in found["loss"]] == [row["step"] for row in rows] == [2, 4, 6]
    assert [value for _, value in found["loss"]] == [_float32(row["loss"]) for row in rows]
    jsonl_tags = {key for row in rows for key in row} - {"step"}
    assert set(found["tags"]) == jsonl_tags


def test_tensorboard_missing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were absent.
    for name in ("tensorboard", *(m for m in list(sys.modules) if m.startswith("tensorboard."))):
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("tensorboard.compat.proto.event_pb2", "tensorboard.compat.proto.summary_pb2"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"pip install memfit\[tensorboard\]"):
        TensorBoardSink(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_console_sink_prints_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    sink = ConsoleSink(console=Console(file=buf, width=200, color_system=None))
    sink.log(100, {"loss": 2.3456, "amp/scale": 8192.0, "memory/peak_bytes": 3 * 2**20})
    out = buf.getvalue()
    assert "step 100" in out and "loss 2.346" in out and "3.00 MiB" in out
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    sink.log(200, {"loss": 1.0})
    assert "step 200" not in buf.getvalue()
    sink.close()


def test_file_sinks_write_nothing_off_rank_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    sink = JSONLSink(tmp_path / "m.jsonl")
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_console_sink_all_keys() -> None:
    buf = io.StringIO()
    sink = ConsoleSink(keys=(), console=Console(file=buf, width=200, color_system=None))
    sink.log(1, {"zeta": 1.0, "alpha": 2.0})
    out = buf.getvalue()
    assert out.index("alpha") < out.index("zeta")


def test_check_log_dir_creates_and_rejects(tmp_path: Path) -> None:
    made = check_log_dir(tmp_path / "a" / "b")
    assert made.is_dir()
    regular = tmp_path / "file.txt"
    regular.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_log_dir(regular)
    # Tests run as root, where permission bits do not block writes; a path below a regular
    # file cannot be created by anyone.
    with pytest.raises(ConfigError, match="cannot write to log directory"):
        check_log_dir(regular / "logs")


def test_unwritable_log_dir_fails_before_anything_runs(tmp_path: Path) -> None:
    regular = tmp_path / "file.txt"
    regular.write_text("x")
    with pytest.raises(ConfigError, match="cannot write"):
        JSONLSink(regular / "run" / "metrics.jsonl")
    pytest.importorskip("tensorboard")
    with pytest.raises(ConfigError, match="cannot write"):
        TensorBoardSink(regular / "tb")


def test_custom_sinks_and_multisink(tmp_path: Path) -> None:
    class Collect:
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict[str, float]]] = []
            self.closed = False

        def log(self, step: int, metrics: Any) -> None:
            self.rows.append((step, dict(metrics)))

        def close(self) -> None:
            self.closed = True

    mine = Collect()
    assert isinstance(mine, Sink)
    sinks = MultiSink([mine, JSONLSink(tmp_path / "m.jsonl")])
    sinks.log(5, {"loss": 1.5})
    sinks.close()
    assert mine.rows == [(5, {"loss": 1.5})] and mine.closed
    assert _strict((tmp_path / "m.jsonl").read_text()) == {"step": 5, "loss": 1.5}
    with pytest.raises(ConfigError, match="not a sink"):
        MultiSink([object()])  # type: ignore[list-item]
