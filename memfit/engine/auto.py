"""The Engine's choices made on the first batch: ``precision="auto"`` and ``micro_batch="auto"``.

``precision="auto"``: the weights stay fp32, so the candidates are the autocast modes
(``fp32`` and ``bf16-mixed``, or ``fp16-mixed`` with dynamic loss scaling on a GPU without
bf16: :func:`memfit.precision.speed.auto_candidates`). On the first micro-batch, before
the first plan (which depends on the precision), the model's own forward and backward is
timed in each candidate (:mod:`memfit.precision.mode_timing`, which leaves training
bitwise as it was) and the Engine trains in the fastest (a 16-bit mode only when clearly
faster). The matmul probe comes first: a 16-bit ratio far below 1 settles it on fp32
without timing. The probe alone decides under DDP/FSDP2 (rank 0's, for every rank),
where injected probe speeds are given without model seconds (tests), and after an
out-of-memory error while timing. From then on ``engine.settings.precision`` names the
mode chosen, and a saved state keeps it: a resumed run trains in the same mode without
measuring again.

``micro_batch="auto"`` (with ``memory_budget``, or 90% of the device's memory): the first
``train_step``'s batch is the global batch; the tuner's search
(:func:`memfit.candidates.rank_candidates`, on a meta copy of the model and fake tensors)
picks how to split it (``accumulation_steps``) under the Engine's precision and checkpoint
request, and the batch is split so. ``engine.settings.accumulation_steps`` then holds the
choice and is saved with it.

Nothing here takes the Engine: it is given what the choices need (:class:`FirstBatch`)
and returns what was chosen (:class:`~memfit.precision.speed.PrecisionChoice`,
:class:`SplitChoice`); the Engine records the choices itself, in the order of
``Engine._first_batch_choices``, and trains in a chosen mode by
:func:`memfit.engine.precision_stage.switched_precision`.

Example::

    engine = memfit.Engine(model, opt, precision="auto", micro_batch="auto", memory_budget="4GiB")
    engine.train_step(batch, loss_fn)
    engine.settings.precision, engine.settings.accumulation_steps   # ("bf16-mixed", 2)
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from memfit.engine.batches import Batch, batch_size, checked_loss, split_batch
from memfit.engine.settings import default_memory_budget
from memfit.errors import ConfigError
from memfit.precision.policy import AUTO, PrecisionPolicy, is_auto
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.candidates import Candidate
    from memfit.engine.split_trials import TimedSplits
    from memfit.precision.speed import PrecisionChoice


@dataclass
class AutoRequest:
    """What the Engine still has to choose on its first batch, and what it chose."""

    precision: bool = False
    micro_batch: bool = False
    default_scaler: bool = True
    """Whether the Engine made its own loss scaler (replaced by a dynamic one when the
    choice is ``fp16-mixed``)."""
    precision_choice: PrecisionChoice | None = None
    split_choice: Candidate | None = None
    split_ranked: list[Candidate] | None = None
    """Every split ``micro_batch="auto"`` ranked, for a smaller micro-batch when the chosen
    one's least plan measures over the budget (:func:`next_split`)."""
    split_request: Any = None
    """The checkpoint request the split was chosen under (planned again for another)."""
    split_timed: TimedSplits | None = None
    """The trials ``micro_batch="auto"`` timed (None: the prediction chose)."""
    split_plan: Any = None
    """The plan the timed trials made for the chosen split (an EnginePlan), which the
    Engine trains with instead of planning again; None: the Engine plans."""

    @property
    def pending(self) -> bool:
        return self.precision or self.micro_batch


class StartingPolicy(NamedTuple):
    """The policy an Engine starts with and what it has left to choose."""

    policy: PrecisionPolicy
    auto: AutoRequest


