"""``micro_batch="auto"``: the splits of the first batch timed on the Engine's own model,
chosen by the rule the tuner uses (:mod:`memfit.trials`).

The search (:func:`memfit.candidates.rank_candidates`, on a meta copy) ranks every split
of the global batch by predicted step time; a prediction cannot tell settings a few
percent apart, nor count each micro-batch's fixed cost. So the Engine times, on its first
batch:

- the best predicted splits (:func:`~memfit.trials.slots.split_queues`, up to
  :data:`SPLITS_TIMED` in each mode), each under the plan the Engine would train it with (its
  ``checkpoint=`` strategy at the budget, planned on the model itself);
- the **peers** (:func:`~memfit.trials.slots.peer_queues`), where the Engine plans the
  checkpointing itself (``checkpoint="auto"``): halving the micro-batch until it fits
  without checkpointing, and every block checkpointed with the whole batch. Only
  settings predicted to fit are timed: nothing here measures a peak first, and the
  Engine's closed loop measures the chosen plan's first step.

With ``precision="auto"`` too, the splits are timed in each candidate mode (unless the
matmul probe settles the mode: :func:`~memfit.precision.speed.probe_settles`), and a 16-bit
mode is chosen only when its fastest setting is :data:`~memfit.precision.speed.AUTO_MARGIN`
times faster than fp32's, the rule ``precision="auto"`` has alone.

A trial is the global batch's forward and backward, split as the setting says, under its
precision and plan. No optimizer step runs: the same for every setting (the weights stay
fp32 in every mode ``"auto"`` chooses from), it cannot change which is fastest (it only
makes the 2% tie margin a little stricter). The trials run one warm-up each, then
interleaved rounds (the order rotated each round) until
:func:`~memfit.trials.decide.decide` settles, up to
:data:`~memfit.trials.slots.MAX_ROUNDS_FACTOR` x :data:`ROUNDS`, and no new round once
:data:`TIMING_BUDGET_S` have passed (at least one round always runs). In a tie the
simplest setting wins (least recompute, then fewest micro-batches), and never one
measured slower than a peer.

Training sees none of it: the random generators, gradients and buffers are put back
(:func:`memfit.precision.mode_timing.restored_training`), every plan is removed, and no
optimizer step runs. A setting that runs out of memory or raises is dropped (the next of
its slot is tried); where every one fails, the prediction's choice stands.

Example::

    timed = time_splits(model, optimizer, batch, loss_fn, ranked, TrialSettings(...))
    timed.best.candidate.accumulation_steps, timed.verdict
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.apply import planned
from memfit.engine.batches import Batch, batch_size, checked_loss, split_batch
from memfit.engine.plan_stage import EnginePlan, plan_from_profile
from memfit.errors import MemfitError
from memfit.precision.apply import precision_applied
from memfit.precision.mode_timing import restored_training
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import AUTO_MARGIN
from memfit.trials.decide import Timed, decide
from memfit.trials.slots import MAX_ROUNDS_FACTOR, Slot, peer_queues, split_queues

#: The best predicted splits timed in each mode (each with its best predicted setting).
SPLITS_TIMED = 3
#: Timed rounds at least (after one warm-up run of each trial), time allowing.
ROUNDS = 3
#: No new round starts once the trials took this long (warm-ups and planning included);
#: a model whose step takes seconds is timed in one round, not twelve.
TIMING_BUDGET_S = 20.0


@dataclass(frozen=True)
class TrialSettings:
    """What the trials need from the Engine besides the model and the batch."""

    device: torch.device
    budget: int
    """The memory budget the splits were ranked under (a plan is made under it)."""
    strategy: str | None
    """The Engine's checkpoint strategy for a split (``"optimal"`` for ``"auto"``), or
    None: no checkpointing."""
    peers: bool
    """Whether to time the peers (the Engine plans the checkpointing itself)."""
    modes: Sequence[str]
    """The precision modes to time (one unless ``precision="auto"`` is still open)."""
    fp32_islands: tuple[type[nn.Module], ...] | None = None
    units: list[str] | None = None


@dataclass
class SplitTrial:
    """One setting timed on the Engine's model."""

    candidate: Any
    """The search's candidate (precision, split, predicted peak and time)."""
    peer: str | None
    policy: PrecisionPolicy
    plan: EnginePlan | None
    """The checkpoint plan it runs under; None: no checkpointing."""
    recompute_fraction: float
    """Recomputed share of a forward under ``plan`` (0.0 without one)."""
    seconds: list[float] = field(default_factory=list)
    """The timed runs, one per round (the warm-up's left out)."""
    warmup_seconds: float = 0.0
    error: str | None = None

    @property
    def accumulation_steps(self) -> int:
        return int(self.candidate.accumulation_steps)

    @property
    def recomputes(self) -> bool:
        """Whether its plan recomputes anything (a plan that does not is not applied)."""
        return self.plan is not None and self.plan.result.plan.recompute_flops > 0

    def describe(self) -> str:
        what = self.peer or "split"
        plan = "no checkpointing"
        if self.recomputes and self.plan is not None:
            plan = f"{self.plan.result.strategy} plan, {self.recompute_fraction:.0%} recomputed"
        return (
            f"{self.policy.mode}, micro-batch {self.candidate.micro_batch} x "
            f"{self.accumulation_steps}, {plan} ({what})"
        )


