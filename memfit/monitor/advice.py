"""Tuning advice from what the monitor recorded during a run.

The monitor's log records (``Monitor.records`` while training, ``metrics.jsonl`` after)
show how the loss scale moved, how much memory a step took, what recomputation cost and
how fast the run went. :func:`advise` turns them, with the few settings the records do
not hold (:class:`RunFacts`: precision, budget, accumulation, the scaler's start), into
named :class:`Advice` records, each with the numbers it is based on. Computing is apart
from printing: :func:`render_advice` makes the lines the CLI prints.

Every number is read from the records; nothing is measured here. The micro-batch advice
scales the measured peak linearly and says so: ``memfit tune`` measures the real answer.

Example::

    records = load_run("runs/a").records
    for item in advise(records, RunFacts(precision="fp16-mixed", budget_bytes=2**30)):
        print(item.topic, item.text, item.numbers)
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import ConfigError
from memfit.monitor.health import HealthThresholds
from memfit.monitor.plan_counts import plan_unit_counts, recomputed_units
from memfit.monitor.run_log import RunLog, load_run
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes, parse_bytes

__all__ = [
    "MIN_ADVICE_STEPS",
    "Advice",
    "RunFacts",
    "advise",
    "advise_run",
    "render_advice",
]

#: Fewer optimizer steps than this, or fewer than two log records, and the records say
#: too little about the scale's trajectory and the speed: the advice says so instead.
MIN_ADVICE_STEPS = 20

#: Below this share of the budget, the measured peak leaves room worth using.
HEADROOM_SHARE = 0.75

Number = float

_TRAINING_KEYS = ("amp/scale", "loss", "throughput/samples_per_second")
_PEAK_KEYS = ("memory/peak_bytes", "plan/measured_peak_bytes", "memory/allocated_peak_bytes")


@dataclass(frozen=True)
class Advice:
    """One piece of advice: its topic, one sentence, and the numbers it is based on.

    Example::

        Advice("loss scale", "start at LossScaler(init_scale=32768)", {"final_scale": 32768.0})
    """

    topic: str
    """``"run"`` (too little recorded), ``"loss scale"``, ``"checkpointing"``,
    ``"micro-batch"`` or ``"throughput"``."""
    text: str
    """The advice as one sentence."""
    numbers: dict[str, Number] = field(default_factory=dict)
    """The recorded values it was based on, by name (bytes, fractions, counts, scales)."""


#: The facts of :class:`RunFacts` that may be unknown (``RunFacts.unknown``).
FACT_NAMES = ("precision", "budget_bytes", "accumulation_steps", "checkpoint")


@dataclass(frozen=True)
class RunFacts:
    """What the advice needs that the log records do not hold.

    A None fact was recorded as unset (no budget, no plan) unless its name is in
    ``unknown``: then nothing records it, and the advice says it does not know instead of
    assuming. :func:`advise` without facts knows none of them.

    Example::

        RunFacts(precision="fp16-mixed", budget_bytes=4 * 2**30, accumulation_steps=4)
        RunFacts(unknown=frozenset({"budget_bytes"}))   # no record says whether one was set
    """

    precision: str | None = None
    """The run's precision mode (any alias :class:`~memfit.PrecisionPolicy` takes)."""
    budget_bytes: float | None = None
    """The memory budget of a step."""
    accumulation_steps: int | None = None
    """Micro-batches per optimizer step."""
    init_scale: float | None = None
    """The loss scaler's starting scale."""
    growth_interval: int | None = None
    """Clean steps between the scaler's growths."""
    checkpoint: str | None = None
    """The checkpoint request (``"none"``, ``"auto"``, ``"full"``, ``"sqrt"``, ...)."""
    plan_predicted_peak_bytes: float | None = None
    """The checkpoint plan's predicted peak (None: no plan)."""
    plan_recomputed_units: int | None = None
    """Units the plan recomputes."""
    plan_units: int | None = None
    """Units the plan decided on."""
    plan_recompute_seconds: float | None = None
    """The plan's predicted recompute time per step."""
    unknown: frozenset[str] = frozenset()
    """The facts (of :data:`FACT_NAMES`) no record of the run states; ``precision`` None is
    always unknown."""

    def knows(self, name: str) -> bool:
        """Whether fact ``name`` is recorded (a None then means: not set)."""
        if name == "precision":
            return self.precision is not None
        return name not in self.unknown


