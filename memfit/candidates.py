"""The tuner's search: precision x checkpoint plan x micro-batch x accumulation, ranked.

Every way to make the global batch (``micro_batch x accumulation_steps x world_size ==
global_batch``) is tried under each precision and checkpoint strategy on the estimator's
meta model and fake tensors (:func:`memfit.estimate_cells.estimate_cells`): nothing real is
allocated, so no candidate runs out of memory. Each candidate gets a predicted peak and a
predicted step time, and they are ranked: those that fit first, then by time.

The step time is counted, not guessed: one step does ``accumulation_steps`` forward and
backward passes of a micro-batch plus what the plan recomputes, each counted from its
FLOPs and the bytes it saves (the estimator's counted times: backward twice the forward),
and rescaled from the counted FLOP rate to the one the matmul probe measured for the
precision's compute dtype on the device (:mod:`memfit.precision.speed`). What the count
leaves out (the optimizer step, which is the same for every split; each micro-batch's
fixed overhead; smaller matmuls' lower efficiency) the tuner measures on the model and
puts back with :func:`retime` (:mod:`memfit.tuning.calibrate`); what is left is why times
within 5% count as a tie that the larger micro-batch wins, and why the tuner then
measures the top candidates on real steps.

Example::

    ranked = rank_candidates(model_fn, batch_fn, loss_fn, budget=2**28, global_batch=16)
    ranked[0].precision, ranked[0].checkpoint, ranked[0].micro_batch
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.costs import COUNTED_FLOP_RATE
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.step_memory import RankLayout
from memfit.deprecations import warn_renamed
from memfit.errors import BudgetError, ConfigError
from memfit.estimate_cells import estimate_cells
from memfit.estimator import STRATEGIES
from memfit.precision.optimizer_state import kept_as
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import MatmulSpeed, expand_precisions, matmul_speed
from memfit.units import format_bytes

__all__ = [
    "Candidate",
    "meta_clone",
    "nothing_fits",
    "rank_candidates",
    "retime",
    "split_choices",
]

#: The precisions the tuner compares by default (those of ``memfit.estimate``).
DEFAULT_PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16-master")


@dataclass(frozen=True)
class Candidate:
    """One setting the tuner considered, with the estimator's predictions."""

    precision: str
    checkpoint: str
    """``none``, ``full``, ``sqrt`` or ``optimal`` (planned at the budget)."""
    micro_batch: int
    accumulation_steps: int
    predicted_peak_bytes: float | None
    """None when the strategy has no plan under the budget."""
    predicted_step_seconds: float | None
    recompute_fraction: float | None
    fits: bool
    plan: Plan | None = None
    note: str = ""
    recompute_step_seconds: float = 0.0
    """The part of ``predicted_step_seconds`` that is the plan's recompute."""
    optimizer_state: str = "fp32"
    """How the optimizer keeps its state (``Engine(optimizer_state=)``)."""
    release_gradients: bool = False
    """Each update applied as its gradient is made in backward
    (``Engine(release_gradients=True)``)."""
    activation_storage: tuple[str, ...] = ("keep", "recompute")
    """What an ``optimal`` plan may do with a block's saved tensors
    (``Engine(activation_storage=)``); the estimator's ``plan.storage`` says what it
    stored."""

    @property
    def stored(self) -> dict[str, str]:
        """The blocks the estimator's plan stores coded ({}: none)."""
        return dict(self.plan.storage) if self.plan is not None else {}

    def describe(self) -> str:
        """One line: ``bf16-mixed, checkpoint sqrt, micro-batch 8 x 2`` (and the tiers
        where they are used: ``..., 8bit optimizer state, gradients released``)."""
        tiers = tier_words(self.optimizer_state, self.release_gradients, self.stored)
        return (
            f"{self.precision}, checkpoint {self.checkpoint}, micro-batch {self.micro_batch}"
            f" x {self.accumulation_steps}{tiers}"
        )


def tier_words(
    optimizer_state: str, release_gradients: bool, stored: dict[str, str] | None = None
) -> str:
    """The memory tiers of a setting, as the tuner's lines name them (empty for none).

    >>> tier_words("8bit", True, {"blocks.3": "fp8"})
    ', 8bit optimizer state, gradients released, 1 block's activations in fp8'
    """
    state = f", {optimizer_state} optimizer state" if optimizer_state != "fp32" else ""
    words = state + (", gradients released" if release_gradients else "")
    if stored:
        kinds = " and ".join(sorted(set(stored.values())))
        blocks = f"{len(stored)} block's" if len(stored) == 1 else f"{len(stored)} blocks'"
        words += f", {blocks} activations in {kinds}"
    return words


