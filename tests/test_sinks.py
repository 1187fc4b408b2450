"""Sinks write what they are given, readably, and a bad log directory fails up front."""

from __future__ import annotations

import io
import json
import math
import sys
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
    assert [e.value for e in events] == pytest.approx([2.0, 1.0, 0.0])


def test_tensorboard_missing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install memfit\[tensorboard\]"):
        TensorBoardSink(tmp_path / "tb")


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
