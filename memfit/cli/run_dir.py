"""A ``memfit train`` run directory as a kill can leave it, and its state files.

What the directory holds decides what running the same command again does
(:func:`memfit.cli.start.start_run`):

* no ``config.json``: a new run (``config.json`` is written before anything trains);
* ``config.json`` and no state file: the run stopped before its first save, and starts at
  step 0 with the saved settings;
* state files: the run continues from the newest one that loads (:func:`state_files`
  orders them; one that does not load is named, passed over and renamed
  ``*.unreadable`` at the next save);
* a state file at the run's ``--steps``: the run is finished; what a kill kept it from
  writing (``summary.json``, ``health.json``, the report) is written, and the command
  exits 0.

**State files** are ``checkpoint-<step>.pt``: the Engine writes each atomically (a temp file
``.checkpoint-<step>.pt.<random>.tmp``, fsynced, renamed into place, the directory
fsynced; :func:`memfit.savefile.write_atomically`), and after it the oldest beyond
``--keep`` are removed (:func:`rotate`). No complete state file is ever rewritten or
renamed, so a kill at any moment leaves every ``checkpoint-<step>.pt`` whole, and the
newest good one is the highest step that loads. A temp file a kill left mid-save is never
read, and is removed at the next start (:func:`remove_partial_files`). Run directories of
earlier memfit versions hold ``checkpoint.pt`` (the latest) and ``checkpoint.prev.pt``
(the one before): they are read as older than any numbered file, and rotated away like
them.

``metrics.jsonl`` rows past the step a run continues from (a killed attempt's) are dropped
when it continues (:func:`trim_metrics`), so the log reads as one run.

Nothing here imports torch at import time.

Example::

    files = state_files(Path("runs/a"))      # newest first: [.../checkpoint-200.pt, ...]
    save_state(engine, Path("runs/a"), keep=2, extra={})
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.engine import Engine

CONFIG = "config.json"
METRICS = "metrics.jsonl"
#: The state files of run directories written before numbered state files, newest first:
#: the old save's complete new file not yet renamed, the latest, the one before it.
LEGACY_STATE_FILES = ("checkpoint.pt.new", "checkpoint.pt", "checkpoint.prev.pt")
UNREADABLE = ".unreadable"

_NUMBERED = re.compile(r"^checkpoint-(\d+)\.pt$")
# What an atomic write of one of the run's files leaves when killed: ".<name>.<random>.tmp".
_PARTIAL = re.compile(
    r"^\.(checkpoint-\d+\.pt|checkpoint\.pt\.new|config\.json|summary\.json|health\.json"
    r"|plan\.json|tune\.json|metrics\.jsonl)\..+\.tmp$"
)


def state_file(run_dir: Path, step: int) -> Path:
    """The state file of step ``step``: ``run_dir/checkpoint-<step>.pt``."""
    return run_dir / f"checkpoint-{int(step)}.pt"


def step_of(path: Path) -> int | None:
    """The step in a numbered state file's name (None for another file)."""
    found = _NUMBERED.match(path.name)
    return int(found.group(1)) if found else None


def state_files(run_dir: Path) -> list[Path]:
    """The run's state files, newest first: numbered ones by step, then the older names
    of earlier memfit versions (:data:`LEGACY_STATE_FILES`).

    Example::

        state_files(Path("runs/a"))   # [runs/a/checkpoint-200.pt, runs/a/checkpoint-100.pt]
    """
    if not run_dir.is_dir():
        return []
    numbered = [(step_of(p), p) for p in run_dir.iterdir() if p.is_file()]
    newest = [p for n, p in sorted(((n, p) for n, p in numbered if n is not None), reverse=True)]
    legacy = [run_dir / name for name in LEGACY_STATE_FILES if (run_dir / name).is_file()]
    return newest + legacy


def partial_files(run_dir: Path) -> list[Path]:
    """Temp files that a kill during an atomic write left in ``run_dir`` (never read)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if _PARTIAL.match(p.name))


def remove_partial_files(run_dir: Path) -> list[Path]:
    """Remove :func:`partial_files`; return them."""
    removed = partial_files(run_dir)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def rotate(run_dir: Path, keep: int, unreadable: Iterable[Path] = ()) -> list[Path]:
    """After a save: rename the state files that did not load at the start (``unreadable``)
    to ``*.unreadable`` and remove all but the ``keep`` newest others; return what was
    removed. Rank 0 calls it, once the new state file is complete.

    Example::

        rotate(Path("runs/a"), keep=2)    # [runs/a/checkpoint-100.pt]
    """
    for path in unreadable:
        if path.is_file():
            os.replace(path, path.with_name(path.name + UNREADABLE))
    removed = state_files(run_dir)[keep:]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def save_state(
    engine: Engine,
    run_dir: Path,
    keep: int,
    extra: Mapping[str, Any],
    unreadable: Iterable[Path] = (),
) -> Path:
    """Save the Engine's state as ``checkpoint-<step>.pt`` (every rank calls it; rank 0
    writes, atomically) and :func:`rotate`; return the path.

    Example::

        save_state(engine, Path("runs/a"), keep=2, extra={"val_loss": 2.1})
    """
    from memfit.distributed import current_world

    path = engine.save(state_file(run_dir, engine.steps), extra=dict(extra))
    if current_world().rank == 0:  # one that did not load may just have been written over
        rotate(run_dir, keep, [p for p in unreadable if p != path])
    return path


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` past ``step`` (logged by an attempt that was
    killed after its last save) and half-written lines; return how many were dropped. The
    file is rewritten atomically, and only when something is dropped."""
    path = run_dir / METRICS
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            row_step = row.get("step") if isinstance(row, dict) else None
        except ValueError:
            row, row_step = None, None
        if not isinstance(row, dict) or (isinstance(row_step, int | float) and row_step > step):
            dropped += line.strip() != ""
            continue
        kept.append(line)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and a rename, so a kill never
    leaves half a file (:func:`memfit.savefile.write_atomically`, which the state files
    are written with too: every file of a run gets the mode a plain ``open()`` gives, 0644
    under the usual umask, not the temp file's private 0600)."""
    from memfit.savefile import write_atomically

    data = text.encode("utf-8")
    write_atomically(path, lambda f: f.write(data))


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically: the writer an Engine's ``log_dir``
    uses too (:func:`memfit.monitor.run_log.write_json`), so both write the same files.

    Example::

        write_json(Path("runs/a/summary.json"), {"steps": 300})
    """
    from memfit.monitor.run_log import write_json as write  # torch: not at import time

    write(path, data)
