"""Batches as the Engine sees them: their size along dim 0, their split into micro-batches,
and the loss a micro-batch must give."""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import ConfigError
from memfit.nested import map_tensors, tensors

Batch = Any


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split a tensor, or a nested tuple/list/dict of tensors, into ``parts`` along dim 0;
    values that are not tensors are given to every part as they are.

    Example::

        first, second = split_batch({"x": torch.zeros(4, 3), "lr": 0.1}, 2)
    """
    size = batch_size(batch)
    if size < parts:
        raise ConfigError(
            f"batch of {size} samples cannot be split into accumulation_steps={parts} "
            "micro-batches; use a larger batch or fewer accumulation steps"
        )
    if parts == 1:
        return [batch]
    chunks = {id(t): torch.tensor_split(t, parts, dim=0) for t in tensors(batch)}
    return [map_tensors(batch, lambda t, i=i: chunks[id(t)][i]) for i in range(parts)]


def batch_size(batch: Batch) -> int:
    """Size of dim 0 shared by every tensor of the batch.

    Example::

        batch_size((torch.zeros(8, 3), torch.zeros(8)))  # 8
    """
    found = tensors(batch)
    if not found:
        raise ConfigError(
            f"the batch ({type(batch).__name__}) holds no tensor; give a tensor or a "
            "tuple/list/dict of them"
        )
    if any(t.dim() == 0 for t in found):
        raise ConfigError("batch tensors need a batch dimension (dim 0); got a scalar")
    sizes = {t.shape[0] for t in found}
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in found[:6])
        raise ConfigError(
            f"batch tensors disagree on dim 0 sizes {sorted(sizes)} (shapes {shapes}"
            f"{', ...' if len(found) > 6 else ''}): the Engine reads the number of samples "
            "from dim 0, to split a batch into micro-batches and weight each by its size. "
            "Give every tensor its samples along dim 0 (e.g. a (tables, n, ids) tensor as "
            "(n, tables, ids), moved back inside forward), or pass what is not per-sample "
            "as a value that is not a tensor (each micro-batch gets it as it is)."
        )
    return sizes.pop()


def checked_loss(loss: Any) -> torch.Tensor:
    """``loss`` as a 0-dim fp32 tensor; ConfigError when it cannot be the micro-batch's loss.

    Example::

        loss = checked_loss(loss_fn(model, micro))
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)
        raise ConfigError(f"loss_fn(model, micro_batch) must return a scalar tensor, got {got}")
    if not loss.requires_grad:
        raise ConfigError(
            "the loss does not require grad: loss_fn must compute it from the model's "
            "output, not under torch.no_grad()"
        )
    return loss.reshape(()).float()