def advise(
    records: Sequence[Mapping[str, float]],
    facts: RunFacts | None = None,
    thresholds: HealthThresholds | None = None,
) -> list[Advice]:
    """Advice on the loss scale, checkpointing, the micro-batch and throughput from a run's
    log records (in step order) and ``facts``.

    A run with fewer than :data:`MIN_ADVICE_STEPS` steps or fewer than two log records
    gets one ``"run"`` advice saying so, and no guesses.

    Example::

        for item in advise(engine.monitor.records, RunFacts(precision="bf16-mixed")):
            print(f"{item.topic}: {item.text}")
    """
    facts = facts or RunFacts(unknown=frozenset(FACT_NAMES))
    thresholds = thresholds or HealthThresholds()
    # Training log records; the val/loss lines a run adds between them hold only the step.
    logged = [r for r in records if "step" in r and any(k in r for k in _TRAINING_KEYS)]
    steps = int(logged[-1]["step"]) if logged else 0
    if len(logged) < 2 or steps < MIN_ADVICE_STEPS:
        return [
            Advice(
                "run",
                f"too few steps for advice: {steps} step(s) in {len(logged)} log record(s); "
                f"train at least {MIN_ADVICE_STEPS} steps with two or more log steps",
                {"steps": float(steps), "log_records": float(len(logged))},
            )
        ]
    return [
        _loss_scale(logged, facts, thresholds),
        _checkpointing(records, facts, thresholds),
        _micro_batch(records, facts),
        _throughput(logged),
    ]


def render_advice(advice: Sequence[Advice]) -> str:
    """The advice as lines ``topic: text``, for a terminal.

    Example::

        print(render_advice(advise(records, facts)))
    """
    return "\n".join(f"{item.topic}: {item.text}" for item in advice)


def advise_run(run: RunLog | str | os.PathLike[str]) -> list[Advice]:
    """:func:`advise` on a run directory (what ``memfit train`` or an Engine's ``log_dir``
    wrote), with the facts its ``summary.json``, ``config.json`` and ``plan.json`` hold.

    Raises :class:`~memfit.errors.ConfigError` when the directory is missing or holds no
    metrics (see :func:`~memfit.monitor.run_log.load_run`).

    Example::

        print(render_advice(advise_run("runs/gpt-fp16-mixed-20260101-120000")))
    """
    log = run if isinstance(run, RunLog) else load_run(run)
    return advise(log.records, facts_from_run(log))


def facts_from_run(run: RunLog) -> RunFacts:
    """The :class:`RunFacts` a run directory's JSON files hold."""
    summary, config, plan = run.summary, run.config, run.plan or {}
    budget = _positive(summary.get("budget_bytes")) or _positive(plan.get("budget_bytes"))
    if budget is None and isinstance(config.get("budget"), str):
        try:  # an absolute size reads anywhere; a fraction needs the run's device
            if not _is_fraction(config["budget"]):
                budget = float(parse_bytes(config["budget"]))
        except ConfigError:
            budget = None
    if budget is None and _positive(config.get("budget_bytes")) is not None:
        budget = _positive(config.get("budget_bytes"))
    decisions = plan.get("decisions") if isinstance(plan.get("decisions"), dict) else None
    accumulation = summary.get("accumulation_steps")
    if accumulation is None:
        accumulation = config.get("accumulation")
    growth = summary.get("growth_interval")
    # What no file records: the advice says it does not know (a run directory without
    # config.json and summary.json, as an Engine of an earlier memfit left its log_dir).
    unknown = set()
    recorded = any("budget_bytes" in d or "budget" in d for d in (summary, config, plan))
    if budget is None and (not recorded or config.get("budget") not in (None, "")):
        unknown.add("budget_bytes")  # nothing says, or a budget given that no file sizes
    if accumulation is None:
        unknown.add("accumulation_steps")
    if "checkpoint" not in config and not plan:
        unknown.add("checkpoint")
    return RunFacts(
        precision=run.precision,
        budget_bytes=budget,
        accumulation_steps=int(accumulation) if isinstance(accumulation, int) else None,
        init_scale=_positive(summary.get("init_scale")),
        growth_interval=int(growth) if isinstance(growth, int) else None,
        checkpoint=str(config["checkpoint"]) if config.get("checkpoint") else None,
        plan_predicted_peak_bytes=_positive(plan.get("predicted_peak_bytes")),
        plan_recomputed_units=None
        if decisions is None
        else recomputed_units(decisions, plan.get("segments")),
        plan_units=None if decisions is None else plan_unit_counts(decisions).units,
        plan_recompute_seconds=_positive(plan.get("recompute_seconds")),
        unknown=frozenset(unknown),
    )


