"""Tuning advice from what the tuner saw (the loss scale, the checkpoint interval, the
split), and from what the monitor saw during a run (:func:`run_advice`).

Each tuner function returns one sentence, printed with the choice (``TuneResult.advice``);
:func:`run_advice` returns :class:`~memfit.monitor.advice.Advice` records, computed by
:func:`memfit.monitor.advice.advise` from an Engine's monitor or a run directory.

Example::

    loss_scale_advice(GradStats(amax=0.8, underflow_fraction=0.02), "bf16-mixed")
    for item in memfit.tuning.run_advice(engine):
        print(item.topic, item.text)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from memfit.engine import Engine
from memfit.monitor.advice import Advice, RunFacts, advise, advise_run
from memfit.monitor.plan_counts import plan_unit_counts, recomputed_units
from memfit.monitor.report import RunLog
from memfit.precision.scaler import FP16_MAX, suggest_initial_scale
from memfit.tuning.result import TuneRow
from memfit.tuning.trials import GradStats
from memfit.units import format_bytes

#: Headroom the tuner keeps between the largest scaled gradient and fp16's largest value:
#: twice the default (:data:`~memfit.precision.scaler.INITIAL_SCALE_HEADROOM`), because
#: the trials measure the gradients of the first steps, and gradients grow early in
#: training (an overflow skips a step).
HEADROOM = 2.0**4


def initial_loss_scale(stats: GradStats) -> float:
    """The largest power of two that keeps the largest gradient :data:`HEADROOM` below
    fp16's largest value, between 1 and 2^24 (:func:`~memfit.precision.scaler.suggest_initial_scale`).

    Example::

        initial_loss_scale(GradStats(amax=0.5, underflow_fraction=0.0))  # 4096.0
    """
    return suggest_initial_scale(stats.amax, headroom=HEADROOM)


def loss_scale_advice(stats: GradStats | None, precision: str) -> str:
    """What loss scale the gradients call for, under ``precision``."""
    if stats is None:
        return "loss scale: no gradients were measured (no trial ran)"
    scale = initial_loss_scale(stats)
    seen = (
        f"the largest gradient is {stats.amax:.3g} and {stats.underflow_fraction:.1%} of the "
        "nonzero gradient values are below fp16's smallest (2^-24)"
    )
    if precision.startswith("fp16"):
        return (
            f"loss scale: start at 2^{int(math.log2(scale))} = {scale:g} "
            f"(LossScaler(init_scale={scale:g})): {seen}, and 2^{int(math.log2(scale))} keeps "
            f"the largest {HEADROOM:g}x below fp16's {FP16_MAX:g}"
        )
    return (
        f"loss scale: none needed in {precision} (fp32's exponent range); {seen}, so fp16 "
        f"would start at LossScaler(init_scale={scale:g})"
    )


def checkpoint_advice(best: TuneRow, units: int | None) -> str:
    """The checkpoint interval the choice implies for a model of ``units`` blocks.

    The units recomputed and the FLOPs share come from one source, the chosen row's plan
    (:func:`~memfit.monitor.plan_counts.plan_unit_counts` of its decisions and segments, and its
    ``recompute_flops`` over the forward's): FLOPs are matmul FLOPs, so a unit recomputed
    selectively (its matmul outputs kept) adds none, and the sentence says so."""
    counts = plan_unit_counts(best.plan.decisions, best.plan.segments) if best.plan else None
    if counts is not None and counts.units:
        units = counts.units
    depth = f"{units} units" if units else "the model's units"
    if best.checkpoint == "none":
        return f"checkpointing: none needed; all {depth} keep their activations within the budget"
    if best.checkpoint == "full":
        interval = "every unit"
    elif best.checkpoint == "sqrt" and units:
        interval = f"segments of about {max(1, round(math.sqrt(units)))} (sqrt of {units})"
    elif counts is not None and units:
        interval = f"{counts.recomputed} recomputed"
    else:
        interval = "the optimal plan at the budget"
    fraction = best.recompute_fraction or 0.0
    text = (
        f"checkpointing: {best.checkpoint}, {interval} of {depth}; recomputes "
        f"{fraction:.1%} of a forward pass's matmul FLOPs per micro-batch"
    )
    if counts is not None and counts.selective:
        whole = f"{counts.whole} whole, " if counts.whole else ""
        text += (
            f" ({whole}{counts.selective} selectively: those keep their matmul outputs and "
            "rebuild only the elementwise ops between them, which add no matmul FLOPs)"
        )
    return text


def split_advice(rows: Sequence[TuneRow], best: TuneRow, budget: int) -> str:
    """Why the micro-batch and accumulation are what they are."""
    plain = [r for r in rows if r.precision == best.precision and r.checkpoint == "none" and r.fits]
    largest = max((r.micro_batch for r in plain), default=0)
    over = [
        r
        for r in rows
        if r.precision == best.precision
        and r.checkpoint == best.checkpoint
        and r.micro_batch > best.micro_batch
        and r.predicted_peak_bytes is not None
        and not r.fits
    ]
    text = (
        f"micro-batch {best.micro_batch} x {best.accumulation_steps} accumulation: the largest "
        f"micro-batch that fits {format_bytes(budget)} without checkpointing in "
        f"{best.precision} is {largest or 'none'}"
    )
    if over:
        nxt = min(over, key=lambda r: r.micro_batch)
        text += (
            f"; micro-batch {nxt.micro_batch} with checkpoint {nxt.checkpoint} would peak at "
            f"{format_bytes(nxt.predicted_peak_bytes)}, over the budget"
        )
    return text


def run_advice(source: Engine | RunLog | str | os.PathLike[str]) -> list[Advice]:
    """Advice on the loss scale, checkpointing, the micro-batch and throughput from what
    the monitor recorded: an Engine's (live, with its settings and plan) or a finished run
    directory's ``metrics.jsonl`` (with its ``summary.json``, ``config.json`` and
    ``plan.json``).

    A run with too few steps gets one ``"run"`` advice saying so. A directory that is not
    a run directory, or holds no metrics, raises :class:`~memfit.errors.ConfigError`.

    Example::

        engine = memfit.Engine(model, opt, precision="fp16-mixed", memory_budget="4GiB")
        for batch in batches:
            engine.train_step(batch, loss_fn)
        for item in memfit.tuning.run_advice(engine):
            print(f"{item.topic}: {item.text}")
    """
    if isinstance(source, Engine):
        return advise(
            source.monitor.records, engine_facts(source), source.monitor.config.thresholds
        )
    return advise_run(source)


def engine_facts(engine: Engine) -> RunFacts:
    """What the advice needs from an Engine beyond its monitor's records."""
    plan, scaler, settings = engine.plan, engine.scaler, engine.settings
    decisions = getattr(plan, "decisions", None)
    budget = settings.memory_budget or getattr(plan, "budget_bytes", None)
    return RunFacts(
        precision=engine.policy.mode,
        budget_bytes=None if budget is None else float(budget),
        accumulation_steps=settings.accumulation_steps,
        init_scale=scaler.init_scale if scaler.dynamic else None,
        growth_interval=scaler.growth_interval if scaler.dynamic else None,
        checkpoint=settings.checkpoint if isinstance(settings.checkpoint, str) else "a given plan",
        plan_predicted_peak_bytes=getattr(plan, "predicted_peak_bytes", None),
        plan_recomputed_units=None
        if decisions is None
        else recomputed_units(decisions, getattr(plan, "segments", None)),
        plan_units=None if decisions is None else plan_unit_counts(decisions).units,
        plan_recompute_seconds=getattr(plan, "recompute_seconds", None) or None,
    )
