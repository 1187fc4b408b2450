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

import json
import math
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from memfit.errors import ConfigError

__all__ = [
    "ConsoleSink",
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


class TensorBoardSink:
    """Write each metric as a TensorBoard scalar (tag = metric name) with ``SummaryWriter``.

    Needs the ``tensorboard`` package (``pip install memfit[tensorboard]``); without it the
    constructor raises :class:`memfit.errors.ConfigError`. Events are flushed on each
    ``log`` call, so TensorBoard shows them while training runs.

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
        self._writer: Any = None
        self._calls = 0
        self._warned: set[str] = set()
        if not self.enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "TensorBoardSink needs the tensorboard package: pip install memfit[tensorboard]"
            ) from None
        check_log_dir(self.log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add every metric as a scalar at ``step``."""
        if not self.enabled:
            return
        if self._writer is None:
            raise ConfigError(
                f"TensorBoardSink({self.log_dir}) is closed; create a new sink to log again"
            )
        for key, value in numeric_metrics(metrics, self._warned).items():
            if key != "step":
                self._writer.add_scalar(key, value, global_step=int(step))
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
