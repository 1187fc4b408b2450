"""The small regression problem the Engine's tests train (a net, its batches and losses), the
bitwise comparison they judge continuations by, and a run saved and resumed to compare."""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memfit

Batch = tuple[torch.Tensor, torch.Tensor]


def net(dropout: float = 0.0) -> nn.Sequential:
    """Small enough for fp16 on CPU; a LayerNorm (an fp32 island) and dropout (the RNG)."""
    return nn.Sequential(
        nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(dropout), nn.Linear(8, 4)
    )


def batch(i: int, n: int = 12) -> Batch:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def noisy_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Uses Python's RNG too, so a resumed or loaded run must restore it."""
    return loss(model, batch) * (1.0 + 0.01 * random.random())


def inf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return loss(model, batch) * float("inf")


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal to the bit: tensors by their raw bytes (-0.0 is not 0.0, a NaN
    equals the same NaN), nested dicts, lists and tuples item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        # Compare the raw bytes: -0.0 differs from 0.0, and NaN equals the same NaN.
        raw_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        raw_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw_a, raw_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def saved_run(
    path: Any,
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    steps: int,
    resume: bool = False,
    **engine_kwargs: Any,
) -> list[float]:
    """The losses of ``steps`` steps of an Engine over ``model`` (AdamW, lr 1e-3, no
    monitor) made with ``engine_kwargs``, saved to ``path``, then of ``steps`` more; with
    ``resume``, of ``steps`` steps of the Engine resumed from ``path`` instead: the second
    half of a run and a resumed one, to compare bitwise."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if resume:
        engine = memfit.Engine.resume(path, model, opt, monitor=False)
    else:
        engine = memfit.Engine(model, opt, monitor=False, **engine_kwargs)
    losses = [float(engine.train_step(batch, loss_fn)) for _ in range(steps)]
    if not resume:
        engine.save(path)
        losses += [float(engine.train_step(batch, loss_fn)) for _ in range(steps)]
    return losses