@dataclass(frozen=True)
class FirstBatch:
    """What the first batch's choices need from the Engine (its own objects, not copies).

    Example::

        first = FirstBatch(model, optimizer, torch.device("cpu"), PrecisionPolicy("fp32"), "auto")
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    policy: PrecisionPolicy
    """The policy the Engine trains in so far (fp32 until an ``"auto"`` one is chosen)."""
    checkpoint_request: Any
    """The Engine's ``checkpoint=`` request, not yet planned."""
    memory_budget: int | None = None
    data_parallel: bool = False
    """Whether the Engine trains under DDP/FSDP2: rank 0's choices are every rank's."""
    ranges: Any = None
    """The monitor's activation ranges, which must not record the timing's passes."""
    units: list[str] | None = None
    """The Engine's candidate units for its plans (None: those ``find_units`` finds)."""


@dataclass(frozen=True)
class SplitChoice:
    """What ``micro_batch="auto"`` chose on the global batch.

    Example::

        choice = choose_split(first, batch, loss_fn, with_precision=False)
        engine.settings.accumulation_steps = choice.fitting().accumulation_steps
    """

    split: Candidate | None
    """The best split that fits (rank 0's under DDP/FSDP2), or None when none fits."""
    ranked: list[Candidate]
    """Every split, best first."""
    budget: int
    """The budget they were ranked under."""
    precision: PrecisionChoice | None = None
    """With ``precision="auto"`` too: the mode chosen with the split."""
    timed: TimedSplits | None = None
    """The trials that chose it (None: chosen by prediction); the chosen trial's plan is
    the one the Engine trains with."""

    def fitting(self) -> Candidate:
        """The split; the BudgetError naming the least peak of all when none fits."""
        if self.split is None:
            from memfit.candidates import nothing_fits

            raise nothing_fits(self.ranked, self.budget)
        return self.split


def auto_policy(
    precision: Any, micro_batch: Any, accumulation_steps: Any, scaler: Any
) -> StartingPolicy:
    """The policy the Engine starts with (fp32 until an ``"auto"`` precision is chosen)
    and what is left to choose; ConfigError for a ``micro_batch`` it cannot use.

    Example::

        policy, auto = auto_policy("auto", None, 1, None)   # fp32 for now, auto.precision
    """
    if micro_batch not in (None, AUTO):
        raise ConfigError(
            f"micro_batch takes 'auto' or None, got {micro_batch!r}; to fix the micro-batch "
            "give accumulation_steps (train_step splits each batch into that many)"
        )
    if micro_batch == AUTO and accumulation_steps != 1:
        raise ConfigError(
            f"micro_batch='auto' chooses accumulation_steps itself; drop "
            f"accumulation_steps={accumulation_steps!r} or micro_batch='auto'"
        )
    auto = is_auto(precision)
    policy = PrecisionPolicy("fp32") if auto else PrecisionPolicy.of(precision)
    return StartingPolicy(policy, AutoRequest(auto, micro_batch == AUTO, scaler is None))


def probe_choice(device: torch.device, data_parallel: bool) -> PrecisionChoice:
    """The matmul probe's choice on ``device`` (rank 0's under DDP/FSDP2).

    Example::

        probe_choice(torch.device("cpu"), data_parallel=False).mode   # "fp32" on most CPUs
    """
    from memfit.precision.speed import choose_precision

    choice = choose_precision(device)
    if data_parallel:  # every rank trains in rank 0's choice
        from memfit.distributed.collectives import from_rank0

        choice = from_rank0(choice)
    return choice


def timed_choice(
    first: FirstBatch, probe: PrecisionChoice, micro: Batch, loss_fn: Any
) -> PrecisionChoice:
    """The choice remade from the model's own forward and backward of ``micro`` in each
    candidate mode (:func:`memfit.precision.mode_timing.auto_choice`); the probe's choice under
    data parallel (collectives in the passes would time the slowest rank, differently on
    each). Errors of ``loss_fn`` propagate.

    Example::

        choice = timed_choice(first, probe_choice(first.device, False), micro, loss_fn)
    """
    from dataclasses import replace

    from memfit.precision.mode_timing import auto_choice

    if first.data_parallel:
        return replace(probe, note="data parallel: rank 0's probe decides for every rank")
    ranges = first.ranges
    with ranges.unrecorded() if ranges is not None else contextlib.nullcontext():
        return auto_choice(
            first.model,
            micro,
            lambda model, b: checked_loss(loss_fn(model, b)),
            first.device,
            first.policy.fp32_islands,
        )