# ---------------------------------------------------------------------- loss scale


def _loss_scale(
    logged: list[Mapping[str, float]], facts: RunFacts, thresholds: HealthThresholds
) -> Advice:
    last = logged[-1]
    steps = int(last["step"])
    skipped = int(last.get("amp/skipped", 0.0))
    scaled = [r for r in logged if _finite(r, "amp/scale")]
    if not scaled:
        if _loss_scaled(facts.precision, []):
            return Advice("loss scale", "no loss scale was logged, so no advice on it", {})
        logged, scales = [last], [1.0]
    else:
        logged, scales = scaled, [r["amp/scale"] for r in scaled]
    final = scales[-1]
    recent = last.get("amp/overflow_rate_recent", skipped / steps)
    numbers: dict[str, Number] = {
        "steps": float(steps),
        "skipped_steps": float(skipped),
        "overflow_rate": skipped / steps,
        "recent_overflow_rate": recent,
        "first_logged_scale": scales[0],
        "final_scale": final,
    }
    for key in ("grad/max_abs", "grad/underflow_fraction", "amp/suggested_scale"):
        if key in last and math.isfinite(last[key]):
            numbers[key] = last[key]
    if facts.init_scale is not None:
        numbers["init_scale"] = facts.init_scale
    gradients = ""
    if "grad/max_abs" in numbers:
        gradients = f"; the largest gradient is {numbers['grad/max_abs']:.3g}"
        if "amp/suggested_scale" in numbers:
            gradients += f", which fp16 would start at {_pow2(numbers['amp/suggested_scale'])}"
    precision = facts.precision
    if not _loss_scaled(precision, scales):
        if precision is not None:
            text = f"none needed in {precision} (no loss scaling)"
        else:
            text = (
                f"{_UNKNOWN_PRECISION}; the logged loss scale stayed at 1, so the loss was "
                "not scaled"
            )
        if skipped:
            text += (
                f"; {skipped} of {steps} steps were skipped for non-finite gradients, which "
                "a scale does not cure: lower the LR or clip"
            )
        return Advice("loss scale", text + gradients, numbers)

    underflow = numbers.get("grad/underflow_fraction", 0.0)
    suggested = numbers.get("amp/suggested_scale")
    calibration, settled_at = _calibration(logged)
    late_steps = steps - settled_at
    late_rate = (skipped - calibration) / late_steps if late_steps > 0 else 1.0
    numbers["calibration_skips"] = float(calibration)
    numbers["overflow_rate_after_calibration"] = late_rate
    if late_rate > thresholds.max_overflow_rate:
        where = (
            "every log window skipped steps"
            if late_steps <= 0
            else f"{skipped - calibration} after the first clean log window"
        )
        text = (
            f"overflow rate {_percent(skipped / steps if late_steps <= 0 else late_rate)} is "
            f"high (> {_percent(thresholds.max_overflow_rate)}; {skipped} of {steps} steps "
            f"skipped, {where}, the scale now {_pow2(final)}): raise growth_interval or "
            "hysteresis, keep the overflowing module in fp32 (first_nonfinite names it), or "
            "use bf16-mixed"
        )
    elif skipped and calibration == 0:
        # Rare skips late in the run, none while the scale calibrated: the start was fine.
        text = (
            f"{skipped} of {steps} steps skipped, all after the first clean log window "
            f"({_percent(late_rate)}, under {_percent(thresholds.max_overflow_rate)}): the "
            f"scale probing upward, as it should; the scale now {_pow2(final)}, no change "
            "needed"
        )
    elif skipped:
        numbers["recommended_init_scale"] = final
        text = (
            f"the scale settled at {_pow2(final)} after {skipped} skipped step(s) "
            f"({_by_step(calibration, skipped, settled_at)}); start at "
            f"LossScaler(init_scale={final:g}) to skip the early ones"
        )
    elif final > scales[0] or (facts.init_scale is not None and final > facts.init_scale):
        start = facts.init_scale if facts.init_scale is not None else scales[0]
        numbers["recommended_init_scale"] = final
        text = (
            f"no overflow in {steps} steps and the scale kept growing ({_pow2(start)} to "
            f"{_pow2(final)}): start higher, at LossScaler(init_scale={final:g}), or a shorter "
            "growth_interval finds the top sooner"
        )
    else:
        growth = f" (growth_interval {facts.growth_interval})" if facts.growth_interval else ""
        text = f"no overflow in {steps} steps at {_pow2(final)}; the scale did not grow{growth}"
        if suggested is not None and suggested > final:
            largest = f"the largest gradient, {numbers['grad/max_abs']:.3g}, allows"
            gradients = ""  # said here
            if underflow > thresholds.max_gradient_underflow:
                numbers["recommended_init_scale"] = suggested
                text += f": {largest} more; start at LossScaler(init_scale={suggested:g})"
            else:
                text += f"; {largest} {_pow2(suggested)}"
    if underflow > thresholds.max_gradient_underflow:
        text += (
            f"; {_percent(underflow)} of the nonzero gradient values underflow fp16 at this scale"
        )
    return Advice("loss scale", text + gradients, numbers)


