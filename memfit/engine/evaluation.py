"""Evaluating a model the way it trains: the policy's autocast, eval mode, no gradients.

:func:`eval_context` is the block; :func:`evaluate` runs a loss over batches inside it.
Both leave every module's train/eval flag as it was, also when the block raises.

Example::

    with engine.eval_context():
        logits = engine.model(x)
    val_loss = memfit.evaluate(engine, val_batches, loss_fn)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from memfit.engine.batches import Batch, batch_size
from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy


class Evaluable(Protocol):
    """What :func:`evaluate` needs of an Engine: its model and its evaluation block."""

    model: nn.Module

    def eval_context(self) -> contextlib.AbstractContextManager[Any]:
        """A ``with`` block that evaluates as training computes (see :func:`eval_context`)."""
        ...


@contextlib.contextmanager
def eval_context(
    model: nn.Module, policy: PrecisionPolicy, device: torch.device | str
) -> Iterator[nn.Module]:
    """``model`` in eval mode, under ``torch.no_grad()`` and the policy's autocast, inside a
    ``with`` block; yields the model. Each module's train/eval flag is restored afterwards
    (a module the user froze in eval mode stays in eval mode).

    A checkpoint plan does nothing without gradients, so planned units run plainly here.

    Example::

        with eval_context(model, PrecisionPolicy("bf16-master"), "cpu"):
            logits = model(ids)
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), policy.autocast(torch.device(device).type):
            yield model
    finally:
        for module, training in modes:
            module.training = training


def evaluate(
    engine: Evaluable,
    batches: Iterable[Batch],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
) -> float:
    """The mean of ``loss_fn(model, batch)`` over ``batches``, each batch weighted by its
    size (its first dimension), computed under ``engine.eval_context()``: the training
    precision, eval mode, no gradients; the modes are restored afterwards. One host sync,
    at the end.

    ``loss_fn`` returns the batch's mean loss, as for :meth:`Engine.train_step`. ``engine``
    is an :class:`~memfit.engine.core.Engine`, or anything with its ``model`` and
    ``eval_context()`` (:class:`Evaluable`).

    Example::

        val_loss = memfit.evaluate(engine, val_batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        engine.log_metrics({"val/loss": val_loss})
    """
    total = 0
    loss_sum: torch.Tensor | None = None
    with engine.eval_context():
        for batch in batches:
            loss = loss_fn(engine.model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ConfigError(f"loss_fn(model, batch) must return a scalar tensor, got {got}")
            n = batch_size(batch)
            weighted = loss.detach().reshape(()).float() * n
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            total += n
    if loss_sum is None or total == 0:
        raise ConfigError("evaluate() got no batches; pass a non-empty iterable of batches")
    return float((loss_sum / total).item())