@dataclass(frozen=True)
class TimedSplits:
    """What the trials chose and how."""

    best: SplitTrial
    trials: list[SplitTrial]
    """Every setting timed (those that failed with their ``error``)."""
    rounds: int
    verdict: str
    """One sentence: why ``best`` won."""
    seconds: float
    """Wall seconds the trials took, planning included."""

    def describe(self) -> str:
        """One line: the choice, each timed setting's median, and why.

        Example::

            engine.auto.split_timed.describe()
            # micro_batch auto: fp32, micro-batch 8 x 2, no checkpointing (halving) of 4 timed
            # in 3 rounds (...); fastest, separated from every other trial (...)
        """
        rows = "; ".join(
            f"{t.describe()}: {t.error or f'{_median(t.seconds) * 1e3:.1f} ms'}"
            for t in self.trials
        )
        return (
            f"micro_batch auto: {self.best.describe()} of {len(self.trials)} timed in "
            f"{self.rounds} rounds, {self.seconds:.1f} s ({rows}); {self.verdict}"
        )

    def mode_seconds(self) -> dict[str, float]:
        """Each mode's fastest median over its trials (the timed global batch)."""
        return _fastest_by_mode(self.trials)


def time_splits(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    ranked: Sequence[Any],
    settings: TrialSettings,
) -> TimedSplits | None:
    """Time the best predicted splits of ``ranked`` and the peers on ``model`` with
    ``batch`` (the global batch), and choose; None when there is nothing to choose
    between (fewer than two settings to time) or every trial failed.

    Example::

        timed = time_splits(model, opt, batch, loss_fn, ranked, settings)
        chosen = timed.best.candidate if timed else ranked[0]
    """
    began = time.monotonic()
    slots: list[Slot] = []
    for mode in settings.modes:  # each mode's own best splits: fp32 is always timed
        slots += split_queues([r for r in ranked if r.precision == mode])[:SPLITS_TIMED]
    if settings.peers:
        rows = batch_size(batch)
        slots += peer_queues(
            ranked, settings.modes, rows, settings.budget, slack=1.0, mode_slack=math.inf
        )
    if len(slots) < 2:
        return None
    device = settings.device
    trials: list[SplitTrial] = []
    rounds = 0
    with restored_training(model, device) as restart:
        maker = _TrialMaker(model, optimizer, batch, loss_fn, settings)
        for slot in slots:
            _fill(slot, maker, trials, restart)
        live = [t for t in trials if t.error is None]
        if len(live) < 2:  # one setting ran: its warm-up is all there is to go by
            for t in live:
                t.seconds = [t.warmup_seconds]
            return choose_timed(trials, rounds, began) if live else None
        while True:
            for i in range(len(live)):
                trial = live[(i + rounds) % len(live)]
                if trial.error is None:
                    _time(trial, model, batch, loss_fn, device, restart)
            rounds += 1
            live = [t for t in live if t.error is None]
            if len(live) < 2:
                break
            enough = rounds >= ROUNDS and _verdict(live).settled
            if enough or rounds >= MAX_ROUNDS_FACTOR * ROUNDS:
                break
            if time.monotonic() - began > TIMING_BUDGET_S:
                break
    if not any(t.error is None and t.seconds for t in trials):
        return None
    return choose_timed(trials, rounds, began)


