"""Where metrics go: JSON lines, TensorBoard, the console, or any object with ``log``/``close``.

A sink receives the metrics read every ``log_every`` steps, as host numbers; no sink touches
the device. To add another destination (Weights & Biases, MLflow, ...) write a class with
the two methods of :class:`Sink`; memfit does not need to know the library.

Under ``torch.distributed`` every sink here writes on rank 0 only by default, so N processes
do not write N copies into one file.

Example::

    log_dir = check_log_dir("runs/exp1")          # fails now, not after an hour of training
    sinks = MultiSink([JSONLSink(log_dir / "metrics.jsonl"), TensorBoardSink(log_dir / "tb"),
                       ConsoleSink()])
    sinks.log(step, engine.metrics)
    sinks.close()

A custom sink::

    class WandbSink:
        def log(self, step, metrics):
            wandb.log(dict(metrics), step=step)
        def close(self):
            wandb.finish()
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import numbers
import os
import socket
import struct
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from memfit.errors import ConfigError

__all__ = [
    "ConsoleSink",
    "EventFileWriter",
    "JSONLSink",
    "MultiSink",
    "Sink",
    "TensorBoardSink",
    "check_log_dir",
    "is_rank_zero",
    "numeric_metrics",
]


@runtime_checkable
class Sink(Protocol):
    """Anything that takes metrics: ``log(step, metrics)`` and ``close()``.

    Example::

        class PrintSink:
            def log(self, step: int, metrics: Mapping[str, float]) -> None:
                print(step, dict(metrics))
            def close(self) -> None:
                pass
    """

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (host numbers) for optimizer step ``step``."""
        ...

    def close(self) -> None:
        """Flush and release whatever the sink holds; later ``log`` calls are errors."""
        ...


def is_rank_zero() -> bool:
    """True unless ``torch.distributed`` is initialized and this process is not rank 0."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch build without distributed support
        return True
    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def check_log_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and its parents) and check a file can be written there.

    Raises :class:`memfit.errors.ConfigError` naming the directory and the reason, so a bad
    log directory fails before training starts rather than at the first log.

    Example::

        log_dir = check_log_dir("runs/exp1")
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"log directory {directory} is a file; give a directory path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".memfit-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write to log directory {directory}: {exc.strerror or exc}; "
            "choose a writable directory"
        ) from None
    return directory


def numeric_metrics(metrics: Mapping[str, Any], warned: set[str] | None = None) -> dict[str, float]:
    """The entries of ``metrics`` that are numbers, as floats; others are dropped with one
    warning per key (when ``warned`` is given, keys in it are not warned about again).

    0-dim tensors are read with ``float()``, which syncs; pass host numbers to avoid it.

    Example::

        numeric_metrics({"loss": 2.5, "note": "x"})   # {"loss": 2.5}, warns about "note"
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[key] = float(value)
            continue
        if isinstance(value, numbers.Real):
            out[key] = float(value)
            continue
        if hasattr(value, "numel") and value.numel() == 1 and not value.is_complex():
            out[key] = float(value)
            continue
        if warned is None or key not in warned:
            warnings.warn(
                f"metric {key!r} is not a number ({type(value).__name__}); sinks record "
                "numbers only, so it is left out",
                stacklevel=3,
            )
            if warned is not None:
                warned.add(key)
    return out


def _json_number(value: float) -> float | int | str:
    # JSON has no NaN or infinity. Strings keep the three cases apart (null would merge
    # them) and every JSON reader accepts them; memfit.monitor.report reads them back.
    if math.isfinite(value):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


