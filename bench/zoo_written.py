"""The zoo's models written here (bench/zoo_models.py lists them with the others): a chain
of residual MLP blocks 16x apart in width, memfit's GPT, an LSTM language model and an
``nn.EmbeddingBag`` recommender, each with its sizes, a seeded batch and its loss.

    model = make_chain(dropout=True)
    mse_loss(model, chain_batch(torch.Generator().manual_seed(0))).backward()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from memfit.data import synthetic
from memfit.models import build_model
from memfit.models.gpt import GPTConfig

#: ``loss_fn(model, batch) -> scalar``, as ``memfit.plan`` and the Engine take it.
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: The token vocabulary of every language model in the zoo.
VOCAB = 1024


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP block from width ``d_in`` to ``width``: ``skip(x) +
    dropout(fc2(gelu(fc1(norm(x)))))``, the skip a projection where the widths differ."""

    def __init__(self, d_in: int, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.fc1 = nn.Linear(d_in, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Identity() if d_in == width else nn.Linear(d_in, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


#: The chain's block widths: 16x between the narrowest and the widest, so blocks differ
#: as much in what they save for backward.
CHAIN_WIDTHS = (32, 512, 64, 256, 32, 512, 128, 32)
CHAIN_ROWS = 512


def make_chain(dropout: bool) -> nn.Module:
    """An ``nn.Sequential`` of eight residual MLP blocks of widths :data:`CHAIN_WIDTHS`."""
    widths = (CHAIN_WIDTHS[0], *CHAIN_WIDTHS)
    p = 0.1 if dropout else 0.0
    return nn.Sequential(*(ResidualMLP(a, b, p) for a, b in zip(widths, widths[1:])))


def chain_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(CHAIN_ROWS, CHAIN_WIDTHS[0], generator=g),
        torch.randn(CHAIN_ROWS, CHAIN_WIDTHS[-1], generator=g),
    )


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The chain's regression loss."""
    x, y = batch
    return F.mse_loss(model(x), y)


def chain_sequential_loss(segments: int) -> LossFn:
    """The chain's loss with its blocks run by ``checkpoint_sequential``."""

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(checkpoint_sequential(model, segments, x, use_reentrant=False), y)

    return loss_fn


#: memfit's GPT here: another size than bench/checkpoint.py's, dropout on.
GPT_SHAPE = {"n_layer": 9, "n_embd": 96, "n_head": 4, "block_size": 128, "dropout": 0.1}
GPT_BATCH = 8


def make_gpt(dropout: bool) -> nn.Module:
    """memfit's built-in GPT (:data:`GPT_SHAPE`)."""
    shape = GPT_SHAPE if dropout else {**GPT_SHAPE, "dropout": 0.0}
    return build_model("gpt", data="synthetic", **shape).model


def gpt_batch(g: torch.Generator) -> torch.Tensor:
    """Synthetic tokens, as ``build_model("gpt", data="synthetic")``'s batches."""
    block, vocab = GPT_SHAPE["block_size"], GPTConfig().vocab_size
    return synthetic.token_batch(GPT_BATCH, block, vocab, generator=g)


class LSTMLanguageModel(nn.Module):
    """A token embedding, ``layers`` single-layer ``nn.LSTM``s with dropout after each, a
    linear head: ``nn.LSTM(num_layers=layers, dropout=p)`` written out layer by layer, so
    that each layer is a unit a plan can recompute."""

    def __init__(self, vocab: int, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        for lstm in self.layers:
            x = self.drop(lstm(x)[0])
        return self.head(x)


LSTM_SHAPE = {"vocab": VOCAB, "width": 128, "layers": 3, "tokens": 64, "batch": 16}


def lstm_batch(g: torch.Generator) -> torch.Tensor:
    """Tokens ``(batch, tokens + 1)``: inputs ``[:, :-1]``, next-token targets ``[:, 1:]``."""
    shape = (LSTM_SHAPE["batch"], LSTM_SHAPE["tokens"] + 1)
    return torch.randint(0, LSTM_SHAPE["vocab"], shape, generator=g)


def make_lstm(dropout: bool) -> nn.Module:
    s = LSTM_SHAPE
    return LSTMLanguageModel(s["vocab"], s["width"], s["layers"], 0.1 if dropout else 0.0)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


class EmbeddingBagRecommender(nn.Module):
    """A click-through model: dense features through a bottom MLP, each categorical feature
    a bag of ids summed by its ``nn.EmbeddingBag``, all concatenated into a top MLP that
    gives one logit."""

    def __init__(self, dense: int, tables: int, rows: int, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.bottom = nn.Sequential(
            nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU()
        )
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)
        )
        self.top = nn.Sequential(
            nn.Linear(dim * (tables + 1), 4 * hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4 * hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )

    def forward(self, dense: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        """``dense`` ``(n, dense)``, ``bags`` ``(tables, n, ids per bag)``: the logits ``(n,)``."""
        parts = [self.bottom(dense), *(table(ids) for table, ids in zip(self.embeddings, bags))]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


RECOMMENDER_SHAPE = {
    "dense": 13,
    "tables": 8,
    "rows": 4096,
    "dim": 32,
    "hidden": 128,
    "ids_per_bag": 8,
    "batch": 2048,
}


def recommender_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    s = RECOMMENDER_SHAPE
    return {
        "dense": torch.randn(s["batch"], s["dense"], generator=g),
        "bags": torch.randint(
            0, s["rows"], (s["tables"], s["batch"], s["ids_per_bag"]), generator=g
        ),
        "clicks": (torch.rand(s["batch"], generator=g) < 0.2).float(),
    }


def click_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["dense"], batch["bags"])
    return F.binary_cross_entropy_with_logits(logits, batch["clicks"])


def make_recommender(dropout: bool) -> nn.Module:
    s = RECOMMENDER_SHAPE
    p = 0.1 if dropout else 0.0
    return EmbeddingBagRecommender(s["dense"], s["tables"], s["rows"], s["dim"], s["hidden"], p)
