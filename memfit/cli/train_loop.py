"""``memfit train``'s training loop and its end: the steps with a progress bar, validation
and saving on schedule, a clean stop on SIGTERM/SIGINT, and the summary, health checks and
report of a finished run (:mod:`memfit.cli.train_command` builds the run and calls these).

Each session of a run records, with every state it saves, the losses so far and the samples
and seconds trained since step 0 (:class:`Outcome`): the session that resumes it carries
them on, and a command run again on a finished run writes the summary from them.

Example::

    outcome = train_loop(job, console)   # Preempted on a signal, after saving
    finish(job, outcome, console)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.cli.run_dir import save_state, write_json

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from memfit.engine import Engine
    from memfit.precision.scaler import ScalerStats

EVAL_SEED = 1_000_003


def batch_at(batch_fn: Any, size: int, seed: int, split: str = "train") -> Any:
    """The batch of ``size`` samples the built-in data draws with ``seed``: the run's batch
    of step ``k`` is drawn with :func:`step_seed`, so a resumed run trains on the batches
    the uninterrupted one did, with no data state to save."""
    return batch_fn(size, generator=seed, split=split)


def step_seed(seed: int, step: int) -> int:
    """The seed of the training batch that follows step ``step`` of a run seeded ``seed``."""
    return seed * 1_000_003 + step


def validation_loss(
    engine: Any, loss_fn: Any, batch_fn: Any, batch_size: int, batches: int
) -> float:
    """:func:`memfit.evaluate` on the run's validation batches: ``batches`` of them drawn
    from the ``val`` split with fixed seeds, so every evaluation of a run (resumed or not)
    sees the same ones.

    Example::

        val = validation_loss(engine, loss_fn, batch_fn, batch_size=16, batches=8)
    """
    from memfit.engine import evaluate

    fixed = (batch_at(batch_fn, batch_size, EVAL_SEED + i, split="val") for i in range(batches))
    return evaluate(engine, fixed, loss_fn)


@dataclass
class Outcome:
    """What the training loop leaves for the summary: the last losses, and the samples and
    seconds of training since step 0 (the sessions before a resume included)."""

    train_loss: float
    val_loss: float
    samples_done: int
    elapsed: float

    def saved(self) -> dict[str, float]:
        """As saved with the state (``extra``), for the session that resumes it."""
        return {
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "samples": self.samples_done,
            "seconds": self.elapsed,
        }

    @classmethod
    def from_saved(cls, extra: dict[str, Any]) -> Outcome:
        """What a state's ``extra`` recorded (nothing for a state of an earlier memfit)."""
        return cls(
            float(extra.get("train_loss", math.nan)),
            float(extra.get("val_loss", math.nan)),
            int(extra.get("samples", 0)),
            float(extra.get("seconds", 0.0)),
        )


