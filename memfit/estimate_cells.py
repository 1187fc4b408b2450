"""Many estimates at once, for the tuner: each ``(precision, batch size, strategy,
accumulation)`` cell planned on one meta model per precision and one fake profile per
precision and batch size (:func:`estimate_cells`), no largest-batch search.

Example::

    cells = estimate_cells(model_fn, inputs_fn, [("fp32", 8, "none", 2)], loss_fn=loss)
    cells[0].row.peak_bytes
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.planner import check_activation_storage
from memfit.checkpoint.step_memory import RankLayout, ZeroGrad
from memfit.errors import BudgetError, ConfigError
from memfit.estimator import EstimateRow, Estimator, LossFn, row_of
from memfit.precision.policy import PrecisionPolicy

__all__ = ["CellEstimate", "estimate_cells"]


class CellEstimate(NamedTuple):
    """One (precision, batch size, strategy, accumulation) cell of :func:`estimate_cells`."""

    row: EstimateRow | None
    """The estimate (None when the strategy has no plan under the budget)."""
    forward_flops: float
    """FLOPs of one micro-batch's forward (recompute comes on top)."""
    counted_seconds: float
    """One micro-batch's forward and backward in counted seconds (``counted_times``'
    FLOPs at 1e11/s and bytes at 1e10/s; the row's plan's ``recompute_seconds`` comes on
    top, in the same units)."""
    error: BudgetError | None = None
    """Why there is no row: the budget no plan of the strategy meets."""


def estimate_cells(
    model_fn: Callable[[], nn.Module],
    inputs_fn: Callable[[int], Any],
    cells: Iterable[tuple[str, int, str, int]],
    *,
    loss_fn: LossFn,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None = None,
    budget: int | None = None,
    layout: RankLayout | None = None,
    release_gradients: bool = False,
    activation_storage: Sequence[str] = ("keep", "recompute"),
) -> list[CellEstimate]:
    """Estimate many ``(precision, batch_size, strategy, accumulation_steps)`` cells with
    one meta model per precision and one fake profile per precision and batch size (the
    tuner's search); ``optimal`` plans at ``budget``; ``layout``: one rank of a
    data-parallel run (default: one process); ``release_gradients``: each update applied
    as its gradient is made (cells of one micro-batch in one process only, as the Engine
    trains them); ``activation_storage``: what ``optimal`` may do with a block's saved
    tensors (:func:`estimate`). No largest-batch search.

    Example::

        cells = estimate_cells(model_fn, inputs_fn, [("fp32", 8, "none", 2)], loss_fn=loss)
        cells[0].row.peak_bytes
    """
    optimizer_fn = optimizer_fn or torch.optim.AdamW
    layout = layout or RankLayout()
    zero_grad: ZeroGrad = "in_backward" if release_gradients else "before_forward"
    storage = check_activation_storage(activation_storage)
    single = Estimator(
        model_fn,
        inputs_fn,
        loss_fn,
        optimizer_fn,
        1,
        layout,
        zero_grad=zero_grad,
        activation_storage=storage,
    )
    # The gradients held through accumulation change the plans, never the profiles.
    accumulating = Estimator(
        model_fn,
        inputs_fn,
        loss_fn,
        optimizer_fn,
        2,
        layout,
        single.models,
        single.profiles,
        activation_storage=storage,
        forwards=single.forwards,
    )
    out: list[CellEstimate] = []
    for precision, batch, strategy, accumulation in cells:
        if release_gradients and accumulation > 1:
            raise ConfigError(
                f"cell {precision}/{strategy}/{batch}x{accumulation}: gradients released in "
                "backward cannot be accumulated over micro-batches; estimate it with one"
            )
        est = accumulating if accumulation > 1 else single
        policy = PrecisionPolicy.of(precision)
        model, optimizer = est.model(policy)
        root = est.profiled(policy, batch).root
        forward, seconds = float(root.fwd_flops), float(root.fwd_seconds + root.bwd_seconds)
        try:
            result = est.solve(policy, batch, strategy, budget)
        except BudgetError as exc:
            out.append(CellEstimate(None, forward, seconds, exc))
            continue
        row = row_of(policy, strategy, result, model, optimizer, budget, result.plan, None, layout)
        out.append(CellEstimate(row, forward, seconds))
    return out
