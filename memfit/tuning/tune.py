"""``memfit.tune``: precision, checkpoint plan, micro-batch and accumulation chosen together.

1. **Search** (:mod:`memfit.candidates`): every precision x strategy x split of the global
   batch estimated on a meta model and fake tensors, ranked by predicted step time;
   nothing real is allocated, so no candidate runs out of memory there.
2. **Measure**: ``measure_top`` splits of the global batch, each with its best predicted
   setting, train a few real steps each (:mod:`memfit.tuning.trials`): the allocator's
   peak, then the median step time of rounds timed side by side. The splits predicted
   within 1.5x of the fastest go first, the largest micro-batch first (the count leaves
   out what makes small micro-batches slow). A trial that runs out of memory, raises, or
   peaks over the budget is recorded in its row and the split's next setting is measured
   in its place.
3. **Choose**: the fastest measured candidate within the budget; with ``measure_top=0``
   the predicted best.

Example::

    res = memfit.tune(lambda: GPT(cfg), lambda n: corpus.batch("train", n, 128), gpt_loss,
                      budget="4GiB", global_batch=64)
    print(res.summary())
    engine = res.engine(model, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.candidates import DEFAULT_PRECISIONS, nothing_fits, rank_candidates
from memfit.checkpoint.api import default_step_loss
from memfit.checkpoint.step_memory import RankLayout
from memfit.errors import BudgetError, ConfigError
from memfit.nested import tensors
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import expand_precisions, matmul_speed
from memfit.tuning.hints import checkpoint_advice, loss_scale_advice, split_advice
from memfit.tuning.result import TuneResult, TuneRow
from memfit.tuning.trials import (
    GradStats,
    Trial,
    cuda_devices,
    first_line,
    holds_trials,
    time_in_rounds,
)
from memfit.units import parse_bytes

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _device_of(batch_fn: Callable[[int], Any]) -> torch.device:
    for t in tensors(batch_fn(1)):
        return t.device
    return torch.device("cpu")


def tune(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
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
    device: str | torch.device | None = None,
) -> TuneResult:
    """Choose precision, checkpoint plan, micro-batch and accumulation for ``budget``.

    Args:
        model_fn: builds the model (on the default device, not moved): the search runs it
            on the meta device, each measured trial builds a fresh one and moves it to
            ``device``.
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
        steps: timed steps per trial (after a warm-up and a measured step).
        device: where trials run (default: where ``batch_fn``'s tensors are).

    Raises:
        ConfigError: a global batch no split makes (the message lists valid ones), an
            unknown precision, a model that cannot run on meta/fake tensors.
        BudgetError: nothing fits (the message gives the smallest budget that would fit
            and the setting that reaches it), or every measured trial failed.

    Example::

        res = memfit.tune(model_fn, batch_fn, loss_fn, budget="2GiB", global_batch=32)
        res.best.precision, res.best.checkpoint, res.best.micro_batch
    """
    if int(measure_top) != measure_top or measure_top < 0:
        raise ConfigError(f"measure_top must be an int >= 0, got {measure_top!r}")
    if int(steps) != steps or steps < 1:
        raise ConfigError(f"steps must be an int >= 1, got {steps!r}")
    loss_fn = loss_fn or default_step_loss
    where = torch.device(device) if device is not None else _device_of(batch_fn)
    limit = parse_bytes(budget, where)
    modes = expand_precisions(precisions or DEFAULT_PRECISIONS, where)
    dtypes = {PrecisionPolicy.of(m).compute_dtype for m in modes} - {torch.float32}
    speed = matmul_speed(where, tuple(sorted(dtypes, key=str)))
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
    )
    # A one-process trial of an FSDP2 rank holds every weight, not its shard: its peak
    # says nothing of the rank's, so only the prediction judges the fit there.
    layout = RankLayout.of(world_size, data_parallel)
    judged = layout.kind != "fsdp"
    if not any(c.fits for c in ranked):
        raise nothing_fits(ranked, limit)
    rows = [TuneRow(c, rank) for rank, c in enumerate(ranked)]

    def start(row: TuneRow) -> Trial | None:
        return _start(row, model_fn, batch_fn, loss_fn, optimizer_fn, limit, judged, where)

    # The trials' timed steps draw from the random generators (dropout): the caller's
    # state is put back when they are done.
    with torch.random.fork_rng(devices=cuda_devices(where), device_type="cuda"):
        good, grads = _measure(rows, measure_top, steps, start, holds_trials(where))
    if measure_top and not good:
        failed = [r for r in rows if r.error]
        raise BudgetError(
            f"every measured trial failed or peaked over the budget ({len(failed)} tried): "
            + "; ".join(
                f"{r.precision}/{r.checkpoint}/{r.micro_batch}x{r.accumulation_steps}: {r.error}"
                for r in failed[:4]
            )
        )
    best = min(good, key=lambda r: r.measured_step_seconds or 0.0) if good else rows[0]
    result = TuneResult(
        best,
        rows,
        limit,
        int(global_batch),
        int(world_size),
        layout.kind,
        speedups={m: speed.speedup(PrecisionPolicy.of(m).compute_dtype) for m in modes},
        speed_measured=speed.measured,
    )
    result.advice = [
        loss_scale_advice(grads.get(best.rank), best.precision),
        checkpoint_advice(best, _units(best)),
        split_advice(rows, best, limit),
    ]
    return result


#: Splits whose best predicted time is within this factor of the fastest are measured
#: first, the largest micro-batch first: the count leaves out each micro-batch's fixed
#: cost and small matmuls' lower efficiency, so a larger micro-batch is faster than
#: counted (a full recompute costs at most a third more, well inside the factor).
SLACK = 1.5
#: Candidates of one split tried in turn when the one before failed or went over the budget.
ATTEMPTS_PER_SPLIT = 3
#: Further candidates tried, in the order of prediction, when every split's failed.
FALLBACK_TRIALS = 8


def _measure_order(rows: list[TuneRow]) -> list[list[TuneRow]]:
    """The fitting rows grouped by split, each group in the order of prediction, the groups
    in the order to measure: those within :data:`SLACK` of the fastest prediction by
    micro-batch, largest first, then the rest by their best rank. One success per group
    counts; the next row of a group stands in for one that failed."""
    groups: dict[int, list[TuneRow]] = {}
    for r in rows:
        if r.fits:
            groups.setdefault(r.micro_batch, []).append(r)
    fastest = min(g[0].predicted_step_seconds or 0.0 for g in groups.values())
    near = [m for m, g in groups.items() if (g[0].predicted_step_seconds or 0.0) <= SLACK * fastest]
    rest = [m for m in groups if m not in near]
    order = sorted(near, reverse=True) + sorted(rest, key=lambda m: groups[m][0].rank)
    return [groups[m] for m in order]


def _measure(
    rows: list[TuneRow],
    measure_top: int,
    steps: int,
    start: Callable[[TuneRow], Trial | None],
    hold: bool,
) -> tuple[list[TuneRow], dict[int, GradStats | None]]:
    """Measure up to ``measure_top`` splits, one setting each: the rows measured within
    the budget, and the gradients each trial read for the advice.

    Each split's settings are tried in the order of prediction (up to
    :data:`ATTEMPTS_PER_SPLIT`) until one starts; with ``hold``, the started trials are
    timed side by side in rounds, and a trial whose timed step raises gives way to its
    split's next setting, which is started and timed with the trials still held (they get
    more rounds). Without ``hold`` each trial is timed alone and released. A failed trial
    never ends the search: where every split failed, up to :data:`FALLBACK_TRIALS` more
    rows are tried in the order of prediction."""
    groups = _measure_order(rows)
    tried = {id(r) for g in groups for r in g[:ATTEMPTS_PER_SPLIT]}
    queues = [list(g[:ATTEMPTS_PER_SPLIT]) for g in groups]
    fallback = [r for r in rows if r.fits and id(r) not in tried][:FALLBACK_TRIALS]
    good: list[TuneRow] = []
    grads: dict[int, GradStats | None] = {}
    held: dict[int, Trial] = {}  # split index -> its trial, timed so far without error
    measured: set[int] = set()  # splits with a good row
    try:
        while True:
            for g, queue in enumerate(queues):
                if len(measured) + len(held) >= measure_top:
                    break
                if g in measured or g in held:
                    continue
                while queue and g not in held:
                    trial = start(queue.pop(0))
                    if trial is None:
                        continue
                    if hold:
                        held[g] = trial
                        continue
                    time_in_rounds([trial], steps)
                    grads[trial.row.rank] = trial.close()
                    if trial.error is None:
                        _record_time(trial)
                        good.append(trial.row)
                        measured.add(g)
                        break
                    trial.row.error = trial.error
            if not held and not measured and fallback and not any(queues):
                queues.append(fallback)  # every split failed: further rows, in order
                fallback = []
                continue
            if not held or all(t.seconds for t in held.values()):
                break  # nothing new to time
            time_in_rounds(list(held.values()), steps)
            for g, trial in list(held.items()):
                if trial.error is not None:  # gives way to its split's next setting
                    trial.row.error = trial.error
                    grads[trial.row.rank] = trial.close()
                    del held[g]
        for trial in held.values():
            _record_time(trial)
            good.append(trial.row)
    finally:
        for trial in held.values():
            grads[trial.row.rank] = trial.close()
    return good, grads


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
    if judged and trial.peak_bytes > limit:
        row.error = "over the budget as measured"
        trial.release()  # its gradients are read only for a choice it cannot be
        return None
    return trial


def _record_time(trial: Trial) -> None:
    """The trial's median step time into its row."""
    trial.row.measured_step_seconds = trial.median_seconds


def _units(row: TuneRow) -> int | None:
    """The number of candidate units the estimator's plan decided on."""
    return len(row.plan.decisions) if row.plan is not None and row.plan.decisions else None
