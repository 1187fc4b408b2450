"""How ``memfit train`` starts a run: its settings from the flags (a resumed run's from its
``config.json``), and its directory, made only once everything else is built.

A start that fails leaves the disk as it was: ``memfit train`` builds the model, the
Engine (resumed from its checkpoint) and the checkpoint plan in memory first, with the
Engine's sinks not yet open (:class:`RunSinks`); only then does
:func:`undone_on_failure` create the directory and write ``config.json``.

On ``--resume`` a flag may change only what :data:`RESUMABLE` lists (those are applied
and reported); any other flag that differs from the saved value is an error naming each
one (:func:`resume_settings`).

Example::

    start = new_run(given, TRAIN_DEFAULTS, out=None)        # nothing on disk yet
    sinks = RunSinks(start.run_dir)
    engine = memfit.Engine(model, optimizer, sinks=[sinks])  # ... everything in memory
    with undone_on_failure(start.run_dir):
        start.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(start.run_dir / CONFIG, start.settings)
        sinks.open()
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.cli.common import UsageError, model_config_cls, parse_overrides

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"

#: Settings a resumed run may change, and why that is meaningful. Every other setting
#: shapes the run's past (its model, data, precision, batches, schedule or plan), so
#: changing it on resume is refused.
RESUMABLE: dict[str, str] = {
    "steps": "train longer (or stop sooner; the learning-rate schedule keeps the length the "
    "run started with, and past it the rate stays at its floor)",
    "log_every": "read metrics more or less often",
    "eval_every": "validate more or less often",
    "eval_batches": "validate on more or fewer batches",
    "save_every": "save more or less often",
}


@dataclass
class RunStart:
    """Where a run goes and what it does, decided before anything is written.

    Example::

        start = new_run({"steps": 50}, TRAIN_DEFAULTS, out="runs/a")
        start.settings["steps"]   # 50
    """

    run_dir: Path
    settings: dict[str, Any]
    resuming: bool = False
    applied: list[str] = field(default_factory=list)
    """On resume, the flags applied over the saved settings, as ``--steps 800 (was 300)``."""

    @property
    def config_changed(self) -> bool:
        """True when ``config.json`` is to be written: a new run, or applied flags."""
        return not self.resuming or bool(self.applied)


def flag(key: str) -> str:
    """The command-line flag of a setting: ``batch_size`` → ``--batch-size``."""
    return "--set" if key == "overrides" else "--" + key.replace("_", "-")


def new_run(given: Mapping[str, Any], defaults: Mapping[str, Any], out: str | None) -> RunStart:
    """A new run's settings (``defaults`` updated by the ``given`` flags) and directory
    (``out``, or ``runs/<model>-<precision>-<time>``); refuses a directory that already
    holds a run or is a file. Writes nothing.

    Example::

        start = new_run({"model": "gpt"}, TRAIN_DEFAULTS, out=None)
    """
    settings = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    name = out or (
        f"runs/{settings['model']}-{settings['precision']}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    run_dir = Path(name)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file; give a directory")
    if (run_dir / CHECKPOINT).exists() or (run_dir / CONFIG).exists():
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
            "or --out to start a new one"
        )
    return RunStart(run_dir, settings)


def resume_settings(
    resume: str,
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    out: str | None,
    device: torch.device,
) -> RunStart:
    """A resumed run's directory and settings: those in its ``config.json``, with the
    given flags of :data:`RESUMABLE` applied. Any other given flag whose value differs
    from the saved one is a usage error naming each flag, the saved and the given value.
    Writes nothing. (The Engine's own settings come back from its state file with
    :func:`memfit.engine.state.read_resume_point`, inside ``Engine.resume``.)

    Example::

        start = resume_settings("runs/a", {"steps": 800}, TRAIN_DEFAULTS, None, device)
        start.applied   # ['--steps 800 (was 300)']
    """
    run_dir = Path(resume)
    if run_dir.is_file():
        run_dir = run_dir.parent
    config_path = run_dir / CONFIG
    if not config_path.is_file():
        raise UsageError(f"--resume {resume}: no {CONFIG} there; is it a memfit run directory?")
    if out is not None and Path(out).resolve() != run_dir.resolve():
        raise UsageError(
            f"--resume {resume} continues the run in its own directory; drop --out {out}, "
            f"or drop --resume to start a new run in {out}"
        )
    if not (run_dir / CHECKPOINT).is_file():
        previous = run_dir / PREVIOUS
        hint = (
            f"copy {previous} to {run_dir / CHECKPOINT} to resume from the one before, or "
            if previous.is_file()
            else ""
        )
        raise UsageError(
            f"--resume {resume}: no {CHECKPOINT} there (the run stopped before its first "
            f"save); {hint}start a new run with --out NEW_DIR"
        )
    try:
        saved = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume {resume}: cannot read {config_path} ({exc})") from None
    settings = {**defaults, **saved}
    applied, conflicts = [], []
    for key, value in given.items():
        if key not in defaults or _same(key, value, settings[key], settings, device):
            continue
        if key in RESUMABLE:
            applied.append(f"{flag(key)} {value} (was {settings[key]})")
            settings[key] = value
        else:
            conflicts.append(f"{_given(key, value)} (saved: {_show(key, settings[key])})")
    if conflicts:
        may = ", ".join(flag(k) for k in RESUMABLE)
        raise UsageError(
            f"--resume {resume}: these flags differ from the run's saved settings "
            f"({config_path}): {'; '.join(conflicts)}. A resumed run keeps its settings: drop "
            f"these flags, or start a new run with --out NEW_DIR. On resume only {may} and "
            "--device may change."
        )
    return RunStart(run_dir, settings, resuming=True, applied=applied)


def _same(key: str, given: Any, saved: Any, settings: Mapping[str, Any], device: Any) -> bool:
    """Whether a given flag asks for what the run already has (aliases and spellings of the
    same value are the same)."""
    from memfit.precision.policy import resolve_mode
    from memfit.units import parse_bytes

    if key == "precision":
        if "auto" in (str(given).strip().lower(), str(saved).strip().lower()):
            return str(given).strip().lower() == str(saved).strip().lower()
        return resolve_mode(given) == resolve_mode(saved)
    if key == "overrides":
        config_cls = model_config_cls(settings["model"])
        return parse_overrides(given, config_cls) == parse_overrides(saved, config_cls)
    if key == "budget" and given is not None and saved is not None:
        return parse_bytes(given, device) == parse_bytes(saved, device)
    if key == "checkpoint":
        return str(given).strip().lower() == str(saved).strip().lower()
    return bool(given == saved)


def _show(key: str, value: Any) -> str:
    if key == "overrides":
        return " ".join(f"--set {item}" for item in value) if value else "none"
    return "none" if value is None else str(value)


def _given(key: str, value: Any) -> str:
    """A given setting as it reads on the command line."""
    if key == "overrides":
        return _show(key, value)
    return f"{flag(key)} {_show(key, value)}"


class RunSinks:
    """The run directory's sinks (``metrics.jsonl``, TensorBoard events when tensorboard
    is installed), opened by :meth:`open` once the directory is made: an Engine given this
    object as its sink writes nothing until then. Rows logged before are kept and written
    on opening.

    Example::

        sinks = RunSinks(Path("runs/a"))
        engine = memfit.Engine(model, optimizer, sinks=[sinks])   # nothing on disk
        sinks.open()                                              # now the files exist
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.sinks: list[Any] | None = None
        self._pending: list[tuple[int, dict[str, float]]] = []

    def open(self) -> None:
        """Create the sinks' files and write what was logged before."""
        from memfit.monitor.sinks import JSONLSink, TensorBoardSink

        self.sinks = [JSONLSink(self.run_dir / "metrics.jsonl")]
        try:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        except Exception:  # tensorboard is optional: the JSONL log has everything
            pass
        for step, metrics in self._pending:
            self.log(step, metrics)
        self._pending.clear()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.sinks is None:
            self._pending.append((step, dict(metrics)))
            return
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks or ():
            sink.close()


@contextmanager
def undone_on_failure(run_dir: Path) -> Iterator[None]:
    """Inside the block, ``run_dir`` (and missing parents) and files in it may be
    created; when the block raises, everything created there is removed again, so the
    disk is as it was (an existing directory keeps its files, a new one is gone).

    Example::

        with undone_on_failure(Path("runs/a")):
            Path("runs/a").mkdir(parents=True, exist_ok=True)
            write_json(Path("runs/a/config.json"), settings)
    """
    top = None  # the outermost directory this block will create
    for parent in (run_dir, *run_dir.parents):
        if parent.exists():
            break
        top = parent
    before = set(run_dir.rglob("*")) if top is None else set()
    try:
        yield
    except BaseException:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        else:
            # Deepest first: a new directory is emptied before it is removed.
            for path in sorted(set(run_dir.rglob("*")) - before, reverse=True):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename, so a crash
    never leaves half a file.

    Example::

        write_json(Path("runs/a/summary.json"), {"steps": 300})
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
