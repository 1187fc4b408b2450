"""A stacked LSTM language model, the recurrent reference model.

Each layer is its own single-layer ``nn.LSTM``, wrapped in :class:`LSTMLayer` so that it maps
a tensor to a tensor (``nn.LSTM`` returns ``(output, (h, c))``); the layers sit in an
``nn.ModuleList`` named ``layers`` that ``forward`` walks in a plain loop, so every layer is
a checkpointable unit. A multi-layer ``nn.LSTM`` would be one opaque unit instead.

Example::

    model = LSTMLM(LSTMConfig(n_layer=2))
    batch = torch.randint(0, 256, (4, 65))    # (B, T + 1) bytes
    lstm_loss(model, batch).backward()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memfit.models.config_checks import check_dropout, check_positive_ints
from memfit.models.gpt import lm_cross_entropy


@dataclass
class LSTMConfig:
    """Shape of an :class:`LSTMLM`.

    Example::

        cfg = LSTMConfig(n_layer=3, hidden_size=512)
    """

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus."""
    n_embd: int = 128
    """Width of the token embedding (the first layer's input)."""
    hidden_size: int = 256
    """Hidden and cell state size of every layer."""
    n_layer: int = 2
    """Number of stacked LSTM layers."""
    dropout: float = 0.0
    """Dropout on the embedding and on each layer's output (0 turns it off)."""
    seq_len: int = 128
    """Length of training sequences the batch functions make; the model accepts any length."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "n_embd", "hidden_size", "n_layer", "seq_len"))
        check_dropout(self)


class LSTMLayer(nn.Module):
    """One single-layer ``nn.LSTM`` (batch first) plus dropout: ``(B, T, in) -> (B, T, hidden)``.

    Starts from zero states and returns only the output sequence, dropping ``(h, c)``.
    """

    def __init__(self, input_size: int, hidden_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers=1, batch_first=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.drop(out)


class LSTMLM(nn.Module):
    """A byte-level LSTM language model: ``forward(idx) -> logits``.

    Embedding → dropout → ``layers`` (an ``nn.ModuleList`` of :class:`LSTMLayer`) → linear
    ``head``.

    Example::

        model = LSTMLM()
        model(torch.randint(0, 256, (2, 100))).shape  # torch.Size([2, 100, 256])
    """

    def __init__(self, config: LSTMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or LSTMConfig()
        self.embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            [
                LSTMLayer(
                    config.n_embd if i == 0 else config.hidden_size,
                    config.hidden_size,
                    config.dropout,
                )
                for i in range(config.n_layer)
            ]
        )
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small-normal embedding and head; LSTM weights keep torch's uniform default.

        Forget-gate biases start at 1 (split over the two bias vectors), so early in training
        the cells keep their memory instead of forgetting it every step.
        """
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        h = self.config.hidden_size
        for layer in self.layers:
            for name, param in layer.lstm.named_parameters():
                if name.startswith("bias"):
                    # Gate order in nn.LSTM's biases is input, forget, cell, output.
                    nn.init.zeros_(param)
                    with torch.no_grad():
                        param[h : 2 * h].fill_(0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``."""
        x = self.drop(self.embedding(idx))
        # A plain loop over the ModuleList: checkpoint segments replace this iteration.
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def num_params(self) -> int:
        """Number of parameters.

        Example::

            LSTMLM(LSTMConfig()).num_params()
        """
        return sum(p.numel() for p in self.parameters())


def lstm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token loss on a ``(B, T + 1)`` token batch, in fp32 (as :func:`gpt_loss`).

    Example::

        loss = lstm_loss(model, corpus.batch("train", 16, 128, generator=0))
    """
    return lm_cross_entropy(model(batch[:, :-1]), batch[:, 1:])
