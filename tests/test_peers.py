"""memfit.plan at the memory of the checkpointing users write today: each peer's step is
measured by the allocator, memfit plans with that peak (+2%) as its budget, and its own step
must fit and recompute no more FLOPs than the peer's (both counted by torch's
``FlopCounterMode``, the same way). ``bench/peers.py`` runs the same comparison on more
models, peers and precisions, with the plan's costs measured."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.allocator import allocator_peak
from memfit.checkpoint.api import make_plan
from memfit.models import GPT, GPTConfig, gpt_loss, lm_cross_entropy
from tests.measured_steps import training_state_peak

pytestmark = pytest.mark.usefixtures("one_thread")

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class _Wide(nn.Module):
    """A residual MLP block; the chain's blocks alternate 64 and 1024 hidden units."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Wide(64, h) for h in (64, 1024) * 4])
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _chain_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _chain_sequential_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    segments = round(math.sqrt(len(model.blocks)))
    hidden = checkpoint_sequential(model.blocks, segments, x, use_reentrant=False)
    return model.head(hidden).square().mean()


def _gpt_sequential_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # GPT.forward with its loop over the blocks replaced by checkpoint_sequential.
    idx = batch[:, :-1]
    pos = torch.arange(idx.size(1), device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    segments = round(math.sqrt(len(model.blocks)))
    x = checkpoint_sequential(list(model.blocks), segments, x, use_reentrant=False)
    return lm_cross_entropy(model.lm_head(model.ln_f(x)), batch[:, 1:])


@dataclass(frozen=True)
class _Subject:
    model: nn.Module
    batch: torch.Tensor
    loss_fn: LossFn


def _chain() -> _Subject:
    torch.manual_seed(0)
    return _Subject(_Chain(), torch.randn(256, 64), _chain_loss)


def _gpt() -> _Subject:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
    return _Subject(GPT(config), torch.randint(0, 256, (8, 65)), gpt_loss)


def _trained_copy(subject: _Subject) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of the model after one optimizer step (so the optimizer's state exists), with
    its own optimizer."""
    model = copy.deepcopy(subject.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer, subject.batch, subject.loss_fn)()
    return model, optimizer


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, loss_fn: LossFn
) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    return step


@dataclass(frozen=True)
class _Measured:
    peak_bytes: int
    flops: int


def _measure(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, loss_fn: LossFn
) -> _Measured:
    """The allocator's peak of a whole step after a warm-up step, and the FLOPs of its
    forward and backward."""
    step = _step(model, optimizer, batch, loss_fn)
    # The warm-up runs under the allocator's profiler too: the profiler reports the free
    # of a block only when it saw the block allocated (the gradients it leaves).
    allocator_peak(step)
    # The last step's gradients, which zero_grad frees inside the step, are named with the
    # rest of the training state: each free of memory the step did not allocate is sized.
    peak = training_state_peak(step, model, optimizer, batch).peak_bytes
    with FlopCounterMode(display=False) as counter:
        loss_fn(model, batch).backward()
    optimizer.zero_grad(set_to_none=True)
    return _Measured(int(peak), int(counter.get_total_flops()))


def _per_block(model: nn.Module) -> LossFn | None:
    """Every block's forward under non-reentrant ``checkpoint``; the subject's own loss."""
    for block in model.blocks:
        forward = block.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return None


def _sequential(model: nn.Module) -> LossFn:
    return _gpt_sequential_loss if isinstance(model, GPT) else _chain_sequential_loss


PEERS = {
    "checkpoint_sequential(sqrt n)": _sequential,
    "checkpoint per block": _per_block,
}


@pytest.mark.parametrize(
    ("name", "peer"),
    [
        ("chain", "checkpoint_sequential(sqrt n)"),
        ("chain", "checkpoint per block"),
        ("gpt", "checkpoint_sequential(sqrt n)"),
        ("gpt", "checkpoint per block"),
    ],
)
def test_memfit_at_a_peers_measured_peak_fits_and_recomputes_no_more(name: str, peer: str) -> None:
    subject = {"chain": _chain, "gpt": _gpt}[name]()
    base_model, base_opt = _trained_copy(subject)
    base = _measure(base_model, base_opt, subject.batch, subject.loss_fn)

    peer_model, peer_opt = _trained_copy(subject)
    peer_loss = PEERS[peer](peer_model) or subject.loss_fn
    theirs = _measure(peer_model, peer_opt, subject.batch, peer_loss)
    assert theirs.peak_bytes < base.peak_bytes and theirs.flops > base.flops

    model, optimizer = _trained_copy(subject)
    budget = int(theirs.peak_bytes * 1.02)
    # Counted costs: the plan depends on the model alone, not on this machine's speed
    # (memfit.plan's plan, from make_plan, which takes the choice of costs).
    plan = make_plan(
        model,
        subject.batch,
        subject.loss_fn,
        optimizer=optimizer,
        precision="fp32",
        budget=budget,
        costs="counted",
    ).plan
    memfit.apply_plan(model, plan)
    ours = _measure(model, optimizer, subject.batch, subject.loss_fn)
    assert ours.peak_bytes <= budget, (peer, ours.peak_bytes, budget, plan.decisions)
    recompute, peer_recompute = ours.flops - base.flops, theirs.flops - base.flops
    assert recompute <= peer_recompute, (peer, recompute, peer_recompute, plan.decisions)
