"""The files beside ``metrics.jsonl`` that make an Engine's ``log_dir`` a run directory as
``memfit train`` writes one, so ``memfit report`` and :func:`memfit.tuning.run_advice`
know the run's budget, precision and plan:

* ``config.json`` (:func:`engine_config`) and ``plan.json``, once the first batch's choices
  are made (precision, split of the batch, checkpoint plan, budget);
* ``summary.json`` (:func:`engine_summary` and the Engine's own counts) and ``plan.json``
  again (the first step's measurement may have replaced the plan), at ``engine.close()``.

Each is written atomically (:func:`memfit.monitor.run_log.write_json`), by rank 0 alone
(the other ranks have no ``log_dir``). ``memfit train`` writes its ``summary.json`` with
:func:`memfit.monitor.run_log.write_json` too, with the same keys (the Engine's share of
them: :func:`engine_summary`).

Example::

    engine = memfit.Engine(model, opt, memory_budget="30MiB", log_dir="runs/a")
    ...                      # train: runs/a/config.json appears with the first step
    engine.close()           # runs/a/summary.json
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.monitor.run_log import CONFIG, PLAN, SUMMARY, write_json

__all__ = ["RunRecord", "engine_config", "engine_summary", "write_config", "write_summary"]

#: Who wrote a run directory's ``config.json`` (``memfit train`` writes its own settings).
WRITTEN_BY = "memfit.Engine"


def engine_config(engine: Any, budget_given: Any = None) -> dict[str, Any]:
    """What ``config.json`` holds for an Engine: the settings under the names ``memfit
    train``'s ``config.json`` gives them (``precision``, ``checkpoint``, ``budget``,
    ``accumulation``, ``clip``, ``log_every``, ``model``), with the first batch's choices
    made (``precision`` is the mode trained in, ``"auto"`` resolved), and the budget in
    bytes (``budget_bytes``; None: no budget). ``budget_given``: the budget as the Engine
    was given it (``"30MiB"``), written as ``budget``.
    """
    s = engine.settings
    auto = engine.auto
    plan = engine.plan
    budget = s.memory_budget
    return {
        "written_by": WRITTEN_BY,
        "model": type(engine.model).__name__,
        "precision": engine.policy.mode,
        "precision_chosen": auto.precision_choice is not None,
        "checkpoint": s.checkpoint,
        "budget": budget_given if isinstance(budget_given, str) else budget,
        "budget_bytes": budget,
        "accumulation": s.accumulation_steps,
        "micro_batch_chosen": auto.split_choice is not None,
        "clip": s.clip_grad_norm,
        "log_every": s.log_every,
        "device": str(engine.device),
        "tokens_per_sample": engine.tokens_per_sample,
        "plan": None if plan is None else getattr(plan, "strategy", "given"),
    }


def engine_summary(engine: Any, metrics: Mapping[str, float]) -> dict[str, Any]:
    """The part of ``summary.json`` the Engine knows, under ``memfit train``'s keys: its
    step counts, the peak memory of a step (``metrics``: the latest logged values), the
    precision and loss scale, and what the advice needs beyond the metrics (budget,
    accumulation, the scaler's start and growth interval)."""
    stats = engine.scaler.stats
    peak = metrics.get("memory/peak_bytes")
    return {
        "steps": engine.steps,
        "applied_steps": engine.applied_steps,
        "skipped_steps": stats.skipped,
        "peak_memory_bytes": peak if peak else None,
        "precision": engine.policy.mode,
        "loss_scale": stats.scale,
        "budget_bytes": engine.settings.memory_budget,
        "accumulation_steps": engine.settings.accumulation_steps,
        "init_scale": engine.scaler.init_scale,
        "growth_interval": engine.scaler.growth_interval,
    }


def write_config(log_dir: Path, engine: Any, budget_given: Any = None) -> None:
    """``config.json`` (:func:`engine_config`) and ``plan.json`` (when the Engine has a
    plan) in ``log_dir``."""
    write_json(log_dir / CONFIG, engine_config(engine, budget_given))
    _write_plan(log_dir, engine.plan)


def write_summary(
    log_dir: Path,
    engine: Any,
    metrics: Mapping[str, float],
    *,
    train_loss: float | None,
    val_loss: float | None,
    samples: int,
    seconds: float,
) -> None:
    """``summary.json`` of an Engine's run, with the keys ``memfit train`` writes:
    :func:`engine_summary`, the last losses, and the throughput over ``seconds`` of
    training (``samples`` trained in them), and ``plan.json`` again."""
    tokens = engine.tokens_per_sample
    summary = {
        **engine_summary(engine, metrics),
        "final_train_loss": math.nan if train_loss is None else train_loss,
        "final_val_loss": math.nan if val_loss is None else val_loss,
        # Over the steps' wall time (from the first step's start to the last one's end) ...
        "samples_per_second": samples / seconds if seconds > 0 else 0.0,
        "tokens_per_second": samples * tokens / seconds if tokens and seconds > 0 else None,
        # ... and over the latest log window's steps alone.
        "step_samples_per_second": metrics.get("throughput/samples_per_second"),
        "wall_seconds": seconds,
    }
    write_json(log_dir / SUMMARY, summary)
    _write_plan(log_dir, engine.plan)


@dataclass
class RunRecord:
    """What an Engine's ``config.json`` and ``summary.json`` hold beyond its own
    attributes, kept as it trains: the budget as it was given, and the samples, the wall
    time and the last validation loss of the steps this Engine object took. Writing either
    file with no ``log_dir`` does nothing, and an OSError writing it is a warning: the
    metrics still go to the sinks, and a finished training is not failed for a lost file.

    Example::

        record = RunRecord(budget_given="30MiB")
        record.step_began()
        ...                                     # the step
        record.step_ended(samples=8)
        record.write_summary(Path("runs/a"), engine, engine.monitor.records, loss)
    """

    budget_given: Any = None
    """The budget as the Engine was given it (``"30MiB"``), written as ``budget``."""
    samples: int = 0
    """Samples of the steps this object took (a resumed run's from its resume on)."""
    first_step_at: float | None = None
    """When its first step began (``time.perf_counter()``, after the first batch's choices)."""
    last_step_at: float | None = None
    """When its last step ended."""
    val_loss: float | None = None
    """The last ``"val/loss"`` given to ``Engine.log_metrics``."""

    def step_began(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()

    def step_ended(self, samples: int) -> None:
        self.samples += samples
        self.last_step_at = time.perf_counter()

    def write_config(self, log_dir: Path | None, engine: Any) -> None:
        """:func:`write_config`, once the first batch's choices are made."""
        if log_dir is None:
            return
        try:
            write_config(log_dir, engine, self.budget_given)
        except OSError as exc:  # the metrics still go to log_dir's sinks
            warnings.warn(f"config.json not written in {log_dir}: {exc}", stacklevel=4)

    def write_summary(
        self,
        log_dir: Path | None,
        engine: Any,
        records: Iterable[Mapping[str, float]],
        loss: Any,
    ) -> None:
        """:func:`write_summary` when the Engine trained a step: ``records``, the log
        records, the latest last (each key's latest value is written); ``loss``, the last
        step's loss tensor (one host sync reads it), or None."""
        if log_dir is None or self.last_step_at is None:
            return
        latest: dict[str, float] = {}
        for record in records:
            latest.update(record)
        started = self.first_step_at or self.last_step_at
        try:
            write_summary(
                log_dir,
                engine,
                latest,
                train_loss=None if loss is None else float(loss.item()),
                val_loss=self.val_loss,
                samples=self.samples,
                seconds=self.last_step_at - started,
            )
        except OSError as exc:  # the training is done; a lost summary is not worth failing it
            warnings.warn(f"summary.json not written in {log_dir}: {exc}", stacklevel=3)


def _write_plan(log_dir: Path, plan: Any) -> None:
    if plan is not None and hasattr(plan, "to_json"):
        text = plan.to_json()
        from memfit.savefile import write_atomically

        write_atomically(log_dir / PLAN, lambda f: f.write(text.encode("utf-8")))
