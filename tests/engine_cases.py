"""The small regression problem the Engine's tests train: a net, its batches and losses."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

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
