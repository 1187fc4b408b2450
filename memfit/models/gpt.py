"""A small GPT (decoder-only Transformer), the reference model for planning and benchmarks.

Pre-norm blocks (LayerNorm → causal self-attention → residual, LayerNorm → 4x GELU MLP →
residual) held in ``GPT.blocks``, an ``nn.ModuleList`` that ``forward`` walks with a plain
``for`` loop: the checkpoint executor relies on that loop to run consecutive blocks as
segments. The output head shares its weight with the token embedding.

Example::

    model = GPT(GPTConfig(n_layer=2))
    batch = torch.randint(0, 256, (4, 65))          # (B, T + 1) bytes
    loss = gpt_loss(model, batch)
    loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from memfit.errors import ConfigError
from memfit.models.config_checks import check_dropout, check_positive_ints


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults train on a 2-core CPU in a minute or two.

    Example::

        cfg = GPTConfig(n_layer=6, n_embd=256, block_size=256)
    """

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus."""
    block_size: int = 128
    """Longest context (tokens) the model accepts; the size of the position table."""
    n_layer: int = 4
    """Number of Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 256
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 turns it off)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        check_dropout(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer: Linear 4x → GELU → Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out_proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-norm Transformer block, tensor ``(B, T, C)`` in and out."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype.

    bf16 logits have ~3 significant digits; the log-sum-exp over a vocabulary needs more,
    so the logits are cast up first.

    Example::

        loss = lm_cross_entropy(model(x), y)   # logits (B, T, V), targets (B, T)
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """A decoder-only Transformer language model: ``forward(idx) -> logits``.

    Attributes named for other parts of memfit: ``blocks`` (``nn.ModuleList`` of
    :class:`Block`, iterated in order), ``ln_f`` (final LayerNorm), ``lm_head`` (weight tied
    to ``tok_emb.weight``).

    Example::

        model = GPT(GPTConfig())
        logits = model(torch.randint(0, 256, (2, 128)))  # (2, 128, 256)
        model.num_params(), model.flops_per_token()
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tying halves the embedding parameters and helps small models; the head's gradient
        # and the embedding's accumulate into one tensor.
        self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize all weights: N(0, 0.02), zero biases, residual outputs scaled down.

        The two projections that write into the residual stream in each block get
        std ``0.02 / sqrt(2 * n_layer)``, so the stream's variance stays about constant
        however many blocks add to it (the GPT-2 recipe).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.out_proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``."""
        return self.lm_head(self.ln_f(self.trunk(idx)))

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual stream ``(B, T, n_embd)`` after the last block: everything but the
        final LayerNorm and the head (:func:`chunked_gpt_loss` applies them in pieces).

        Example::

            hidden = model.trunk(torch.randint(0, 256, (2, 128)))  # (2, 128, n_embd)
        """
        T = idx.size(1)
        if T > self.config.block_size:
            raise ConfigError(
                f"sequence length {T} exceeds the model's block_size {self.config.block_size}; "
                "use shorter sequences or a larger GPTConfig.block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        # A plain loop over the ModuleList: checkpoint segments replace this iteration.
        for block in self.blocks:
            x = block(x)
        return x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32 (see :func:`lm_cross_entropy`).

        Example::

            loss = GPT.loss(model(batch[:, :-1]), batch[:, 1:])
        """
        return lm_cross_entropy(logits, targets)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, the tied head counted once.

        ``exclude_embeddings=True`` leaves out the position table (used in the FLOP count:
        a lookup does no arithmetic). The token table stays: as the head it does matmuls.

        Example::

            GPT(GPTConfig()).num_params()  # 842,496 for the defaults
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates the tie
        if exclude_embeddings:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: ``6 N + 12 L C T``.

        ``6 N`` counts the parameter matmuls (2 per multiply-add forward, twice that
        backward); ``12 L C T`` the attention score and value matmuls over a context of
        ``T = seq_len`` (default ``block_size``), ignoring the causal mask's savings as
        the usual estimate does. Divide by 3 for forward-only FLOPs. Recomputation from
        checkpointing comes on top.

        Example::

            tokens_per_s * model.flops_per_token() / 1e12  # achieved TFLOP/s
        """
        cfg = self.config
        T = cfg.block_size if seq_len is None else seq_len
        return 6 * self.num_params(exclude_embeddings=True) + 12 * cfg.n_layer * cfg.n_embd * T


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a language model on a ``(B, T + 1)`` token batch.

    Inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``; the loss is computed in fp32.
    Fits ``Engine.train_step(batch, loss_fn)``'s ``loss_fn(model, micro_batch)``.

    Example::

        loss = gpt_loss(model, corpus.batch("train", 8, 128, generator=0))
    """
    return lm_cross_entropy(model(batch[:, :-1]), batch[:, 1:])


#: Tokens per piece of :func:`chunked_gpt_loss`: a piece's fp32 logits are
#: ``4 * vocab_size`` bytes a token (206 MB a piece at a 50,304 vocabulary).
CHUNK_TOKENS = 1024


def chunked_gpt_loss(
    model: nn.Module, batch: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS
) -> torch.Tensor:
    """:func:`gpt_loss` with the final LayerNorm, the head and the cross-entropy applied to
    ``chunk_tokens`` tokens at a time, each piece recomputed in backward: the step never
    holds the whole batch's logits, only one piece's. Where the vocabulary is large the
    logits and the loss's saved log-probabilities are most of a step's activations (at a
    50,304 vocabulary and context 2048, 618 MB a sample against 201 MB for 24 blocks'
    checkpointed inputs). Costs one more forward of the head; the same loss and gradients
    (to rounding: the pieces are summed, then divided). For :class:`GPT`.

    Example::

        loss = chunked_gpt_loss(model, corpus.batch("train", 8, 128, generator=0))
        loss.backward()
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if not isinstance(model, GPT):
        # A wrapper (DistributedDataParallel, a compiled module) runs its own forward, which
        # calling the trunk and the head apart would go around (DDP would sync no gradient).
        raise ConfigError(
            f"chunked_gpt_loss takes memfit's GPT itself (it runs its trunk, final LayerNorm "
            f"and head apart), got {type(model).__name__}; use gpt_loss for a wrapped model"
        )
    hidden = model.trunk(batch[:, :-1])
    hidden = hidden.reshape(-1, hidden.size(-1))
    targets = batch[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        # No random op runs in a piece: no generator state to keep (fake tensors have none).
        total = total + torch.utils.checkpoint.checkpoint(
            _piece_loss,
            model,
            hidden[piece],
            targets[piece],
            use_reentrant=False,
            preserve_rng_state=False,
        )
    return total / targets.numel()


def _piece_loss(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(model.ln_f(hidden))
    return F.cross_entropy(logits.float(), targets, reduction="sum")
