"""The models of bench/peers.py: memfit's GPT, a chain of residual MLP blocks whose widths
differ 16x, and Hugging Face models built from their configs (no weights downloaded), each
with one batch, its loss and its blocks.

    subject = BUILDERS["chain"]()
    subject.loss_fn(subject.model, subject.batch).backward()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from checkpoint import peer_loss  # bench/checkpoint.py: the GPT with checkpoint_sequential
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential
from transformers.modeling_layers import GradientCheckpointingLayer
from zoo import VOCAB, ZOO, ZooModel, _causal, _images, has_dropout, make_optimizer

from memfit.models import build_model

LossFn = Callable[[nn.Module, Any], torch.Tensor]


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


def chain_subject() -> Subject:
    """An ``nn.Sequential`` of eight residual MLP blocks of widths :data:`CHAIN_WIDTHS`."""
    torch.manual_seed(0)
    widths = (CHAIN_WIDTHS[0], *CHAIN_WIDTHS)
    model = nn.Sequential(*(ResidualMLP(a, b, 0.1) for a, b in zip(widths, widths[1:])))
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(CHAIN_ROWS, CHAIN_WIDTHS[0], generator=g),
        torch.randn(CHAIN_ROWS, CHAIN_WIDTHS[-1], generator=g),
    )
    return make_subject(
        "chain", model, batch, mse_loss, lambda m: list(m), True, False, chain_sequential_loss
    )


#: memfit's GPT here: another size than bench/checkpoint.py's, dropout on.
GPT_SHAPE = {"n_layer": 9, "n_embd": 96, "n_head": 4, "block_size": 128, "dropout": 0.1}
GPT_BATCH = 8


def gpt_subject() -> Subject:
    """memfit's built-in GPT (:data:`GPT_SHAPE`), synthetic tokens."""
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **GPT_SHAPE)
    batch = batch_fn(GPT_BATCH, generator=0)
    return make_subject(
        "gpt", model, batch, loss_fn, lambda m: list(m.blocks), True, False, peer_loss
    )


def _speech(n: int, mels: int, frames: int, tgt: int) -> Callable[[torch.Generator], dict]:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_features": torch.randn(n, mels, frames, generator=g),
            "labels": torch.randint(0, VOCAB, (n, tgt), generator=g),
            "use_cache": False,
        }

    return batch


#: Families the zoo lacks: a mixture of experts, a speech encoder-decoder, a windowed vision
#: transformer and a state-space model (Mamba's slow path: no CUDA kernels on a CPU).
MORE_HF: dict[str, ZooModel] = {
    "mixtral": ZooModel(
        lambda: transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.MixtralForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "whisper": ZooModel(
        lambda: transformers.WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=80,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            max_source_positions=64,  # 128 input frames, halved by the second convolution
            max_target_positions=64,
            decoder_start_token_id=0,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=1,
        ),
        transformers.WhisperForConditionalGeneration,
        _speech(8, 80, 128, 32),
    ),
    "swin": ZooModel(
        lambda: transformers.SwinConfig(
            image_size=64,
            patch_size=4,
            embed_dim=32,
            depths=[2, 2, 2],
            num_heads=[2, 4, 8],
            window_size=4,
            num_labels=10,
        ),
        transformers.SwinForImageClassification,
        _images(8, 64, 10),
    ),
    "mamba": ZooModel(
        lambda: transformers.MambaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            state_size=16,
            num_hidden_layers=4,
            expand=2,
            conv_kernel=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
        transformers.MambaForCausalLM,
        _causal(8, 64, VOCAB),
    ),
}
HF_MODELS: dict[str, ZooModel] = {
    **{name: ZOO[name] for name in ("gpt2", "llama", "bert", "t5")},
    **MORE_HF,
}


def hf_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The loss a Hugging Face model computes from the labels in the batch (the output is
    dropped at once, as the Trainer does)."""
    return model(**batch).loss


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The innermost layers Hugging Face checkpoints (``GradientCheckpointingLayer``s that
    hold no other one): the transformer blocks, a Swin stage's blocks rather than the stage."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [
        m
        for m in layers
        if not any(isinstance(c, GradientCheckpointingLayer) for c in m.modules() if c is not m)
    ]


def hf_subject(name: str) -> Subject:
    """A Hugging Face model of :data:`HF_MODELS`, built from its config, no weights."""
    spec = HF_MODELS[name]
    torch.manual_seed(0)
    config = spec.config()
    model = spec.cls(config)
    batch = spec.batch(torch.Generator().manual_seed(0))
    return make_subject(name, model, batch, hf_loss, hf_blocks, has_dropout(config), True, None)


def make_subject(
    name: str,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    blocks: Callable[[nn.Module], list[nn.Module]],
    dropout: bool,
    is_hf: bool,
    sequential_loss: Callable[[int], LossFn] | None,
) -> Subject:
    """The subject in training mode, with an AdamW (``foreach=False``, as the zoo's)."""
    model.train()
    optimizer = make_optimizer(model, "adamw")
    return Subject(name, model, optimizer, batch, loss_fn, blocks, dropout, is_hf, sequential_loss)


BUILDERS: dict[str, Callable[[], Subject]] = {
    "gpt": gpt_subject,
    "chain": chain_subject,
    **{name: functools.partial(hf_subject, name) for name in HF_MODELS},
}
