"""The models of bench/peers.py, from bench/zoo_models.py: memfit's GPT, a chain of residual
MLP blocks whose widths differ 16x, and Hugging Face models built from their configs, each
with its optimizer, one batch, its loss and its blocks.

    subject = BUILDERS["chain"]()
    subject.loss_fn(subject.model, subject.batch).backward()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from zoo_models import ZOO, LossFn, make_optimizer

#: The models peers.py compares on: those whose blocks the peers checkpoint.
PEER_MODELS = ("gpt", "chain", "gpt2", "llama", "bert", "t5", "mixtral", "whisper", "swin", "mamba")


@dataclass
class Subject:
    """A model under test, in training mode, with its optimizer, one batch, its loss and
    how its blocks are found."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    loss_fn: LossFn
    blocks: Callable[[nn.Module], list[nn.Module]]
    """The blocks of the model or of a copy of it, in forward order."""
    has_dropout: bool
    is_hf: bool = False
    sequential_loss: Callable[[int], LossFn] | None = None
    """A loss function that runs the blocks through ``checkpoint_sequential`` with the
    given number of segments; None where the blocks are not a sequential stack."""

    def describe(self) -> str:
        """One line: the model's class, parameters, blocks and dropout."""
        n_params = sum(p.numel() for p in self.model.parameters())
        return (
            f"{type(self.model).__name__}, {n_params / 1e6:.2f} M parameters, "
            f"{len(self.blocks(self.model))} blocks, dropout {'on' if self.has_dropout else 'off'}"
        )


def make_subject(name: str) -> Subject:
    """The zoo's model ``name``, seeded, in training mode, with an AdamW
    (``foreach=False``, as the zoo's)."""
    spec = ZOO[name]
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.batch(torch.Generator().manual_seed(0))
    return Subject(
        name,
        model,
        make_optimizer(model, "adamw"),
        batch,
        spec.loss,
        spec.blocks,
        spec.has_dropout(),
        spec.is_hf,
        spec.sequential_loss,
    )


BUILDERS: dict[str, Callable[[], Subject]] = {
    name: functools.partial(make_subject, name) for name in PEER_MODELS
}
