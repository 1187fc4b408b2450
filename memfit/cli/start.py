"""How ``memfit train`` starts a run: its settings from the flags (a resumed run's from its
``config.json``), and its directory, made only once everything else is built.

A start that fails leaves the disk as it was: ``memfit train`` builds the model, the
Engine (resumed from its checkpoint) and the checkpoint plan in memory first, with the
Engine's sinks not yet open (:class:`RunSinks`); only then does
:func:`undone_on_failure` create the directory and write ``config.json``.

One command starts and restarts a run (:func:`start_run`): ``--out DIR`` (or ``--resume
DIR``) on a directory that holds a run's ``config.json`` continues that run from its newest
state file that loads, or from step 0 when it stopped before its first save
(:mod:`memfit.cli.run_dir`). A flag may then change only what :data:`RESUMABLE` lists
(those are applied and reported); any other flag that differs from the saved value is an
error naming each one with its saved value (:func:`resume_settings`).

Example::

    start = start_run(given, TRAIN_DEFAULTS, out=None, resume=None, device=device)
    sinks = RunSinks(start.run_dir)
    engine = memfit.Engine(model, optimizer, sinks=[sinks])  # ... everything in memory
    with undone_on_failure(start.run_dir):
        start.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(start.run_dir / CONFIG, start.settings)
        sinks.open()
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.cli.common import UsageError, model_config_cls, parse_overrides
from memfit.cli.run_dir import CONFIG, state_files, write_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG",
    "RESUMABLE",
    "RunSinks",
    "RunStart",
    "flag",
    "new_run",
    "resume_settings",
    "start_run",
    "undone_on_failure",
    "write_json",
]

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
    "save_every_minutes": "save more or less often",
    "keep": "keep more or fewer state files",
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
    """Whether the directory holds a run (its ``config.json``) that this start continues."""
    applied: list[str] = field(default_factory=list)
    """On resume, the flags applied over the saved settings, as ``--steps 800 (was 300)``."""
    state_files: list[Path] = field(default_factory=list)
    """On resume, the run's state files, newest first (none: it restarts at step 0)."""

    @property
    def config_changed(self) -> bool:
        """True when ``config.json`` is to be written: a new run, or applied flags."""
        return not self.resuming or bool(self.applied)


def flag(key: str) -> str:
    """The command-line flag of a setting: ``batch_size`` → ``--batch-size``."""
    return "--set" if key == "overrides" else "--" + key.replace("_", "-")


def start_run(
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    out: str | None,
    resume: str | None,
    device: torch.device,
) -> RunStart:
    """Where the command goes and what it does, for a start and a restart alike: ``--resume
    DIR``, or ``--out DIR`` where DIR holds a run's ``config.json``, continues that run
    (:func:`resume_settings`); else a new run (:func:`new_run`). Writes nothing.

    Example::

        start = start_run({"steps": 50}, TRAIN_DEFAULTS, out="runs/a", resume=None, device=cpu)
        start.resuming   # True when runs/a holds a run
    """
    if resume is None and out is not None and (Path(out) / CONFIG).is_file():
        return resume_settings(out, given, defaults, None, device)
    if resume is not None:
        return resume_settings(resume, given, defaults, out, device)
    return new_run(given, defaults, out)


def new_run(given: Mapping[str, Any], defaults: Mapping[str, Any], out: str | None) -> RunStart:
    """A new run's settings (``defaults`` updated by the ``given`` flags) and directory
    (``out``, or ``runs/<model>-<precision>-<time>``); refuses a directory that already
    holds a run (:func:`start_run` continues one), state files without a ``config.json``,
    or a file. Writes nothing.

    Example::

        start = new_run({"model": "gpt"}, TRAIN_DEFAULTS, out=None)
    """
    settings = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    factory = settings.get("factory")
    label = Path(factory.rpartition(":")[0]).stem if factory else settings["model"]
    name = out or f"runs/{label}-{settings['precision']}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(name)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file; give a directory")
    if (run_dir / CONFIG).exists():
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
            "or --out to start a new one"
        )
    found = state_files(run_dir)
    if found:
        raise UsageError(
            f"{run_dir} holds state files ({found[0].name}) but no {CONFIG}, so its settings "
            f"are unknown; restore {run_dir / CONFIG}, or start a new run with --out NEW_DIR"
        )
    return RunStart(run_dir, settings)


def resume_settings(
    resume: str,
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    out: str | None,
    device: torch.device,
) -> RunStart:
    """A resumed run's directory, settings and state files: the settings in its
    ``config.json``, with the given flags of :data:`RESUMABLE` applied. Any other given
    flag whose value differs from the saved one is a usage error naming each flag, the
    saved and the given value. A run without a state file yet (it stopped before its first
    save) resumes at step 0. Writes nothing. (The Engine's own settings come back from its
    state file with :func:`memfit.engine.state.read_resume_point`, inside
    ``Engine.resume``.)

    Example::

        start = resume_settings("runs/a", {"steps": 800}, TRAIN_DEFAULTS, None, device)
        start.applied   # ['--steps 800 (was 300)']
    """
    run_dir = Path(resume)
    if not run_dir.exists():
        raise UsageError(f"--resume {resume}: no such directory")
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
    try:
        saved = json.loads(config_path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"expected a JSON object, got {type(saved).__name__}")
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{run_dir}: cannot read {config_path} ({exc}); restore it, or start a new run "
            "with --out NEW_DIR"
        ) from None
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
            f"{run_dir} holds a run whose saved settings ({config_path}) these flags differ "
            f"from: {'; '.join(conflicts)}. A resumed run keeps its settings: drop these "
            f"flags, or start a new run with --out NEW_DIR. On resume only {may} and "
            "--device may change."
        )
    return RunStart(
        run_dir, settings, resuming=True, applied=applied, state_files=state_files(run_dir)
    )


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
