"""``memfit.tune``: precision, checkpoint plan, micro-batch and accumulation chosen together.

1. **Search** (:mod:`memfit.candidates`): every precision x strategy x split of the global
   batch estimated on a meta model and fake tensors, ranked by predicted step time;
   nothing real is allocated, so no candidate runs out of memory there. The predicted
   times take the terms counting leaves out (each micro-batch's and each step's fixed
   cost, the model's real speed) from three short steps of the model
   (:mod:`memfit.tuning.calibrate`).
2. **Measure** (:mod:`memfit.tuning.trials`): ``measure_top`` splits of the global
   batch, each with its best predicted setting, and the **peers**, the usual fixes a
   user reaches without the tuner, in each precision: halving the micro-batch until it
   fits, and checkpointing every block with the whole batch. Each trains a few real
   steps: the allocator's peak, then step times in interleaved rounds, as many as it
   takes to separate the fastest from the rest beyond their noise, or to call a tie
   (bounded by ``max_seconds``). The splits predicted within 1.5x of the fastest go
   first, the largest micro-batch first. A trial that runs out of memory, raises, or
   peaks over the budget is recorded in its row and its split's (or peer's) next
   setting is measured in its place.
3. **Choose** (:mod:`memfit.trials.decide`): the fastest measured setting within the
   budget when the rounds separate it; in a tie the simplest (least recompute, fewest
   micro-batches), never one measured slower than a peer; with ``measure_top=0`` the
   predicted best.

Example::

    res = memfit.tune(lambda: GPT(cfg), lambda n: corpus.batch("train", n, 128), gpt_loss,
                      budget="4GiB", global_batch=64)
    print(res.summary())
    engine = res.engine(model, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.candidates import (
    DEFAULT_PRECISIONS,
    Candidate,
    nothing_fits,
    rank_candidates,
    retime,
)
from memfit.checkpoint.api import default_step_loss
from memfit.checkpoint.planner import check_activation_storage
from memfit.checkpoint.step_memory import RankLayout
from memfit.errors import BudgetError, ConfigError
from memfit.monitor.plan_counts import plan_unit_counts
from memfit.nested import tensors
from memfit.precision.optimizer_state import check_optimizer_state
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import expand_precisions, matmul_speed
from memfit.trials.decide import Timed, decide
from memfit.trials.slots import MAX_ROUNDS_FACTOR, Slot, peer_queues, split_queues
from memfit.tuning.calibrate import StepTimeModel
from memfit.tuning.hints import checkpoint_advice, loss_scale_advice, split_advice
from memfit.tuning.result import TuneResult, TuneRow
from memfit.tuning.trials import (
    GradStats,
    Trial,
    calibrate,
    cuda_devices,
    first_line,
    holds_trials,
    time_in_rounds,
)
from memfit.units import format_bytes, parse_bytes
from memfit.workload import Workload, unpack_workload

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _device_of(batch_fn: Callable[[int], Any]) -> torch.device:
    for t in tensors(batch_fn(1)):
        return t.device
    return torch.device("cpu")


def tune(
    model_fn: Callable[[], nn.Module] | Workload,
    batch_fn: Callable[[int], Any] | None = None,
    loss_fn: LossFn | None = None,
    *,
    budget: str | int | float,
    global_batch: int,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    precisions: Sequence[str] | None = None,
    world_size: int = 1,
    data_parallel: str | None = None,
    measure_top: int = 3,
    steps: int = 5,
    peers: bool = True,
    max_seconds: float | None = 300.0,
    device: str | torch.device | None = None,
    optimizer_state: str = "fp32",
    release_gradients: bool | str = False,
    activation_storage: Sequence[str] = ("keep", "recompute"),
) -> TuneResult:
    """Choose precision, checkpoint plan, micro-batch and accumulation for ``budget``.

    Args:
        model_fn: builds the model (on the default device, not moved): the search runs it
            on the meta device, each measured trial builds a fresh one and moves it to
            ``device``. Or a :class:`memfit.Workload`, which holds all three functions:
            ``tune(workload, budget=..., global_batch=...)``, with no ``batch_fn`` or
            ``loss_fn`` beside it.
        batch_fn: ``batch_fn(n)`` returns a batch of ``n`` samples (on ``device``).
        loss_fn: ``loss_fn(model, batch) -> scalar``, as the Engine, ``memfit.plan`` and
            ``memfit.estimate`` take it; default: the sum of the first floating-point
            tensor of the model's output (``model(x)``, ``model(*x)``, ``model(**x)``).
        budget: the peak memory of a training step ("4GiB", bytes, or a fraction of the
            device's memory).
        global_batch: samples per optimizer step over all ranks; every split with
            ``micro_batch x accumulation_steps x world_size == global_batch`` is tried.
        optimizer_fn: ``params -> optimizer`` (default ``torch.optim.AdamW``).
        precisions: the modes to compare (default fp32, bf16-mixed, bf16-master);
            ``"auto"`` stands for the modes ``precision="auto"`` chooses between.
        world_size: data-parallel ranks: the predicted peaks are one rank's (under
            ``data_parallel``), and each trial trains one rank's share of the batch in
            this process.
        data_parallel: ``"ddp"`` (the default with ``world_size`` > 1) or ``"fsdp"``. A
            trial in one process holds the whole model, not an FSDP2 shard, so under
            ``"fsdp"`` its measured peak is recorded but the fit is the prediction's.
        measure_top: how many candidates to measure on real steps (0: choose by
            prediction alone).
        steps: timed rounds at least (one step of every trial each, after a warm-up and
            a measured step); more rounds follow, up to four times as many, until the
            fastest trial is separated from the others beyond their measured noise or
            tied with them (:mod:`memfit.trials.decide`).
        peers: also measure, in each precision, the two usual fixes a user reaches without
            the tuner: halving the micro-batch until it fits (no checkpointing) and
            checkpointing every block with the whole batch. The choice is never one
            measured slower than a peer that fits; in a tie the simpler setting wins.
        max_seconds: a bound on the tuning's time: past it no further trial starts (once
            one has) and no round beyond ``steps`` is timed; None: no bound. The time
            spent is in ``TuneResult.tuning_seconds``.
        device: where trials run (default: where ``batch_fn``'s tensors are).
        optimizer_state: how the optimizer keeps its state in every setting (``"fp32"``,
            ``"bf16"``, ``"8bit"``; docs/tiers.md), or ``"auto"``: fp32 unless nothing
            fits the budget with it, then 8 bits. The choice is in ``best`` and
            :meth:`TuneResult.engine`. ``precisions`` may name ``bf16-sr``, which is
            tried with one micro-batch a step.
        release_gradients: apply each update as its gradient is made in backward in every
            setting (``True``: one micro-batch a step, one process; docs/tiers.md), or
            ``"auto"``: only where nothing fits the budget without it (after the state in
            fewer bits, where ``optimizer_state="auto"``). The choice is in ``best`` and
            :meth:`TuneResult.engine`.
        activation_storage: beside ``"keep"`` and ``"recompute"``, the coded storages
            (``"bf16"``, ``"fp8"``, ``"offload"`` on CUDA) every ``optimal`` setting's plan
            may keep a block's activations in where the budget needs it (docs/tiers.md):
            predicted with the codes counted on the fake step; a measured trial, and
            :meth:`TuneResult.engine`, plan the real model, which measures each storage's
            gradient error too.

    Raises:
        ConfigError: a global batch no split makes (the message lists valid ones), an
            unknown precision, a model that cannot run on meta/fake tensors, a Workload
            given together with a ``batch_fn`` or ``loss_fn``.
        BudgetError: nothing fits (the message gives the smallest budget that would fit
            and the setting that reaches it), or every measured trial failed.

    Example::

        res = memfit.tune(model_fn, batch_fn, loss_fn, budget="2GiB", global_batch=32)
        res.best.precision, res.best.checkpoint, res.best.micro_batch
        work = memfit.Workload(model_fn, batch_fn, loss_fn)   # the same, in one object
        res = memfit.tune(work, budget="2GiB", global_batch=32)
    """
    model_fn, batch_fn, loss_fn = unpack_workload(model_fn, batch_fn, loss_fn, call="memfit.tune")
    if int(measure_top) != measure_top or measure_top < 0:
        raise ConfigError(f"measure_top must be an int >= 0, got {measure_top!r}")
    if int(steps) != steps or steps < 1:
        raise ConfigError(f"steps must be an int >= 1, got {steps!r}")
    check_optimizer_state(optimizer_state, also=("auto",))
    storage = check_activation_storage(activation_storage)
    if release_gradients not in (True, False, "auto"):
        raise ConfigError(
            f"release_gradients must be True, False or 'auto', got {release_gradients!r}"
        )
    if release_gradients is True and world_size > 1:
        raise ConfigError(
            "release_gradients=True cannot be tuned for a data-parallel run: each rank needs "
            "every gradient reduced before its update; tune with release_gradients=False"
        )
    if max_seconds is not None and not max_seconds > 0:
        raise ConfigError(
            f"max_seconds must be a number of seconds > 0 or None, got {max_seconds!r}"
        )
    began = time.monotonic()
    deadline = began + (math.inf if max_seconds is None else float(max_seconds))
    loss_fn = loss_fn or default_step_loss
    where = torch.device(device) if device is not None else _device_of(batch_fn)
    limit = parse_bytes(budget, where)
    modes = expand_precisions(precisions or DEFAULT_PRECISIONS, where)
    dtypes = {PrecisionPolicy.of(m).compute_dtype for m in modes} - {torch.float32}
    speed = matmul_speed(where, tuple(sorted(dtypes, key=str)))
    # "auto": a tier only where nothing fits without it; the state in fewer bits before
    # released gradients, which cannot accumulate micro-batches (nor run over ranks).
    for state, release in _tiers(optimizer_state, release_gradients, world_size):
        ranked = rank_candidates(
            model_fn,
            batch_fn,
            loss_fn,
            budget=limit,
            global_batch=global_batch,
            world_size=world_size,
            data_parallel=data_parallel,
            precisions=modes,
            optimizer_fn=optimizer_fn,
            device=where,
            speed=speed,
            optimizer_state=state,
            release_gradients=release,
            activation_storage=storage,
        )
        if any(c.fits for c in ranked):
            break
    step_time = StepTimeModel(note="not measured (measure_top=0)")
    if measure_top:
        step_time = _calibrate(ranked, modes, model_fn, batch_fn, loss_fn, optimizer_fn, where)
        ranked = retime(ranked, step_time.seconds)
    # A one-process trial of an FSDP2 rank holds every weight, not its shard: its peak
    # says nothing of the rank's, so only the prediction judges the fit there.
    layout = RankLayout.of(world_size, data_parallel)
    judged = layout.kind != "fsdp"
    if not any(c.fits for c in ranked):
        raise nothing_fits(ranked, limit)
    rows = [TuneRow(c, rank) for rank, c in enumerate(ranked)]

    def start(row: TuneRow) -> Trial | None:
        return _start(row, model_fn, batch_fn, loss_fn, optimizer_fn, limit, judged, where)

    usual = peer_queues(rows, modes, global_batch // world_size, limit) if peers else []
    # The trials' timed steps draw from the random generators (dropout): the caller's
    # state is put back when they are done.
    with torch.random.fork_rng(devices=cuda_devices(where), device_type="cuda"):
        got = (
            _measure(rows, measure_top, usual, steps, start, holds_trials(where), deadline)
            if measure_top
            else _Measured([], {}, {}, 0)
        )
    if measure_top and not got.good:
        failed = [r for r in rows if r.error]
        raise BudgetError(
            f"every measured trial failed or peaked over the budget ({len(failed)} tried): "
            + "; ".join(
                f"{r.precision}/{r.checkpoint}/{r.micro_batch}x{r.accumulation_steps}: {r.error}"
                for r in failed[:4]
            )
        )
    verdict = decide([_timed(r, got.seconds[r.rank]) for r in got.good]) if got.good else None
    best = next(r for r in got.good if r.rank == verdict.best.key) if verdict else rows[0]
    result = TuneResult(
        best,
        rows,
        limit,
        int(global_batch),
        int(world_size),
        layout.kind,
        speedups={m: speed.speedup(PrecisionPolicy.of(m).compute_dtype) for m in modes},
        speed_measured=speed.measured,
        rounds=got.rounds,
        step_time=step_time,
        verdict=verdict.describe() if verdict else "chosen by prediction (nothing measured)",
    )
    result.advice = [
        loss_scale_advice(got.grads.get(best.rank), best.precision),
        checkpoint_advice(best, _units(best)),
        split_advice(rows, best, limit),
    ]
    result.tuning_seconds = time.monotonic() - began
    return result


def _tiers(
    optimizer_state: str, release_gradients: bool | str, world_size: int
) -> list[tuple[str, bool]]:
    """The (optimizer state, gradients released) settings to rank, in the order ``"auto"``
    tries them: each one only where nothing fit with those before it.

    >>> _tiers("auto", "auto", 1)
    [('fp32', False), ('8bit', False), ('8bit', True)]
    >>> _tiers("bf16", "auto", 2)
    [('bf16', False)]
    """
    states = ("fp32", "8bit") if optimizer_state == "auto" else (optimizer_state,)
    out = [(state, release_gradients is True) for state in states]
    if release_gradients == "auto" and world_size == 1:
        out.append((states[-1], True))
    return out


def _calibrate(
    ranked: list[Candidate],
    modes: Sequence[str],
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: LossFn,
    optimizer_fn: Any,
    device: torch.device,
) -> StepTimeModel:
    """The step-time model's measured terms (:mod:`memfit.tuning.calibrate`), timed in fp32
    where it is compared (else the first mode): ``m1`` the smallest micro-batch of two or
    more (a batch norm needs two samples), ``m2`` the largest predicted to fit without
    checkpointing (and with every block checkpointed, for recompute's cost)."""
    mode = "fp32" if "fp32" in modes else modes[0]
    plain = {
        c.micro_batch: c
        for c in ranked
        if c.precision == mode and c.checkpoint == "none" and c.predicted_step_seconds
    }
    full = {c.micro_batch: c for c in ranked if c.precision == mode and c.checkpoint == "full"}

    def counted(m: int) -> float | None:
        c = plain.get(m)
        return (
            c.predicted_step_seconds / c.accumulation_steps
            if c and c.predicted_step_seconds
            else None
        )

    def recomputed(m: int) -> float | None:
        c = full.get(m)
        return c.recompute_step_seconds / c.accumulation_steps if c else None

    sizes = sorted(plain)
    m1 = next((m for m in sizes if m >= 2 and 2 * m in plain), None)
    if m1 is None:
        return StepTimeModel(note="no micro-batch of two or more with twice its size to time")
    fitting = [m for m in sizes if m > m1 and plain[m].fits]
    return calibrate(
        model_fn,
        batch_fn,
        loss_fn,
        optimizer_fn,
        precision=mode,
        counted=counted,
        recomputed=recomputed,
        m1=m1,
        m2=fitting[-1] if fitting else None,
        device=device,
    )


#: Further candidates tried, in the order of prediction, when every split's failed.
FALLBACK_TRIALS = 8


@dataclass
class _Measured:
    """What the trials gave: the rows measured within the budget (median step times in
    them), the gradients each trial read for the advice, each good row's timed steps,
    and how many rounds were timed."""

    good: list[TuneRow]
    grads: dict[int, GradStats | None]
    seconds: dict[int, list[float]]
    rounds: int


def _measure(
    rows: list[TuneRow],
    measure_top: int,
    peers: list[Slot],
    steps: int,
    start: Callable[[TuneRow], Trial | None],
    hold: bool,
    deadline: float,
) -> _Measured:
    """Measure up to ``measure_top`` splits, one setting each, and every peer slot.

    Each slot's settings are tried in order (up to
    :data:`~memfit.trials.slots.ATTEMPTS_PER_SPLIT`) until one starts; a setting already
    started for another slot serves both. With ``hold`` the started trials are timed side
    by side in rounds: ``steps`` rounds, then more until the verdict of
    :func:`~memfit.trials.decide.decide` settles, up to
    :data:`~memfit.trials.slots.MAX_ROUNDS_FACTOR` x ``steps`` or the ``deadline``
    (``time.monotonic()``). A trial whose timed step raises gives way to its slot's next setting (or, for a split,
    the next split), which joins the rounds. Without ``hold`` each trial is timed alone
    for ``steps`` steps and released. Past the deadline no optional trial starts (once one
    has). Where every split failed, up to :data:`FALLBACK_TRIALS` more rows are tried in
    the order of prediction."""
    splits = split_queues(rows)
    tried = {id(r) for s in splits for r in s.queue}
    fallback = [r for r in rows if r.fits and id(r) not in tried][:FALLBACK_TRIALS]
    started: dict[int, Trial] = {}  # id(row) -> its trial
    out = _Measured([], {}, {}, 0)

    def fill(slot: Slot) -> None:
        while slot.queue and not slot.filled:
            row = slot.queue.pop(0)
            row.peer = row.peer or slot.peer
            trial = started.get(id(row))
            if trial is None and row.error is None:
                trial = start(row)
                if trial is not None:
                    started[id(row)] = trial
                    if not hold:
                        time_in_rounds([trial], steps)
                        out.rounds = steps  # each trial its own rounds, one after another
                        finish(trial)
            if trial is not None and trial.error is None:
                slot.trial = trial

    def finish(trial: Trial) -> None:
        if trial.error is not None:
            trial.row.error = trial.error
        elif trial.seconds:
            _record_time(trial)
            out.good.append(trial.row)
            out.seconds[trial.row.rank] = list(trial.seconds)
        out.grads[trial.row.rank] = trial.close()

    def fill_all() -> None:
        for slot in [*splits[:1], *peers, *splits[1:]]:
            if started and time.monotonic() > deadline:
                return  # past the deadline: only what has started
            if slot.peer is None and not slot.filled:
                if sum(s.filled for s in splits) >= measure_top:
                    continue
            fill(slot)

    try:
        fill_all()
        if not any(s.filled for s in [*splits, *peers]) and fallback:
            splits.append(Slot(fallback))  # every split failed: further rows, in order
            fill(splits[-1])
        while hold:
            live = [t for t in started.values() if t.error is None and not t.row.measured]
            if not live:
                break
            time_in_rounds(live, 1, first_round=out.rounds)  # rotated as the rounds go
            out.rounds += 1
            broken = [t for t in live if t.error is not None]
            for trial in broken:  # gives way to its slot's next setting
                finish(trial)
            if broken:
                fill_all()
                continue
            if all(len(t.seconds) >= steps for t in live) and (
                _settled(live)
                or out.rounds >= MAX_ROUNDS_FACTOR * steps
                or time.monotonic() > deadline
            ):
                break
    finally:
        for trial in started.values():
            if trial.row.rank not in out.grads:
                finish(trial)
    return out


def _settled(trials: list[Trial]) -> bool:
    return decide([_timed(t.row, t.seconds) for t in trials]).settled


def _timed(row: TuneRow, seconds: list[float]) -> Timed:
    return Timed(row.rank, seconds, row.recompute_fraction or 0.0, row.accumulation_steps, row.peer)


def _start(
    row: TuneRow,
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: LossFn,
    optimizer_fn: Any,
    limit: int,
    judged: bool,
    device: torch.device,
) -> Trial | None:
    """``row``'s trial after its measured step, or None with the reason in ``row.error``
    (it raised, ran out of memory, or, where ``judged``, peaked over ``limit``)."""
    try:
        trial = Trial.start(
            model_fn,
            batch_fn,
            loss_fn,
            optimizer_fn,
            row,
            limit,
            device=device,
            estimated_plan=not judged,
        )
    except Exception as exc:  # out of memory, a bad plan: recorded, never fatal
        row.error = first_line(exc)
        return None
    row.measured_peak_bytes = trial.peak_bytes
    if not judged:  # an FSDP2 rank's fit rests on the prediction: the row says so
        predicted = row.predicted_peak_bytes
        row.note = (
            "measured in one process with the whole model: "
            f"{format_bytes(trial.peak_bytes)}; the per-rank peak is predicted: "
            f"{'-' if predicted is None else format_bytes(predicted)}"
        )
    if judged and trial.peak_bytes > limit:
        row.error = "over the budget as measured"
        trial.release()  # its gradients are read only for a choice it cannot be
        return None
    return trial


def _record_time(trial: Trial) -> None:
    """The trial's median step time into its row."""
    trial.row.measured_step_seconds = trial.median_seconds


def _units(row: TuneRow) -> int | None:
    """The number of candidate units the estimator's plan decided on (the model itself and
    containers of units left out: :func:`~memfit.monitor.plan_counts.plan_unit_counts`)."""
    if row.plan is None or not row.plan.decisions:
        return None
    return plan_unit_counts(row.plan.decisions, row.plan.segments).units or None
