"""Built-in reference models and a registry that builds each with its loss and data.

=========  ==========================================  =========================  ==============
name       model                                       batch                      data
=========  ==========================================  =========================  ==============
``gpt``    :class:`~memfit.models.gpt.GPT`             ``(B, block_size + 1)``    corpus, synthetic
``resnet`` :class:`~memfit.models.resnet.ResNet`       ``(images, labels)``       synthetic
``lstm``   :class:`~memfit.models.lstm.LSTMLM`         ``(B, seq_len + 1)``       corpus, synthetic
=========  ==========================================  =========================  ==============

"corpus" is the byte-level standard-library corpus (:class:`memfit.data.TextCorpus`), loaded
on the first batch; "synthetic" is :mod:`memfit.data.synthetic`.

Example::

    model, loss_fn, batch_fn = build_model("gpt", n_layer=2, data="synthetic")
    loss = loss_fn(model, batch_fn(8, generator=0))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.data import synthetic
from memfit.data.text import DEFAULT_MAX_BYTES, Split, TextCorpus
from memfit.errors import ConfigError
from memfit.models.gpt import GPT, Block, GPTConfig, chunked_gpt_loss, gpt_loss, lm_cross_entropy
from memfit.models.lstm import LSTMLM, LSTMConfig, LSTMLayer, lstm_loss
from memfit.models.resnet import BasicBlock, ResNet, ResNetConfig, resnet_loss

#: ``loss_fn(model, batch) -> scalar loss``, the shape ``Engine.train_step`` expects.
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: ``batch_fn(batch_size, generator=None, split="train") -> batch``.
BatchFn = Callable[..., Any]


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: how to build a named model and what data it takes."""

    name: str
    """The registry name, as used by ``memfit train --model NAME``."""
    description: str
    """One line for help texts."""
    config_cls: type
    """The config dataclass; its fields are the overrides :func:`build_model` accepts."""
    model_cls: type[nn.Module]
    """The model class, constructed from a config instance."""
    loss_fn: LossFn
    """The model's ``loss_fn(model, batch)``."""
    data_kinds: tuple[str, ...]
    """Accepted ``data=`` values; the first is the default."""


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(
        "gpt",
        "decoder-only Transformer language model on bytes",
        GPTConfig,
        GPT,
        gpt_loss,
        ("corpus", "synthetic"),
    ),
    "resnet": ModelSpec(
        "resnet",
        "residual CNN classifier for 32x32 images",
        ResNetConfig,
        ResNet,
        resnet_loss,
        ("synthetic",),
    ),
    "lstm": ModelSpec(
        "lstm",
        "stacked LSTM language model on bytes",
        LSTMConfig,
        LSTMLM,
        lstm_loss,
        ("corpus", "synthetic"),
    ),
}


def model_names() -> list[str]:
    """The names :func:`build_model` accepts.

    Example::

        model_names()  # ['gpt', 'resnet', 'lstm']
    """
    return list(MODELS)


class BuiltModel(NamedTuple):
    """What :func:`build_model` returns; unpacks as ``model, loss_fn, batch_fn``."""

    model: nn.Module
    """The model, on the requested device."""
    loss_fn: LossFn
    """``loss_fn(model, batch) -> scalar``, computed in fp32."""
    batch_fn: BatchFn
    """``batch_fn(batch_size, generator=None, split="train") -> batch`` on the requested device."""

    @property
    def config(self) -> Any:
        """The model's config dataclass."""
        return self.model.config


def _get_spec(name: str) -> ModelSpec:
    spec = MODELS.get(str(name).strip().lower())
    if spec is None:
        raise ConfigError(f"unknown model {name!r}. Valid models: {', '.join(MODELS)}")
    return spec


def make_config(name: str, config: Any | None = None, **overrides: Any) -> Any:
    """The config of model ``name``: ``config`` (or the defaults) with ``overrides`` applied.

    Raises:
        ConfigError: For an unknown model or an override that is not a config field.

    Example::

        make_config("gpt", n_layer=8)  # GPTConfig(..., n_layer=8, ...)
    """
    spec = _get_spec(name)
    fields = [f.name for f in dataclasses.fields(spec.config_cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} for model {spec.name!r}. "
            f"Valid settings: {', '.join(fields)}"
        )
    if config is None:
        return spec.config_cls(**overrides)
    if not isinstance(config, spec.config_cls):
        raise ConfigError(
            f"model {spec.name!r} needs a {spec.config_cls.__name__}, got {type(config).__name__}"
        )
    return dataclasses.replace(config, **overrides)


