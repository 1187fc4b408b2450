"""A run directory's logs, read back: ``metrics.jsonl`` and the JSON files beside it.

A run directory (what ``memfit train`` or an Engine's ``log_dir`` writes) holds
``metrics.jsonl`` (one JSON object per logged step), ``summary.json``, ``config.json``,
and optionally ``health.json`` and ``plan.json``. :func:`load_run` reads them into a
:class:`RunLog`, which the report (:mod:`memfit.monitor.report`) draws and the advice
(:mod:`memfit.monitor.advice`) reads; both import it from here. The JSON files are
written by :func:`write_json` (atomically), by ``memfit train`` and by the Engine alike
(:mod:`memfit.engine.run_files`).

Example::

    run = load_run("runs/exp1")
    steps, losses = run.series("loss")
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

__all__ = ["RunLog", "as_number", "load_run", "write_json"]

#: The files of a run directory.
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"
HEALTH = "health.json"
PLAN = "plan.json"

_NONFINITE = {
    "nan": math.nan,
    "NaN": math.nan,
    "inf": math.inf,
    "Infinity": math.inf,
    "-inf": -math.inf,
    "-Infinity": -math.inf,
}


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a logged number: a bool, an int, a float, or a
    non-finite value written as a string (``"nan"``, ``"inf"``); None otherwise.

    Example::

        as_number("inf"), as_number(3), as_number("fast")   # (inf, 3.0, None)
    """
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value)
    return None


@dataclass
class RunLog:
    """A run directory's logs, read by :func:`load_run`.

    Example::

        run = load_run("runs/exp1")
        steps, losses = run.series("loss")
    """

    run_dir: Path
    """The run directory."""
    records: list[dict[str, float]]
    """The numeric entries of each valid line of ``metrics.jsonl``, in file order."""
    summary: dict[str, Any] = field(default_factory=dict)
    """``summary.json`` (empty when absent, e.g. after a crash)."""
    config: dict[str, Any] = field(default_factory=dict)
    """``config.json`` (empty when absent)."""
    health: dict[str, Any] | None = None
    """``health.json`` when present."""
    plan: dict[str, Any] | None = None
    """``plan.json`` when present."""
    skipped_lines: int = 0
    """Lines of ``metrics.jsonl`` that were malformed and skipped."""

    def keys(self) -> set[str]:
        """Every metric name that appears in some record."""
        return {k for r in self.records for k in r}

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of the records that hold ``key`` and a step."""
        steps, values = [], []
        for r in self.records:
            if key in r and "step" in r:
                steps.append(r["step"])
                values.append(r[key])
        return steps, values

    def latest(self) -> dict[str, float]:
        """The last logged value of every metric."""
        out: dict[str, float] = {}
        for r in self.records:
            out.update(r)
        return out

    @property
    def precision(self) -> str | None:
        """The run's precision mode: what it trained in (``summary.json``), else what it
        asked for (``config.json``; ``"auto"`` names no mode)."""
        value = self.summary.get("precision") or self.config.get("precision")
        return str(value) if value and value != "auto" else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: not readable JSON ({exc}); ignored", stacklevel=3)
        return None
    if not isinstance(data, dict):
        warnings.warn(
            f"{path}: expected a JSON object, got {type(data).__name__}; ignored", stacklevel=3
        )
        return None
    return data


def load_run(run_dir: str | os.PathLike[str]) -> RunLog:
    """Read a run directory's ``metrics.jsonl`` and its JSON files.

    A malformed line of ``metrics.jsonl`` (such as the half-written last line of a run that
    crashed) is skipped with a ``warnings.warn`` naming the file and line number; the rest
    is read. Non-finite values written as ``"nan"``/``"inf"``/``"-inf"`` (or as bare
    ``NaN``/``Infinity``) are read back as floats; non-numeric values are ignored.

    Raises :class:`memfit.errors.ConfigError` when the directory does not exist or holds
    no metrics.

    Example::

        run = load_run("runs/exp1")
        print(run.latest()["loss"], run.summary.get("peak_memory_bytes"))
    """
    directory = Path(run_dir)
    if not directory.exists():
        raise ConfigError(
            f"run directory {directory} does not exist; give the directory a run wrote"
        )
    if not directory.is_dir():
        raise ConfigError(f"{directory} is a file, not a run directory")
    path = directory / METRICS
    if not path.is_file():
        raise ConfigError(
            f"{directory} holds no {METRICS}, so there is nothing to report; is it a memfit "
            "run directory (memfit train --out DIR writes one)?"
        )
    records: list[dict[str, float]] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            except ValueError as exc:
                skipped += 1
                warnings.warn(
                    f"{path}:{lineno}: skipped a malformed line ({exc}); "
                    "a crashed run can leave its last line half-written",
                    stacklevel=2,
                )
                continue
            record = {
                k: v for k, v in ((k, as_number(v)) for k, v in data.items()) if v is not None
            }
            if record:
                records.append(record)
    if not records:
        raise ConfigError(
            f"{path} holds no metrics (no valid line); the run may have stopped before its "
            "first log step"
        )
    return RunLog(
        run_dir=directory,
        records=records,
        summary=_read_json(directory / SUMMARY) or {},
        config=_read_json(directory / CONFIG) or {},
        health=_read_json(directory / HEALTH),
        plan=_read_json(directory / PLAN),
        skipped_lines=skipped,
    )


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON (indented, keys sorted) to ``path`` atomically: a temp file,
    fsynced and renamed into place (:func:`memfit.savefile.write_atomically`), so a kill
    never leaves half a file; the file gets the mode a plain ``open()`` would. Non-finite
    floats are written as ``NaN``/``Infinity``, which :func:`load_run` reads back.

    Example::

        write_json(Path("runs/a/summary.json"), {"steps": 300})
    """
    from memfit.savefile import write_atomically  # torch, which reading does not need

    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return write_atomically(path, lambda f: f.write(text.encode("utf-8")))