class _TrialMaker:
    """Makes a slot's row into a trial: its policy and plan (profiles shared by mode and
    micro-batch)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Batch,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        settings: TrialSettings,
    ) -> None:
        self.model, self.optimizer, self.batch, self.loss_fn = model, optimizer, batch, loss_fn
        self.settings = settings
        self.profiles: dict[tuple[str, int], Any] = {}
        self.made: dict[tuple[str, int, str | None], SplitTrial] = {}

    def policy(self, mode: str) -> PrecisionPolicy:
        islands = self.settings.fp32_islands
        return (
            PrecisionPolicy(mode)
            if islands is None
            else PrecisionPolicy(mode, fp32_islands=islands)
        )

    def make(self, row: Any, peer: str | None) -> SplitTrial:
        """The trial of ``row`` as ``peer`` (None: a split, under the Engine's strategy);
        a trial already made for the same setting serves again. A plan that recomputes
        nothing is the setting without checkpointing (the halving peer's, where the
        split is the same), and is kept for the Engine to train with."""
        strategy = {"halving": None, "per-block": "full"}.get(peer or "", self.settings.strategy)
        policy = self.policy(row.precision)
        plan = self._plan(row, policy, strategy) if strategy is not None else None
        fraction = 0.0
        if plan is not None and plan.result.plan.recompute_flops > 0:
            flops = plan.result.profile.root.fwd_flops
            fraction = plan.result.plan.recompute_flops / flops if flops else 0.0
        else:
            strategy = None
        key = (row.precision, int(row.accumulation_steps), strategy)
        trial = self.made.get(key)
        if trial is None:
            trial = self.made[key] = SplitTrial(row, peer, policy, plan, fraction)
        elif trial.plan is None:
            trial.plan = plan
        return trial

    def _plan(self, row: Any, policy: PrecisionPolicy, strategy: str) -> EnginePlan:
        from memfit.checkpoint.profile_stage import profile_step

        micro = _micro_batches(self.batch, int(row.accumulation_steps))[0]
        where = (policy.mode, batch_size(micro))
        if where not in self.profiles:
            self.profiles[where] = profile_step(
                self.model, micro, self.loss_fn, policy, self.settings.units
            )
        budget = self.settings.budget if strategy == "optimal" else None
        return plan_from_profile(
            self.model,
            self.profiles[where],
            policy,
            self.optimizer,
            strategy,
            budget,
            int(row.accumulation_steps),
        )


def _fill(
    slot: Slot, maker: _TrialMaker, trials: list[SplitTrial], restart: Callable[[], None]
) -> None:
    """Start ``slot``'s first row that plans and runs its warm-up (a row that raises or
    runs out of memory gives way to the next)."""
    while slot.queue and not slot.filled:
        row = slot.queue.pop(0)
        slot.tried.append(row)
        try:
            trial = maker.make(row, slot.peer)
        except (MemfitError, torch.OutOfMemoryError, RuntimeError):
            _release(maker.settings.device)
            continue  # a setting the Engine cannot plan here is not timed
        if trial.peer is None and slot.peer is not None:
            trial.peer = slot.peer  # a split's setting that is also a peer's
        if all(t is not trial for t in trials):
            trials.append(trial)
            # The warm-up: kernel choice, lazy caches, the allocator's first blocks.
            _time(trial, maker.model, maker.batch, maker.loss_fn, maker.settings.device, restart)
            if trial.seconds:
                trial.warmup_seconds = trial.seconds.pop()
        slot.trial = trial


def _time(
    trial: SplitTrial,
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    restart: Callable[[], None],
) -> None:
    """One timed forward and backward of the whole batch under ``trial``'s setting; a
    failure is kept in ``trial.error``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    micros = _micro_batches(batch, trial.accumulation_steps)
    total = batch_size(batch)
    restart()  # the same random draws and fresh gradients every run
    plan = trial.plan.result.plan if trial.recomputes and trial.plan is not None else None
    try:
        with planned(model, plan) if plan is not None else contextlib.nullcontext():
            with precision_applied(model, trial.policy):
                sync()
                begin = time.perf_counter()
                for micro in micros:
                    with trial.policy.autocast(device.type):
                        loss = checked_loss(loss_fn(model, micro))
                    # Weighted as the Engine weights a micro-batch (its share of the batch).
                    (loss * (batch_size(micro) / total)).backward()
                sync()
                trial.seconds.append(time.perf_counter() - begin)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        lines = str(exc).splitlines()
        trial.error = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
        _release(device)


def _micro_batches(batch: Batch, accumulation_steps: int) -> list[Batch]:
    return split_batch(batch, min(batch_size(batch), accumulation_steps))


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _verdict(trials: Sequence[SplitTrial]) -> Any:
    return decide(
        [
            Timed(i, t.seconds, t.recompute_fraction, t.accumulation_steps, t.peer)
            for i, t in enumerate(trials)
        ]
    )


def choose_timed(trials: list[SplitTrial], rounds: int, began: float) -> TimedSplits:
    """The mode (a 16-bit one only when :data:`AUTO_MARGIN` times faster than fp32), then
    the verdict among that mode's trials; ``began``: when timing began
    (``time.monotonic()``).

    Example::

        choose_timed(trials, rounds=3, began=start).best.policy.mode   # "fp32"
    """
    good = [t for t in trials if t.error is None and t.seconds]
    fastest = _fastest_by_mode(good)
    mode = min(fastest, key=fastest.__getitem__)
    if mode != "fp32" and "fp32" in fastest and fastest["fp32"] / fastest[mode] < AUTO_MARGIN:
        mode = "fp32"  # a 16-bit mode only when clearly faster, as precision="auto" alone
    own = [t for t in good if t.policy.mode == mode]
    verdict = _verdict(own)
    best = own[verdict.best.key]
    why = verdict.describe()
    if len(fastest) > 1:
        why = f"{mode} ({', '.join(f'{m} {s * 1e3:.0f} ms' for m, s in fastest.items())}); {why}"
    timed = [t for t in trials if t.error is not None or t.seconds]
    return TimedSplits(best, timed, rounds, why, time.monotonic() - began)


def _fastest_by_mode(trials: Sequence[SplitTrial]) -> dict[str, float]:
    """Each mode's lowest median over the trials that ran without error."""
    out: dict[str, float] = {}
    for t in trials:
        if t.error is None and t.seconds:
            m = _median(t.seconds)
            out[t.policy.mode] = min(out.get(t.policy.mode, m), m)
    return out


def _median(seconds: Sequence[float]) -> float:
    return statistics.median(seconds)