def _text_batch_fn(
    seq_len: int,
    vocab_size: int,
    data: str,
    device: torch.device | str | None,
    max_bytes: int | None,
    cache_dir: str | os.PathLike[str] | None,
) -> BatchFn:
    if data == "synthetic":

        def synthetic_batch(
            batch_size: int, generator: torch.Generator | int | None = None, split: Split = "train"
        ) -> torch.Tensor:
            # The synthetic task has no held-out data: both splits come from the same chain.
            return synthetic.token_batch(
                batch_size, seq_len, vocab_size, generator=generator, device=device
            )

        return synthetic_batch

    if vocab_size < TextCorpus.vocab_size:
        raise ConfigError(
            f"the byte corpus needs vocab_size >= 256, got {vocab_size}; "
            "raise vocab_size or use data='synthetic'"
        )
    loaded: list[TextCorpus] = []

    def corpus_batch(
        batch_size: int, generator: torch.Generator | int | None = None, split: Split = "train"
    ) -> torch.Tensor:
        # Loaded on first use: planning or estimating never needs the corpus, and building
        # or reading it takes a moment.
        if not loaded:
            loaded.append(TextCorpus.load(max_bytes=max_bytes, cache_dir=cache_dir))
        return loaded[0].batch(split, batch_size, seq_len, generator=generator, device=device)

    return corpus_batch


def build_model(
    name: str,
    *,
    config: Any | None = None,
    data: str | None = None,
    device: torch.device | str | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    cache_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> BuiltModel:
    """Build a reference model with its loss and a batch maker.

    Args:
        name: ``"gpt"``, ``"resnet"`` or ``"lstm"`` (see :data:`MODELS`).
        config: A config dataclass to start from (default: the model's defaults).
        data: ``"corpus"`` (default for gpt and lstm) or ``"synthetic"`` (the only choice for
            resnet).
        device: Where the model's parameters and the batches go (default: CPU).
        max_bytes, cache_dir: Passed to :meth:`TextCorpus.load` for ``data="corpus"``.
        **overrides: Config fields to change, e.g. ``n_layer=8``.

    Returns:
        ``BuiltModel(model, loss_fn, batch_fn)``.
        ``batch_fn(batch_size, generator=None, split="train")`` returns one batch; the same
        integer seed or generator state gives the same batch. ``split="val"`` samples the
        corpus's validation bytes; synthetic data has one distribution and ignores it.

    Raises:
        ConfigError: For an unknown name, override or data kind; for ``data="corpus"`` when
            this Python has no standard-library sources (raised by the first ``batch_fn`` call).

    Example::

        model, loss_fn, batch_fn = build_model("resnet", widths=(16, 32))
        loss_fn(model, batch_fn(32, generator=0)).backward()
    """
    spec = _get_spec(name)
    cfg = make_config(spec.name, config, **overrides)
    data = spec.data_kinds[0] if data is None else data
    if data not in spec.data_kinds:
        raise ConfigError(
            f"model {spec.name!r} cannot use data={data!r}. Valid: {', '.join(spec.data_kinds)}"
        )
    model = spec.model_cls(cfg)
    if device is not None:
        model = model.to(device)

    if isinstance(cfg, ResNetConfig):

        def image_batch(
            batch_size: int, generator: torch.Generator | int | None = None, split: Split = "train"
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # Synthetic images have no held-out set; ``split`` is accepted so that every
            # batch function has the same signature.
            return synthetic.image_batch(
                batch_size,
                num_classes=cfg.num_classes,
                image_size=cfg.image_size,
                channels=cfg.in_channels,
                generator=generator,
                device=device,
            )

        batch_fn: BatchFn = image_batch
    else:
        seq_len = cfg.block_size if isinstance(cfg, GPTConfig) else cfg.seq_len
        batch_fn = _text_batch_fn(seq_len, cfg.vocab_size, data, device, max_bytes, cache_dir)
    return BuiltModel(model, spec.loss_fn, batch_fn)


__all__ = [
    "GPT",
    "LSTMLM",
    "MODELS",
    "BasicBlock",
    "Block",
    "BuiltModel",
    "GPTConfig",
    "LSTMConfig",
    "LSTMLayer",
    "ModelSpec",
    "ResNet",
    "ResNetConfig",
    "build_model",
    "chunked_gpt_loss",
    "gpt_loss",
    "lm_cross_entropy",
    "lstm_loss",
    "make_config",
    "model_names",
    "resnet_loss",
]
