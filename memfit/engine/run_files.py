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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.monitor.run_log import CONFIG, PLAN, SUMMARY, write_json

__all__ = ["engine_config", "engine_summary", "write_config", "write_summary"]

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


def _write_plan(log_dir: Path, plan: Any) -> None:
    if plan is not None and hasattr(plan, "to_json"):
        text = plan.to_json()
        from memfit.savefile import write_atomically

        write_atomically(log_dir / PLAN, lambda f: f.write(text.encode("utf-8")))