class JSONLSink:
    """Append one JSON object per ``log`` call to ``path``: ``{"step": step, **metrics}``.

    Values are numbers only (non-numeric metrics are dropped with a warning); integral
    values are written as integers. Non-finite values are written as the strings
    ``"nan"``, ``"inf"`` and ``"-inf"``, since JSON has no such numbers. Each line is
    flushed, so a crash loses at most the line being written, and readers skip a
    half-written last line (:func:`memfit.monitor.report.load_run` does).

    Args:
        path: the file, created with its directory if needed; appended to if it exists.
        all_ranks: write on every rank; default only on rank 0 (other ranks do nothing).

    Example::

        sink = JSONLSink("runs/exp1/metrics.jsonl")
        sink.log(10, {"loss": 2.31, "amp/scale": 8192.0})
        sink.close()
    """

    def __init__(self, path: str | os.PathLike[str], all_ranks: bool = False) -> None:
        self.path = Path(path)
        self.enabled = all_ranks or is_rank_zero()
        self._file: IO[str] | None = None
        self._warned: set[str] = set()
        if self.enabled:
            check_log_dir(self.path.parent)
            try:
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"cannot open metrics file {self.path}: {exc.strerror or exc}"
                ) from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one line for ``step`` and flush it."""
        if not self.enabled:
            return
        if self._file is None:
            raise ConfigError(f"JSONLSink({self.path}) is closed; create a new sink to log again")
        row: dict[str, float | int | str] = {"step": int(step)}
        for key, value in numeric_metrics(metrics, self._warned).items():
            if key != "step":
                row[key] = _json_number(value)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


# CRC-32C (Castagnoli), the checksum of TFRecord framing: reflected polynomial 0x82F63B78,
# one table lookup per byte. Event records are a few hundred bytes per log call, so a
# pure-Python loop costs well under a millisecond there.
def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = ((crc >> 1) ^ 0x82F63B78) if crc & 1 else (crc >> 1)
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def _crc32c(data: bytes) -> int:
    """CRC-32C of ``data``; ``_crc32c(b"123456789") == 0xE3069283``."""
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc32c(data: bytes) -> int:
    # TFRecord stores the CRC rotated and offset, so that a CRC over bytes that themselves
    # hold CRCs does not degenerate.
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tfrecord(data: bytes) -> bytes:
    """One TFRecord: length (uint64), its masked CRC, the data, the data's masked CRC."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", _masked_crc32c(length))
        + data
        + struct.pack("<I", _masked_crc32c(data))
    )


def _event_protos() -> tuple[Any, Any]:
    """tensorboard's ``event_pb2`` and ``summary_pb2`` (protobuf classes only: importing
    them does not import TensorFlow, unlike ``torch.utils.tensorboard``). ImportError
    without the tensorboard package."""
    # import_module on the full names: a test's None in sys.modules hides them.
    event_pb2 = importlib.import_module("tensorboard.compat.proto.event_pb2")
    summary_pb2 = importlib.import_module("tensorboard.compat.proto.summary_pb2")
    return event_pb2, summary_pb2


# Numbers event files made by this process, so two writers started in the same second
# in one directory get different names.
_FILE_NUMBERS = itertools.count()