def choose_precision(first: FirstBatch, micro: Batch, loss_fn: Any) -> PrecisionChoice:
    """``precision="auto"``'s mode, from the probe and the model timed on ``micro`` (the
    first micro-batch).

    Example::

        choose_precision(first, micro, loss_fn).mode   # "bf16-mixed" where clearly faster
    """
    return timed_choice(first, probe_choice(first.device, first.data_parallel), micro, loss_fn)


def choose_split(
    first: FirstBatch, batch: Batch, loss_fn: Any, with_precision: bool
) -> SplitChoice:
    """How ``train_step`` splits a ``micro_batch="auto"`` Engine's batches, chosen on its
    first batch (the global batch): the best predicted splits and the peers timed on the
    model (:mod:`memfit.engine.split_trials`); with ``precision="auto"`` too
    (``with_precision``), in each candidate mode the probe leaves open, and the choice
    holds the mode. Under DDP/FSDP2, or where nothing is left to time, the prediction
    chooses (with the model timed in each mode on the micro-batch it splits to).

    Example::

        choice = choose_split(first, batch, loss_fn, with_precision=True)
        choice.precision.mode, choice.fitting().accumulation_steps
    """
    if not first.data_parallel:
        timed = _split_by_trials(first, batch, loss_fn, with_precision)
        if timed is not None:
            return timed
    precision: PrecisionChoice | None = None
    if with_precision:
        probe = probe_choice(first.device, first.data_parallel)
        ranked = _ranked_splits(first, batch, loss_fn, [probe.mode])
        precision = probe
        if ranked and ranked[0].fits:
            micro = split_batch(batch, min(batch_size(batch), ranked[0].accumulation_steps))[0]
            precision = timed_choice(first, probe, micro, loss_fn)
        if precision.mode != probe.mode:
            ranked = _ranked_splits(first, batch, loss_fn, [precision.mode])
    else:
        ranked = _ranked_splits(first, batch, loss_fn, [first.policy.mode])
    best = ranked[0] if ranked and ranked[0].fits else None
    if first.data_parallel:
        # Each rank ranked with its own measured speed, and near ties may fall either way:
        # every rank splits as rank 0 chose (and all raise together when nothing fits).
        from memfit.distributed.collectives import from_rank0

        best = from_rank0(best)
    return SplitChoice(best, ranked, _budget(first), precision)


def _split_by_trials(
    first: FirstBatch, batch: Batch, loss_fn: Any, with_precision: bool
) -> SplitChoice | None:
    """The split (and mode) the timed trials choose; None where the prediction's way
    decides instead: a mode the model is to be timed in alone (injected model seconds,
    lazy modules), or more than one mode and nothing to time."""
    from dataclasses import replace

    from memfit.engine.split_trials import TrialSettings, time_splits
    from memfit.precision.speed import model_seconds_assumed, probe_settles

    modes = [first.policy.mode]
    probe = probe_choice(first.device, False) if with_precision else None
    why = ""
    if probe is not None:
        why = probe_settles(probe, first.device)
        lazy = any(nn.parameter.is_lazy(p) for p in first.model.parameters())
        if not why and (lazy or model_seconds_assumed(first.device) is not None):
            return None
        modes = [probe.mode] if why else list(probe.speedups)
    ranked = _ranked_splits(first, batch, loss_fn, modes)
    request = first.checkpoint_request
    strategy = None if request == "none" else "optimal" if request == AUTO else request
    settings = TrialSettings(
        device=first.device,
        budget=_budget(first),
        strategy=strategy,
        peers=request == AUTO,
        modes=modes,
        fp32_islands=first.policy.fp32_islands,
        units=first.units,
    )
    ranges = first.ranges
    with ranges.unrecorded() if ranges is not None else contextlib.nullcontext():
        timed = time_splits(first.model, first.optimizer, batch, loss_fn, ranked, settings)
    precision = None
    if timed is None:
        if len(modes) > 1:
            return None
        best = ranked[0] if ranked and ranked[0].fits else None
        if probe is not None:
            precision = replace(probe, note=why)
        return SplitChoice(best, ranked, _budget(first), precision)
    if probe is not None:
        seconds = timed.mode_seconds() if len(modes) > 1 else {}
        precision = replace(
            probe,
            mode=timed.best.policy.mode,
            model_seconds=seconds if len(seconds) > 1 else {},
            timing_seconds=timed.seconds,
            model_timing="the fastest timed split of the first batch, forward+backward",
            note=why or "",
        )
    return SplitChoice(timed.best.candidate, ranked, _budget(first), precision, timed)