@dataclass
class Job:
    """A run ready to train: its settings, directory, Engine and data."""

    settings: dict[str, Any]
    run_dir: Path
    engine: Engine
    loss_fn: Any
    batch_fn: Any
    tokens_per_sample: int | None
    before: Outcome = field(default_factory=lambda: Outcome.from_saved({}))
    """What the sessions before this one trained (a resumed state's record)."""
    finished: bool = False
    """The run had reached its ``--steps`` already: nothing to train."""
    unreadable: list[Path] = field(default_factory=list)
    """State files that did not load: renamed at the first save."""


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # Each field holds its label and value, or nothing before the first log step (no
    # "loss -" placeholders for a window not read yet). A quiet console (a rank other than
    # 0) gets no bar: its refresh thread would draw nothing and could still be running when
    # the process exits.
    return Progress(
        TextColumn("step {task.completed:>5}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("{task.fields[scale]}"),
        TextColumn("{task.fields[mem]}"),
        TimeElapsedColumn(),
        console=console,
        disable=console.quiet,
    )


#: The progress bar's fields before the first log step: empty.
EMPTY_FIELDS = {"loss": "", "speed": "", "scale": "", "mem": ""}


def step_speed(metrics: dict[str, float], tokens_per_sample: int | None) -> str | None:
    """The training speed of the latest log window (the steps since the log step before,
    timed by the Engine): what the progress bar shows and the summary's "step throughput"
    row repeats. None when no window was read.

    Example::

        step_speed({"throughput/samples_per_second": 4.0}, 128)   # "512 tok/s"
    """
    sps = metrics.get("throughput/samples_per_second")
    if sps is None or not math.isfinite(sps) or sps <= 0:
        return None
    if tokens_per_sample:
        return f"{sps * tokens_per_sample:,.0f} tok/s"
    return f"{sps:,.1f} samples/s"


def _progress_fields(metrics: dict[str, float], tokens_per_sample: int | None) -> dict[str, str]:
    """The progress bar's loss, speed, scale and memory from a log step's metrics, each
    with its label; a value not measured is left out rather than shown as a dash."""
    from memfit.units import format_bytes

    loss, scale = metrics.get("loss"), metrics.get("amp/scale")
    peak = metrics.get("memory/peak_bytes")
    return {
        "loss": f"loss {loss:.4f}" if loss is not None and math.isfinite(loss) else "",
        "speed": step_speed(metrics, tokens_per_sample) or "",
        "scale": f"scale {scale:g}" if scale is not None else "",
        "mem": f"mem {format_bytes(peak)}" if peak else "",
    }


def train_loop(job: Job, console: Console) -> Outcome:
    """Train to ``steps`` with a progress bar, validating and saving on schedule. SIGTERM
    or SIGINT saves at the end of the current step and raises Preempted (every rank at the
    same step: :meth:`SignalStop.requested` is OR-ed over the ranks, and so is whether
    ``--save-every-minutes`` has passed, since a save is collective)."""
    from memfit.distributed import shard_batch
    from memfit.engine.preemption import Preempted, SignalStop

    s, engine, before = job.settings, job.engine, job.before
    minutes = s["save_every_minutes"]
    val_loss, train_loss = before.val_loss, before.train_loss
    started = last_save = time.perf_counter()
    samples_done = 0

    def record() -> Outcome:
        """The run so far: this session added to the sessions before it."""
        elapsed = before.elapsed + time.perf_counter() - started
        return Outcome(train_loss, val_loss, before.samples_done + samples_done, elapsed)

    def save() -> Path:
        nonlocal last_save
        path = save_state(engine, job.run_dir, s["keep"], record().saved(), job.unreadable)
        job.unreadable = []
        last_save = time.perf_counter()
        return path

    progress = _progress(console)
    with progress, SignalStop() as stop:
        task = progress.add_task("train", total=s["steps"], completed=engine.steps, **EMPTY_FIELDS)
        while engine.steps < s["steps"]:
            batch = batch_at(job.batch_fn, s["batch_size"], step_seed(s["seed"], engine.steps))
            engine.train_step(shard_batch(batch), job.loss_fn)
            samples_done += s["batch_size"]
            step = engine.steps
            last = step == s["steps"]
            if step % s["log_every"] == 0:
                train_loss = engine.metrics["loss"]
                progress.update(task, **_progress_fields(engine.metrics, job.tokens_per_sample))
            elif last:  # the final loss, read before the final save records it
                train_loss = engine.read_metrics()["loss"]
                progress.update(task, **_progress_fields(engine.metrics, job.tokens_per_sample))
            due = minutes is not None and time.perf_counter() - last_save >= 60 * minutes
            stopping, due = stop.requested(due)
            if stopping and not last:  # the last step finishes the run as usual
                raise Preempted(stop.received, step, save())
            if step % s["eval_every"] == 0 or last:
                val_loss = validation_loss(
                    engine, job.loss_fn, job.batch_fn, s["batch_size"], s["eval_batches"]
                )
                engine.log_metrics({"val/loss": val_loss})
                progress.console.print(f"step {step}: validation loss {val_loss:.4f}")
            if step % s["save_every"] == 0 or last or due:
                save()
            progress.update(task, completed=step)
    return record()


def finish(job: Job, outcome: Outcome | None, console: Console) -> None:
    """Write summary.json, health.json and plan.json, close the Engine, print the summary
    and health tables and write the report. ``outcome`` None: the run was finished before
    this command (a kill came after its last save): only what is missing is written, from
    the record saved with the last state."""
    from memfit.distributed import current_world
    from memfit.monitor import health_to_dict, make_report, render_health

    engine, run_dir = job.engine, job.run_dir
    stats = engine.scaler.stats
    if current_world().rank > 0:
        engine.close()
        return
    again = outcome is None
    logged = _logged_metrics(job.run_dir) if again else engine.metrics
    if outcome is None:
        outcome = _finished_outcome(job, logged)
    written: list[str] = []

    def write(name: str, writer: Any) -> None:
        if not (again and (run_dir / name).exists()):
            writer(run_dir / name)
            written.append(name)

    summary = _summary(job, outcome, logged)
    write("summary.json", lambda path: write_json(path, summary))
    checks = _health(job, logged) if again else engine.health()
    write("health.json", lambda path: write_json(path, health_to_dict(checks)))
    if engine.plan is not None and hasattr(engine.plan, "to_json"):
        write("plan.json", lambda path: path.write_text(engine.plan.to_json()))
    engine.close()
    if again:
        console.print(
            f"the run in {run_dir} is finished (step {engine.steps} of --steps "
            f"{job.settings['steps']}); nothing to train"
            + (f"; wrote what was missing: {', '.join(written)}" if written else "")
        )
    console.print(_summary_table(job, outcome, summary, stats))
    console.print(render_health(checks))
    try:
        _print_advice(run_dir, console)
    except Exception as exc:  # the run itself succeeded; advice is not worth failing it
        console.print(f"no advice: {exc}", style="yellow", markup=False)
    if again and (run_dir / "report" / "report.html").exists():
        console.print(f"report: {run_dir / 'report' / 'report.html'}")
        return
    try:
        report = make_report(run_dir)
        console.print(f"report: {report}")
    except Exception as exc:  # the run itself succeeded; a report problem is not fatal
        console.print(f"report not written: {exc}", style="yellow", markup=False)


def _logged_metrics(run_dir: Path) -> dict[str, float]:
    """The last logged value of each metric in ``metrics.jsonl`` (an Engine resumed at its
    last step has logged nothing yet); empty without one."""
    import warnings

    from memfit.monitor.run_log import load_run

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a half-written line a kill left: skipped
            return load_run(run_dir).latest()
    except Exception:  # no metrics: the summary and the checks say so
        return {}


def _finished_outcome(job: Job, logged: dict[str, float]) -> Outcome:
    """A finished run's outcome, from the record saved with its last state; what a state of
    an earlier memfit did not record comes from the log, or is measured again (the
    validation loss, on the same fixed batches)."""
    outcome = job.before
    if math.isnan(outcome.train_loss):
        outcome.train_loss = float(logged.get("loss", math.nan))
    if math.isnan(outcome.val_loss):
        s = job.settings
        outcome.val_loss = validation_loss(
            job.engine, job.loss_fn, job.batch_fn, s["batch_size"], s["eval_batches"]
        )
    return outcome


def _health(job: Job, logged: dict[str, float]) -> Any:
    """The health checks of a finished run, on its last logged metrics."""
    engine = job.engine
    has_plan = job.settings["checkpoint"] not in (None, "none")
    return engine.monitor.health(logged, engine.policy, engine.scaler.min_scale, has_plan)


def _print_advice(run_dir: Path, console: Console) -> None:
    """The advice block: from the run directory's records, so that a resumed run's advice
    covers the whole run (``memfit report RUN_DIR`` prints the same)."""
    from memfit.monitor import render_advice
    from memfit.tuning import run_advice

    console.print("[bold]advice[/] (memfit tune measures the choice; these read the run)")
    console.print(render_advice(run_advice(run_dir)), markup=False, soft_wrap=True)


def _summary(job: Job, outcome: Outcome, metrics: dict[str, float]) -> dict[str, Any]:
    """What summary.json holds (``metrics``: the latest)."""
    from memfit.engine.run_files import engine_summary

    engine, elapsed, samples = job.engine, outcome.elapsed, outcome.samples_done
    return {
        # The Engine's part, as an Engine's log_dir writes it (memfit.engine.run_files).
        **engine_summary(engine, metrics),
        "final_train_loss": outcome.train_loss,
        "final_val_loss": outcome.val_loss,
        # Over the run's wall time (start-up, validation and saves included) ...
        "samples_per_second": samples / elapsed if elapsed > 0 else 0.0,
        "tokens_per_second": samples * job.tokens_per_sample / elapsed
        if job.tokens_per_sample and elapsed > 0
        else None,
        # ... and over the latest log window's steps alone (what the progress bar showed).
        "step_samples_per_second": metrics.get("throughput/samples_per_second"),
        "wall_seconds": elapsed,
    }


def _summary_table(
    job: Job, outcome: Outcome, summary: dict[str, Any], stats: ScalerStats
) -> Table:
    from rich.table import Table

    from memfit.units import format_bytes

    engine = job.engine
    peak_bytes = summary["peak_memory_bytes"]
    table = Table(title="summary", show_header=False)
    table.add_row(
        "steps (applied / skipped)", f"{engine.steps} ({engine.applied_steps} / {stats.skipped})"
    )
    table.add_row("final train loss", f"{outcome.train_loss:.4f}")
    table.add_row("final validation loss", f"{outcome.val_loss:.4f}")
    table.add_row(
        "peak memory of a step", format_bytes(peak_bytes) if peak_bytes else "not measured"
    )
    # Two rates, each labelled with what it measures: the progress bar's (the Engine's
    # timing of the latest log window's steps) and the run's average over its wall time
    # (start-up, validation and saves included).
    speed = step_speed(
        {"throughput/samples_per_second": summary["step_samples_per_second"] or math.nan},
        job.tokens_per_sample,
    )
    if speed is not None:
        table.add_row("step throughput (progress bar)", speed)
    if job.tokens_per_sample:
        overall = f"{summary['tokens_per_second']:,.0f} tok/s"
    else:
        overall = f"{summary['samples_per_second']:,.1f} samples/s"
    table.add_row("run throughput (wall time)", overall)
    table.add_row("precision / loss scale", f"{engine.policy.mode} / {stats.scale:g}")
    table.add_row("wall time", f"{outcome.elapsed:.1f} s")
    table.add_row("run directory", str(job.run_dir))
    return table