#: Why a fact is unknown: the files that would record it are missing.
_NOT_RECORDED = "no config.json, summary.json or plan.json in the run directory records it"
_UNKNOWN_PRECISION = (
    "the precision is unknown (no config.json or summary.json in the run directory names it)"
)


def _no_budget(facts: RunFacts) -> str:
    """That no budget was set, or that whether one was is unknown."""
    if facts.knows("budget_bytes"):
        return "no budget was set (give memory_budget / --budget)"
    return f"the budget is unknown ({_NOT_RECORDED})"


def _by_step(calibration: int, skipped: int, step: int) -> str:
    later = skipped - calibration
    first = f"all by step {step}" if not later else f"{calibration} by step {step}"
    return first if not later else f"{first}, {later} later as the scale probed upward"


def _loss_scaled(precision: str | None, scales: list[float]) -> bool:
    """Whether the run scaled its loss: by its precision, else by its logged scale (a run
    directory without config.json or summary.json names no precision)."""
    if precision is not None:
        try:
            return PrecisionPolicy(precision).loss_scaling
        except ConfigError:
            pass
    return any(s != 1.0 for s in scales)


def _calibration(logged: list[Mapping[str, float]]) -> tuple[int, int]:
    """The skips before the first log window without one, and the step that window starts
    at: a scale that starts too high backs off in a burst of skips at the start."""
    previous_step, previous_skipped = 0, 0
    for r in logged:
        skipped = int(r.get("amp/skipped", 0.0))
        if skipped == previous_skipped:
            return previous_skipped, previous_step
        previous_step, previous_skipped = int(r["step"]), skipped
    return previous_skipped, previous_step


# ---------------------------------------------------------------------- memory


@dataclass(frozen=True)
class _Memory:
    peak: float
    """The largest measured peak of a step."""
    static: float | None
    """Bytes at the peak that do not grow with the micro-batch (params, grads, optimizer)."""