class EventFileWriter:
    """A TensorBoard event file of scalars, written without TensorFlow.

    The file is ``events.out.tfevents.<time>.<host>.<pid>.<n>`` in ``log_dir`` (which must
    exist): TFRecords of ``Event`` protos, the first a ``file_version`` record, then one
    event per :meth:`add_scalars` call holding every scalar of that step. Writes are
    buffered until :meth:`flush` or :meth:`close`. Needs the ``tensorboard`` package (its
    protobuf classes); raises ImportError without it.

    Example::

        writer = EventFileWriter(Path("runs/exp1/tb"))
        writer.add_scalars(10, {"loss": 2.31, "lr": 1e-3})
        writer.close()    # tensorboard --logdir runs/exp1/tb
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self._event_pb2, self._summary_pb2 = _event_protos()
        self.log_dir = Path(log_dir)
        self._file: IO[bytes] | None = None
        stamp = int(time.time())
        host, pid = socket.gethostname(), os.getpid()
        while True:
            name = f"events.out.tfevents.{stamp:010d}.{host}.{pid}.{next(_FILE_NUMBERS)}"
            self.path = self.log_dir / name
            try:
                # "x": never append to, or truncate, a file another writer holds.
                self._file = open(self.path, "xb")
                break
            except FileExistsError:
                continue
        self._write(self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Write one event at ``step`` with each of ``values`` as a scalar (tag = key),
        stored as float32 as TensorBoard keeps scalars; nothing when ``values`` is empty."""
        if self._file is None:
            raise ValueError(f"EventFileWriter({self.path}) is closed")
        if not values:
            return
        summary = self._summary_pb2.Summary(
            value=[
                self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                for tag, value in values.items()
            ]
        )
        event = self._event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time,
            step=int(step),
            summary=summary,
        )
        self._write(event)

    def _write(self, event: Any) -> None:
        assert self._file is not None
        self._file.write(_tfrecord(event.SerializeToString()))

    def flush(self) -> None:
        """Write the buffered events to the file."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """Write each metric as a TensorBoard scalar (tag = metric name) into an event file.

    Needs the ``tensorboard`` package (``pip install memfit[tensorboard]``); without it the
    constructor raises :class:`memfit.errors.ConfigError`. The file is written by
    :class:`EventFileWriter`, which uses tensorboard's protobuf classes only, so a
    PyTorch run never imports TensorFlow even where it is installed. Events are flushed
    on each ``log`` call (or every ``flush_every``-th), so TensorBoard shows them while
    training runs; values are stored as float32, as TensorBoard keeps scalars.

    Args:
        log_dir: the event file directory, created if needed.
        all_ranks: write on every rank; default only on rank 0.
        flush_every: flush after every this many ``log`` calls (1: always).

    Example::

        sink = TensorBoardSink("runs/exp1/tb")
        sink.log(10, {"loss": 2.31})
        sink.close()
        # tensorboard --logdir runs/exp1/tb
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], all_ranks: bool = False, flush_every: int = 1
    ) -> None:
        if int(flush_every) != flush_every or flush_every < 1:
            raise ConfigError(f"flush_every must be an int >= 1, got {flush_every}")
        self.log_dir = Path(log_dir)
        self.enabled = all_ranks or is_rank_zero()
        self.flush_every = int(flush_every)
        self._writer: EventFileWriter | None = None
        self._calls = 0
        self._warned: set[str] = set()
        if not self.enabled:
            return
        try:
            _event_protos()
        except ImportError:
            raise ConfigError(
                "TensorBoardSink needs the tensorboard package: pip install memfit[tensorboard]"
            ) from None
        check_log_dir(self.log_dir)
        try:
            self._writer = EventFileWriter(self.log_dir)
        except OSError as exc:
            raise ConfigError(
                f"cannot create an event file in {self.log_dir}: {exc.strerror or exc}; "
                "choose a writable directory"
            ) from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add every metric as a scalar at ``step``."""
        if not self.enabled:
            return
        if self._writer is None:
            raise ConfigError(
                f"TensorBoardSink({self.log_dir}) is closed; create a new sink to log again"
            )
        values = numeric_metrics(metrics, self._warned)
        values.pop("step", None)
        self._writer.add_scalars(int(step), values)
        self._calls += 1
        if self._calls % self.flush_every == 0:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# What the console shows by default, in this order, when present.
DEFAULT_CONSOLE_KEYS: tuple[str, ...] = (
    "loss",
    "val/loss",
    "lr",
    "grad/norm",
    "amp/scale",
    "amp/overflow_rate_recent",
    "throughput/samples_per_second",
    "throughput/tokens_per_second",
    "memory/peak_bytes",
    "time/step_seconds",
)


def _console_value(key: str, value: float) -> str:
    if key.endswith("_bytes") and math.isfinite(value):
        from memfit.units import format_bytes

        return format_bytes(int(value))
    if key.endswith("rate_recent") or key.endswith("_rate") or key.endswith("_share"):
        return f"{100.0 * value:.2f}%"
    if key.endswith("per_second"):
        return f"{value:,.1f}"
    return f"{value:.4g}"


class ConsoleSink:
    """Print one line per ``log`` call with rich, e.g. ``step 100  loss 2.31  amp/scale 8192``.

    Prints on rank 0 only: where ``torch.distributed`` is initialized and this process's
    rank is not 0 it stays silent.

    Args:
        keys: the metrics to show, in order; default :data:`DEFAULT_CONSOLE_KEYS` (those
            present). ``()`` shows every metric.
        console: a ``rich.console.Console``; default a new one on stdout.

    Example::

        sink = ConsoleSink(keys=("loss", "amp/scale"))
        sink.log(100, {"loss": 2.31, "amp/scale": 8192.0})
    """

    def __init__(self, keys: Sequence[str] | None = None, console: Any = None) -> None:
        from rich.console import Console

        self.keys: tuple[str, ...] | None = (
            None if keys is not None and len(keys) == 0 else tuple(keys or DEFAULT_CONSOLE_KEYS)
        )
        self.console = console if console is not None else Console()
        self._warned: set[str] = set()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print the chosen metrics for ``step`` (on rank 0)."""
        if not is_rank_zero():
            return
        values = numeric_metrics(metrics, self._warned)
        keys: Iterable[str] = self.keys if self.keys is not None else sorted(values)
        parts = [f"[bold]step {int(step)}[/]"]
        for key in keys:
            if key in values and key != "step":
                parts.append(f"{key} [cyan]{_console_value(key, values[key])}[/]")
        self.console.print("  ".join(parts), highlight=False)

    def close(self) -> None:
        """Nothing to release."""


class MultiSink:
    """Send every ``log`` to several sinks; ``close`` closes them all (even if one fails).

    Example::

        sinks = MultiSink([JSONLSink(path), ConsoleSink()])
    """

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks: list[Sink] = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise ConfigError(
                    f"{type(sink).__name__} is not a sink: it needs log(step, metrics) and close()"
                )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log to each sink in order."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close each sink; the first error is raised after all were tried."""
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # close the rest before reporting
                first = first or exc
        if first is not None:
            raise first
