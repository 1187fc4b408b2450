"""Units whose recompute cannot free memory are never planned, and a model with a sparse
embedding plans without crashing.

Each model is written for one cause: an embedding lookup (it saves its ids, its input), a
frozen first block fed the batch (it saves nothing), a block run under ``torch.no_grad``,
a parameter-free unit returning a view of its input, a block that returns its input (a
dropped layer). Recomputed alone, none frees anything its checkpoint does not hold again,
and each rebuild costs time: ``full`` (every block on its own) keeps them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from measured_steps import planned_step_peak
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.allocator import allocator_peak

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, BATCH = 64, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class NoGradBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return super().forward(x)


class ViewUnit(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 8, WIDTH // 8).reshape(x.shape[0], WIDTH)


class Dropped(Block):
    """A layer skipped at run time (layer drop, a disabled adapter): returns its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Net(nn.Module):
    """An optional embedding, then blocks (one of them replaced), then a head."""

    def __init__(self, special: dict[int, nn.Module] | None = None, embed: str = "") -> None:
        super().__init__()
        special = special or {}
        self.embed = nn.Embedding(1000, WIDTH, sparse=embed == "sparse") if embed else None
        self.blocks = nn.ModuleList([special.get(i) or Block() for i in range(4)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _frozen_first() -> Net:
    net = Net()
    net.blocks[0].requires_grad_(False)
    return net


_BLOCKS = [f"blocks.{i}" for i in range(4)]
CASES: dict[str, tuple[Callable[[], Net], str, list[str]]] = {
    # name: (model, the unit that cannot free memory, the units offered)
    "embedding lookup": (lambda: Net(embed="dense"), "embed", ["embed", *_BLOCKS]),
    "frozen first block": (_frozen_first, "blocks.0", _BLOCKS),
    "no_grad block": (lambda: Net({0: NoGradBlock()}), "blocks.0", _BLOCKS),
    "view of its input": (lambda: Net({2: ViewUnit()}), "blocks.2", _BLOCKS),
    "dropped layer": (lambda: Net({2: Dropped()}), "blocks.2", _BLOCKS),
}


def _batch(net: Net) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if net.embed is not None:
        return torch.randint(0, 1000, (BATCH,), generator=g)
    return torch.randn(BATCH, WIDTH, generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_full_never_recomputes_a_unit_that_cannot_free_memory(case: str) -> None:
    make, inert, units = CASES[case]
    torch.manual_seed(0)
    net = make()
    batch = _batch(net)
    plan = memfit.plan(net, batch, _loss, strategy="full", units=units, precision="fp32")
    assert plan.decisions.get(inert, "keep") == "keep", plan.decisions
    # The others are recomputed: the rule keeps only what cannot free memory.
    useful = [u for u in _BLOCKS if u != inert]
    assert all(plan.decisions.get(u) == "recompute" for u in useful), plan.decisions


def test_a_sparse_embedding_is_planned_and_its_plan_keeps_the_gradients() -> None:
    torch.manual_seed(0)
    net = Net(embed="sparse")
    batch = _batch(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plan = memfit.plan(
        net, batch, _loss, optimizer=opt, units=["embed", *_BLOCKS], precision="fp32"
    )
    least = memfit.plan(
        net,
        batch,
        _loss,
        budget=int(plan.frontier[0].peak_bytes / 0.98) + 1,
        optimizer=opt,
        units=["embed", *_BLOCKS],
        precision="fp32",
    )
    assert least.measured_peak_bytes is not None
    assert least.measured_peak_bytes <= least.budget_bytes

    def grads() -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        _loss(net, batch).backward()
        return [p.grad.to_dense().clone() for p in net.parameters()]

    before = grads()
    memfit.apply_plan(net, least)
    try:
        after = grads()
        peak = allocator_peak(grads, live=[*net.parameters(), batch]).peak_bytes
    finally:
        memfit.remove_plan(net)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert peak <= least.budget_bytes


def test_a_sparse_gradient_is_sized_by_the_rows_it_holds_not_by_its_table() -> None:
    # A 20,000-row table looked up 1,024 times: its sparse gradient holds 1,024 rows and
    # their ids (0.27 MiB), not the table (4.9 MiB). Sized as the table, the least plan
    # was predicted 10% above its measured peak and a budget it meets was refused as
    # "below what the optimizer step alone holds".
    torch.manual_seed(0)
    net = Net(embed="sparse")
    net.embed = nn.Embedding(20_000, WIDTH, sparse=True)
    batch = torch.randint(0, 20_000, (BATCH, 4), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    units = ["embed", *_BLOCKS]
    least = memfit.plan(
        net, batch, _loss, strategy="full", optimizer=opt, units=units, precision="fp32"
    )
    measured = planned_step_peak(net, least, batch, _loss, opt)
    assert abs(least.predicted_peak_bytes - measured) <= 0.03 * measured, (
        least.predicted_peak_bytes,
        measured,
    )
    # A budget 1% above what the least plan measured is met, not refused.
    fitted = memfit.plan(
        net, batch, _loss, budget=int(measured * 1.01), optimizer=opt, units=units, precision="fp32"
    )
    assert fitted.measured_peak_bytes is None or fitted.measured_peak_bytes <= fitted.budget_bytes