def _measured_memory(records: Sequence[Mapping[str, float]]) -> _Memory | None:
    # A peak of 0 is no measurement (TensorFlow's CPU allocator reports 0 on some hosts).
    peaks = [r[k] for r in records for k in _PEAK_KEYS if _finite(r, k) and r[k] > 0]
    if not peaks:
        return None
    static = None
    for r in records:
        keys = [f"memory/kind/{k}" for k in ("params", "grads", "optimizer")]
        if "memory/kind/activations" in r:
            static = sum(r[k] for k in keys if _finite(r, k))
    return _Memory(max(peaks), static)


def _checkpointing(
    records: Sequence[Mapping[str, float]], facts: RunFacts, thresholds: HealthThresholds
) -> Advice:
    memory = _measured_memory(records)
    overheads = [r["recompute/overhead"] for r in records if _finite(r, "recompute/overhead")]
    numbers: dict[str, Number] = {}
    if memory is not None:
        numbers["peak_bytes"] = memory.peak
    if facts.budget_bytes is not None:
        numbers["budget_bytes"] = facts.budget_bytes
    if facts.plan_predicted_peak_bytes is not None:
        numbers["predicted_peak_bytes"] = facts.plan_predicted_peak_bytes
    if overheads:
        numbers["recompute_overhead"] = statistics.median(overheads)
    if facts.plan_recomputed_units is not None:
        numbers["recomputed_units"] = float(facts.plan_recomputed_units)
    if memory is None:
        return Advice("checkpointing", "no memory was measured, so no advice on it", numbers)
    peak = memory.peak
    has_plan = facts.plan_predicted_peak_bytes is not None or bool(overheads)
    # A plan that keeps every activation is no checkpointing at all.
    recomputes = has_plan and facts.plan_recomputed_units != 0
    parts = []
    if has_plan:
        units = ""
        if facts.plan_recomputed_units is not None and facts.plan_units:
            units = f" ({facts.plan_recomputed_units} of {facts.plan_units} units recomputed)"
        parts.append(f"plan {facts.checkpoint or 'in use'}{units}")
        if facts.plan_predicted_peak_bytes:
            ratio = peak / facts.plan_predicted_peak_bytes
            numbers["measured_over_predicted"] = ratio
            parts.append(
                f"measured peak {format_bytes(peak)} is {_percent(ratio)} of the predicted "
                f"{format_bytes(facts.plan_predicted_peak_bytes)}"
            )
        step_times = [
            r["time/step_seconds"] for r in records[1:] if _finite(r, "time/step_seconds")
        ]
        if recomputes and facts.plan_recompute_seconds and step_times:
            # The plan's recompute time against the measured step: its share of a step.
            numbers["predicted_recompute_seconds"] = facts.plan_recompute_seconds
            numbers["step_seconds"] = statistics.median(step_times)
            share = facts.plan_recompute_seconds / numbers["step_seconds"]
            numbers["predicted_recompute_share"] = share
            parts.append(
                f"the plan predicted {1000 * facts.plan_recompute_seconds:.3g} ms of "
                f"recompute, {_percent(share)} of the measured "
                f"{1000 * numbers['step_seconds']:.3g} ms step"
            )
        elif overheads and recomputes:
            parts.append(f"recompute overhead {_percent(numbers['recompute_overhead'])}")
    elif facts.knows("checkpoint"):
        parts.append(f"none in use; measured peak {format_bytes(peak)}")
    else:
        parts.append(
            f"measured peak {format_bytes(peak)}; whether a checkpoint plan was in use is "
            f"unknown ({_NOT_RECORDED})"
        )
    if facts.budget_bytes is None:
        parts.append(f"{_no_budget(facts)}, so no headroom to judge")
        return Advice("checkpointing", "; ".join(parts), numbers)
    share = peak / facts.budget_bytes
    numbers["peak_share_of_budget"] = share
    budget = format_bytes(facts.budget_bytes)
    at = f"peak {_percent(share)} of the {budget} budget"
    if share > 1.0:
        if memory.static is not None and memory.static >= facts.budget_bytes:
            fix = (
                f"the weights, gradients and optimizer state alone ({format_bytes(memory.static)}) "
                "fill it, which no checkpointing lowers: shard the model, use a '*-master' "
                "precision or a smaller optimizer state"
            )
        elif facts.checkpoint == "full":
            fix = "every unit is recomputed already: use a smaller micro-batch (more accumulation)"
        elif recomputes:
            fix = "plan at a smaller budget or a stronger strategy (checkpoint='full')"
        else:
            fix = "checkpoint='auto' (--checkpoint auto) plans recomputation to fit"
        parts.append(f"{at}, over it: {fix}")
    elif not recomputes:
        parts.append(f"{at}: none needed")
    elif share < HEADROOM_SHARE:
        fixed = facts.checkpoint not in (None, "auto", "optimal", "plan")
        lighter = (
            "checkpoint='auto' at this budget would recompute less"
            if fixed
            else "a lighter plan would recompute less (a larger memory_budget lets the "
            "planner keep more)"
        )
        parts.append(f"{at}: {lighter}")
    elif overheads and numbers["recompute_overhead"] > thresholds.max_recompute_overhead:
        parts.append(
            f"{at}, and recompute costs more than {_percent(thresholds.max_recompute_overhead)}: "
            "raise the budget or use a smaller micro-batch"
        )
    else:
        parts.append(f"{at}: the plan uses the budget")
    return Advice("checkpointing", "; ".join(parts), numbers)


