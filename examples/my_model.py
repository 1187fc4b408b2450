"""Your own model on every ``memfit`` command: a function that returns a ``memfit.Workload``.

The model here is defined outside memfit (a small MLP classifier on random features); the
same file works with each command::

    memfit train    --factory examples/my_model.py:build --steps 20 --out runs/mine
    memfit plan     --factory examples/my_model.py:build --budget 4MiB
    memfit estimate --factory examples/my_model.py:build --batch-size 16
    memfit tune     --factory examples/my_model.py:build --budget 64MiB --global-batch 16

``--factory`` takes ``path/to/file.py:FUNCTION`` or, for an importable module,
``package.module:FUNCTION``. ``FUNCTION()`` returns a :class:`memfit.Workload`:

* ``model_fn()`` builds the model (on the CPU; ``estimate`` builds it on the meta device
  without allocating its weights, the other commands move it to ``--device``);
* ``batch_fn(n)`` returns one batch of ``n`` samples (a tensor, a tuple or a dict of
  them); ``memfit train`` draws a new one for every step, with torch's random generator
  seeded per step, so a resumed run sees the same batches;
* ``loss_fn(model, batch)`` returns the scalar loss (leave it out to train on the sum of
  the model's output).

The same object drives the Python API, in place of the three functions::

    work = build()
    memfit.estimate(work, batch_size=16)
    memfit.tune(work, budget="64MiB", global_batch=16)
"""

from __future__ import annotations

import torch
from torch import nn

import memfit

FEATURES = 32
CLASSES = 10


class MyClassifier(nn.Module):
    """A residual MLP: a stack of blocks the planner can checkpoint one by one."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random feature vectors and their labels (a fixed rule, so there is something
    to learn)."""
    x = torch.randn(n, FEATURES)
    y = (x[:, :CLASSES].argmax(dim=1)).long()
    return x, y


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def build() -> memfit.Workload:
    """The workload every ``memfit`` command takes with ``--factory examples/my_model.py:build``."""
    return memfit.Workload(model_fn=MyClassifier, batch_fn=make_batch, loss_fn=loss)