def next_split(ranked: list[Candidate], accumulation_steps: int, mode: str) -> Candidate | None:
    """The split ``micro_batch="auto"`` moves to when the chosen one's first step measured
    over the budget under its least plan: the fewest micro-batches above
    ``accumulation_steps`` among those predicted to fit in ``mode`` (the usual fix, a
    smaller micro-batch, made for the user); None when there is none.

    Example::

        next_split(ranked, 1, "fp32").accumulation_steps   # 2
    """
    more = [
        c
        for c in ranked
        if c.fits and c.precision == mode and c.accumulation_steps > accumulation_steps
    ]
    return min(more, key=lambda c: c.accumulation_steps) if more else None


def smaller_split(
    auto: AutoRequest, accumulation_steps: int, mode: str, peak_bytes: int, budget: int | None
) -> Candidate | None:
    """The split a ``micro_batch="auto"`` Engine moves to when its first step, split into
    ``accumulation_steps`` micro-batches, peaked at ``peak_bytes`` under its least plan,
    over ``budget`` (:func:`next_split`), with a warning that says so; None where
    ``micro_batch="auto"`` did not choose the split or no split has more micro-batches.
    The Engine then trains with it from the next step, planned again.

    Example::

        nxt = smaller_split(engine.auto, 1, "fp32", peak_bytes=5 << 20, budget=4 << 20)
        nxt.accumulation_steps if nxt is not None else None   # 2
    """
    if auto.split_ranked is None:
        return None
    nxt = next_split(auto.split_ranked, accumulation_steps, mode)
    if nxt is None:
        return None
    warnings.warn(
        f"micro_batch='auto': the step split into {accumulation_steps} micro-batch(es) peaked "
        f"at {format_bytes(peak_bytes)} under its least plan, over the budget "
        f"{format_bytes(budget or 0)}; from the next step the batch is split into "
        f"{nxt.accumulation_steps} (micro-batch {nxt.micro_batch})",
        stacklevel=5,  # past Engine._split_smaller, _judge_measured and step: step()'s caller
    )
    return nxt


def _budget(first: FirstBatch) -> int:
    return first.memory_budget or default_memory_budget(first.device)


def _ranked_splits(
    first: FirstBatch, batch: Batch, loss_fn: Any, modes: list[str]
) -> list[Candidate]:
    """Every split of ``batch`` under each of ``modes`` and the checkpoint request, best
    first."""
    from memfit.candidates import meta_clone, rank_candidates
    from memfit.estimator import STRATEGIES

    request = first.checkpoint_request
    if isinstance(request, str) and request != AUTO:
        strategies: tuple[str, ...] = (request,)  # the strategy asked for, at each split
    elif isinstance(request, str):
        strategies = STRATEGIES
    else:
        raise ConfigError(
            "micro_batch='auto' plans the micro-batch, so a Plan made for one micro-batch "
            "cannot be given; pass checkpoint='auto' (or a strategy) instead"
        )
    model, optimizer = first.model, first.optimizer
    rows = batch_size(batch)

    def micro(n: int) -> Any:
        return split_batch(batch, rows // n)[0] if n < rows else batch

    return rank_candidates(
        lambda: meta_clone(model),
        micro,
        loss_fn,
        budget=_budget(first),
        global_batch=rows,
        precisions=modes,
        strategies=strategies,
        optimizer_fn=lambda params: type(optimizer)(params, **_plain_defaults(optimizer)),
        device=first.device,
    )


def _plain_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's constructor defaults, without flags a meta copy cannot use."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    skip = ("fused", "foreach", "capturable", "differentiable")
    return {k: v for k, v in optimizer.defaults.items() if k in takes and k not in skip}