def _micro_batch(records: Sequence[Mapping[str, float]], facts: RunFacts) -> Advice:
    memory = _measured_memory(records)
    samples = _samples_per_step(records)
    numbers: dict[str, Number] = {}
    if samples is not None:
        numbers["samples_per_step"] = float(samples)
    accumulation = facts.accumulation_steps
    if accumulation is not None:
        numbers["accumulation_steps"] = float(accumulation)
    if memory is None or facts.budget_bytes is None:
        missing = "no memory was measured" if memory is None else _no_budget(facts)
        return Advice(
            "micro-batch", f"{missing}, so no advice on it; memfit tune measures it", numbers
        )
    numbers["peak_bytes"] = memory.peak
    numbers["budget_bytes"] = facts.budget_bytes
    static = memory.static if memory.static is not None else 0.0
    numbers["static_bytes"] = static
    growing = memory.peak - static
    if growing <= 0:
        return Advice("micro-batch", "the peak holds nothing that grows with the batch", numbers)
    if static >= facts.budget_bytes:
        return Advice(
            "micro-batch",
            f"the weights, gradients and optimizer state alone ({format_bytes(static)}) fill "
            f"the {format_bytes(facts.budget_bytes)} budget: no micro-batch fits; shard the "
            "model, use a '*-master' precision or a smaller optimizer state",
            numbers,
        )
    # Activations and temporaries grow about linearly with the micro-batch; the rest stays.
    factor = (facts.budget_bytes - static) / growing
    numbers["fit_factor"] = factor
    how = "approximate: activations scaled linearly; memfit tune measures it"
    if samples is None or accumulation is None or samples < accumulation or samples % accumulation:
        return Advice(
            "micro-batch",
            f"a micro-batch about {_times(factor)} the current one would fit the "
            f"{format_bytes(facts.budget_bytes)} budget ({how})",
            numbers,
        )
    micro = samples // accumulation
    numbers["micro_batch"] = float(micro)
    fits = [
        a
        for a in range(1, accumulation + 1)
        if samples % a == 0 and static + growing * (samples // a) / micro <= facts.budget_bytes
    ]
    if factor < 1.0:
        text = (
            f"micro-batch {micro} x {accumulation} peaks over the budget; about "
            f"{max(1, math.floor(micro * factor))} per micro-batch would fit ({how})"
        )
    elif fits and fits[0] < accumulation:
        better = fits[0]
        numbers["suggested_micro_batch"] = float(samples // better)
        numbers["suggested_accumulation_steps"] = float(better)
        text = (
            f"micro-batch {samples // better} x {better} accumulation would fit the "
            f"{format_bytes(facts.budget_bytes)} budget instead of {micro} x {accumulation}: "
            f"less accumulation, the same {samples} samples per step ({how})"
        )
    elif accumulation == 1:
        text = (
            f"the whole step is one micro-batch of {micro}; about {_times(factor)} as many "
            f"samples would fit the {format_bytes(facts.budget_bytes)} budget ({how})"
        )
    else:
        text = (
            f"micro-batch {micro} x {accumulation} is as large as fits "
            f"({_times(factor)} the micro-batch would; {how})"
        )
    return Advice("micro-batch", text, numbers)


def _samples_per_step(records: Sequence[Mapping[str, float]]) -> int | None:
    """Samples per optimizer step: samples/s times seconds per step over a log window."""
    for r in reversed(records):
        sps, seconds = r.get("throughput/samples_per_second"), r.get("time/step_seconds")
        if sps and seconds and math.isfinite(sps * seconds) and round(sps * seconds) >= 1:
            return round(sps * seconds)
    return None


# ---------------------------------------------------------------------- throughput


#: A log window whose steps took over this many times the median is a warm-up (planning,
#: first steps after a resume) and is left out of the throughput.
WARMUP_FACTOR = 3.0


def _throughput(logged: list[Mapping[str, float]]) -> Advice:
    # The first window holds the first step's planning and warm-up: left out; so is a
    # window whose steps took over WARMUP_FACTOR x the median (a resumed run's warm-up).
    windows = logged[1:]
    seconds = [r["time/step_seconds"] for r in windows if _finite(r, "time/step_seconds")]
    if seconds:
        slow = WARMUP_FACTOR * statistics.median(seconds)
        windows = [
            r
            for r in windows
            if not _finite(r, "time/step_seconds") or r["time/step_seconds"] <= slow
        ]
    rates = [
        r["throughput/samples_per_second"]
        for r in windows
        if _finite(r, "throughput/samples_per_second")
    ]
    if not rates:
        return Advice("throughput", "no throughput was logged", {})
    numbers: dict[str, Number] = {
        "samples_per_second": statistics.median(rates),
        "windows": float(len(rates)),
    }
    text = f"median {numbers['samples_per_second']:,.1f} samples/s"
    tokens = [
        r["throughput/tokens_per_second"]
        for r in windows
        if _finite(r, "throughput/tokens_per_second")
    ]
    if tokens:
        numbers["tokens_per_second"] = statistics.median(tokens)
        text += f" ({numbers['tokens_per_second']:,.0f} tokens/s)"
    left_out = len(logged) - len(windows)
    text += (
        f" over {len(rates)} log windows ({left_out} with warm-up left out: the first, and "
        f"any whose steps took over {WARMUP_FACTOR:g}x the median)"
    )
    mfu = [r["throughput/mfu"] for r in windows if _finite(r, "throughput/mfu")]
    if mfu:
        numbers["mfu"] = statistics.median(mfu)
        text += f", MFU {_percent(numbers['mfu'])}"
    overhead = [r["recompute/overhead"] for r in windows if _finite(r, "recompute/overhead")]
    if overhead and statistics.median(overhead) > 0:
        numbers["recompute_overhead"] = statistics.median(overhead)
        text += f"; recompute adds about {_percent(numbers['recompute_overhead'])} to a step"
    return Advice("throughput", text, numbers)


# ---------------------------------------------------------------------- helpers


def _finite(record: Mapping[str, float], key: str) -> bool:
    return key in record and math.isfinite(record[key])


def _times(factor: float) -> str:
    """``2.5x`` below 10, ``2,468x`` above."""
    return f"{factor:.2g}x" if factor < 10 else f"{factor:,.0f}x"


def _percent(fraction: float) -> str:
    """A fraction as a percent with two significant digits below 10%: ``0.0033%``, ``61%``."""
    if fraction >= 0.1:
        return f"{fraction:.0%}"
    return f"{100 * fraction:.2g}%"


def _pow2(scale: float) -> str:
    """``2^15 = 32768`` for a power of two, else the number."""
    if scale > 0 and math.isfinite(scale):
        k = math.log2(scale)
        if k == int(k):
            return f"2^{int(k)} = {scale:g}"
    return f"{scale:g}"


def _positive(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _is_fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False