def split_choices(global_batch: int, world_size: int = 1) -> list[tuple[int, int]]:
    """Every ``(micro_batch, accumulation_steps)`` with ``micro x accumulation x
    world_size == global_batch``, the largest micro-batch first.

    Raises:
        ConfigError: a global batch that no split makes, with the valid choices near it.

    Example::

        split_choices(12)  # [(12, 1), (6, 2), (4, 3), (3, 4), (2, 6), (1, 12)]
    """
    if int(world_size) != world_size or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if int(global_batch) != global_batch or global_batch < 1 or global_batch % world_size:
        below = max(world_size, (int(global_batch) // world_size) * world_size)
        near = sorted(
            {
                below,
                below + world_size,
                2 * world_size if below == world_size else below - world_size,
            }
        )
        raise ConfigError(
            f"global_batch={global_batch!r} cannot be made as micro_batch x "
            f"accumulation_steps x world_size={world_size}: it must be a positive multiple "
            f"of the world size; valid choices near it: {', '.join(map(str, near))}"
        )
    per_rank = int(global_batch) // int(world_size)
    return [(m, per_rank // m) for m in range(per_rank, 0, -1) if per_rank % m == 0]


def meta_clone(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (shapes,
    dtypes and ties kept, no data): what the estimator builds from a model that exists.

    Example::

        estimate(lambda: meta_clone(model), inputs_fn, batch_size=8)
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise ConfigError(
            f"the model could not be copied to the meta device ({type(exc).__name__}: {exc}); "
            "pass micro_batch= and accumulation_steps= yourself, or tune with "
            "memfit.tune(model_fn, ...) whose model_fn builds the model"
        ) from exc


def __getattr__(name: str) -> Callable[[int, str | None], RankLayout]:
    # One rule makes a rank's layout from (world_size, data_parallel), shared with planning
    # and estimating.
    if name == "rank_layout":
        warn_renamed("memfit.candidates.rank_layout", "memfit.checkpoint.step_memory.RankLayout.of")
        return RankLayout.of
    raise AttributeError(f"module 'memfit.candidates' has no attribute {name!r}")


def _rate(speed: MatmulSpeed, precision: str) -> float:
    return speed.rate(PrecisionPolicy.of(precision).compute_dtype)


def rank_candidates(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    budget: int,
    global_batch: int,
    world_size: int = 1,
    data_parallel: str | None = None,
    precisions: Sequence[str] | None = None,
    strategies: Sequence[str] = STRATEGIES,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None = None,
    device: str | torch.device = "cpu",
    speed: MatmulSpeed | None = None,
    optimizer_state: str = "fp32",
    release_gradients: bool = False,
    activation_storage: Sequence[str] = ("keep", "recompute"),
) -> list[Candidate]:
    """Every candidate with its predicted peak and step time, ranked: those that fit
    ``budget`` first, fastest first (ties: the larger micro-batch, then less recompute).
    ``optimizer_state``: how every candidate's optimizer keeps its state (``"fp32"``,
    ``"bf16"``, ``"8bit"``). ``release_gradients``: every candidate's updates applied as
    its gradients are made (one micro-batch a step, one process). ``activation_storage``:
    what ``optimal`` candidates' plans may do with a block's saved tensors (the codes
    counted on the fake step: :func:`~memfit.estimator.estimate`). ``bf16-sr`` is not
    split into micro-batches (it would sum them in bf16).

    ``speed``: the FLOP rates per dtype (default: the matmul probe on ``device``).
    ``world_size`` > 1: every peak is one rank's, under ``data_parallel`` (``"ddp"``, the
    default there, or ``"fsdp"``: :class:`~memfit.checkpoint.step_memory.RankLayout`).

    Example::

        best = rank_candidates(model_fn, batch_fn, loss_fn, budget=2**28, global_batch=16)[0]
    """
    modes = expand_precisions(precisions or DEFAULT_PRECISIONS, device)
    splits = split_choices(global_batch, world_size)
    layout = RankLayout.of(world_size, data_parallel)
    if release_gradients and layout.kind is not None:
        raise ConfigError(
            "release_gradients=True cannot be tuned for a data-parallel run: each rank needs "
            "every gradient reduced before its update; tune with release_gradients=False"
        )
    if release_gradients:
        splits = [(m, a) for m, a in splits if a == 1]  # accumulation needs every gradient
    if speed is None:
        dtypes = {PrecisionPolicy.of(m).compute_dtype for m in modes} - {torch.float32}
        speed = matmul_speed(device, tuple(sorted(dtypes, key=str)))
    cells = [
        (p, m, s, a)
        for p in modes
        for m, a in splits
        for s in strategies
        if a == 1 or not PrecisionPolicy.of(p).rounded_weights
    ]
    found = estimate_cells(
        model_fn,
        batch_fn,
        cells,
        loss_fn=loss_fn,
        optimizer_fn=kept_as(optimizer_fn or torch.optim.AdamW, optimizer_state),
        budget=budget,
        layout=layout,
        release_gradients=release_gradients,
        activation_storage=activation_storage,
    )
    tiers = {
        "optimizer_state": optimizer_state,
        "release_gradients": release_gradients,
        "activation_storage": tuple(activation_storage),
    }
    out: list[Candidate] = []
    fitting_plain: set[tuple[str, int]] = set()
    for (precision, micro, strategy, accumulation), cell in zip(cells, found):
        setting = (precision, strategy, micro, accumulation)
        if cell.row is None:
            out.append(
                Candidate(
                    *setting,
                    None,
                    None,
                    None,
                    False,
                    note="no plan under the budget",
                    **tiers,
                )
            )
            continue
        row = cell.row
        if strategy == "none" and row.fits:
            fitting_plain.add((precision, micro))
        if (
            strategy == "optimal"
            and (precision, micro) in fitting_plain
            and row.recompute_fraction == 0
        ):
            continue  # the same setting as "none", which fits
        # Counted seconds (FLOPs and bytes at counted_times' nominal speed) rescaled to the
        # FLOP rate the probe measured for this precision.
        # The plan's coding of stored activations is counted as its recompute is.
        extra = row.plan.recompute_seconds + row.plan.storage_seconds
        counted = accumulation * (cell.counted_seconds + extra)
        to_rate = COUNTED_FLOP_RATE / _rate(speed, precision)
        out.append(
            Candidate(
                *setting,
                row.peak_bytes,
                counted * to_rate,
                row.recompute_fraction,
                bool(row.fits),
                row.plan,
                recompute_step_seconds=accumulation * row.plan.recompute_seconds * to_rate,
                **tiers,
            )
        )
    out.sort(key=_rank_key)
    return out


def retime(
    candidates: Sequence[Candidate], step_seconds: Callable[[float, float, int], float]
) -> list[Candidate]:
    """``candidates`` with each predicted step time ``step_seconds(counted, recompute,
    accumulation)`` from its counted seconds per micro-batch, forward and backward apart
    from the plan's recompute, ranked again (the tuner's measured terms:
    :mod:`memfit.tuning.calibrate`).

    Example::

        retime(ranked, lambda counted, recompute, acc: acc * (0.01 + 2 * counted + 3 * recompute))
    """

    def timed(c: Candidate) -> Candidate:
        if c.predicted_step_seconds is None:
            return c
        acc = c.accumulation_steps
        recompute = c.recompute_step_seconds / acc
        counted = c.predicted_step_seconds / acc - recompute
        seconds = step_seconds(counted, recompute, acc)
        return dataclasses.replace(
            c,
            predicted_step_seconds=seconds,
            recompute_step_seconds=seconds - step_seconds(counted, 0.0, acc),
        )

    out = [timed(c) for c in candidates]
    out.sort(key=_rank_key)
    return out


#: Predicted times within this factor of each other count as a tie: the count leaves out
#: each micro-batch's fixed cost, so the larger micro-batch wins a tie.
TIE = 1.05


def _rank_key(c: Candidate) -> tuple[bool, float, int, float]:
    seconds = c.predicted_step_seconds
    bucket = math.floor(math.log(seconds) / math.log(TIE)) if seconds else math.inf
    return (not c.fits, bucket, -c.micro_batch, c.recompute_fraction or 0.0)


def nothing_fits(candidates: Sequence[Candidate], budget: int) -> BudgetError:
    """The error for a budget no candidate fits: the least peak any candidate reaches (the
    smallest budget that would fit) and the setting that reaches it.

    Example::

        if not any(c.fits for c in ranked):
            raise nothing_fits(ranked, budget)
    """
    known = [c for c in candidates if c.predicted_peak_bytes is not None]
    least = min(known, key=lambda c: c.predicted_peak_bytes or 0.0)
    return BudgetError(
        f"nothing fits the memory budget {format_bytes(budget)}: the least peak of every "
        f"precision, checkpoint plan and micro-batch is {format_bytes(least.predicted_peak_bytes)}"
        f" ({least.describe()}). The smallest budget that would fit is "
        f"{format_bytes(least.predicted_peak_bytes)}; raise the budget to it, or shrink "
        "the model (fewer or narrower layers)"
    )
