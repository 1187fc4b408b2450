"""The models of the benchmarks (bench/zoo.py, bench/peers.py, bench/plan_identity.py): each
with how it is built, one batch, its loss and its blocks.

Hugging Face models are built from tiny configs (no weights downloaded) as the library ships
them: the configs' default dropout, the model's own loss from the labels in the batch. The
others are written here (bench/zoo_written.py: a chain of residual MLP blocks, an LSTM
language model, a recommender) or are memfit's GPT.

    spec = ZOO["gpt2"]
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.batch(torch.Generator().manual_seed(0))
    spec.loss(model, batch).backward()
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from checkpoint import peer_loss  # bench/checkpoint.py: the GPT with checkpoint_sequential
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from zoo_written import (  # bench/zoo_written.py: the models written here
    CHAIN_ROWS,
    CHAIN_WIDTHS,
    GPT_BATCH,
    GPT_SHAPE,
    LSTM_SHAPE,
    RECOMMENDER_SHAPE,
    VOCAB,
    LossFn,
    chain_batch,
    chain_sequential_loss,
    click_loss,
    gpt_batch,
    lstm_batch,
    make_chain,
    make_gpt,
    make_lstm,
    make_recommender,
    mse_loss,
    next_token_loss,
    recommender_batch,
)

from memfit.models.gpt import gpt_loss

#: The language models' common sizes (each config names them alike).
LM_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
#: The encoder-decoders' common sizes (Whisper's and BART's configs name them alike).
SEQ2SEQ_SIZES = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
}
#: One example batch from a seeded generator.
BatchFn = Callable[[torch.Generator], Any]


def hf_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The loss a Hugging Face model computes from the labels in the batch; the output is
    dropped at once, as the Trainer does."""
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


# ---------------------------------------------------------------------- dropout


def _configs(config: transformers.PretrainedConfig) -> list[transformers.PretrainedConfig]:
    """``config`` and its sub-configs (CLIP's text and vision configs), depth first."""
    subs = [v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig)]
    return [config, *(c for sub in subs for c in _configs(sub))]


def _dropout_keys(config: transformers.PretrainedConfig) -> list[str]:
    """The config's own dropout probabilities (``*dropout*``, ``*pdrop*``, ``*drop_path*``,
    ``*layerdrop``): its float settings named ``drop``."""
    return [
        key
        for key, value in vars(config).items()
        if isinstance(value, float) and not isinstance(value, bool) and "drop" in key
    ]


def without_dropout(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """A copy of ``config`` with every dropout probability 0, its sub-configs' too."""
    config = copy.deepcopy(config)
    for each in _configs(config):
        for key in _dropout_keys(each):
            setattr(each, key, 0.0)
    return config


def has_dropout(config: transformers.PretrainedConfig) -> bool:
    """Whether any dropout probability of ``config`` or its sub-configs is above 0."""
    return any(getattr(c, key) > 0 for c in _configs(config) for key in _dropout_keys(c))


# ---------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: how it is built, one batch, its loss and its blocks."""

    family: str
    """What it is, in a few words (the docs' list of models)."""
    make: Callable[[bool], nn.Module]
    """``make(dropout)``: the model; ``dropout=False``: the same model with every dropout
    probability 0 (a deterministic step, for the gradient check's twin)."""
    batch: BatchFn
    """The inputs of one step, labels included."""
    loss: LossFn = hf_loss
    blocks: Callable[[nn.Module], list[nn.Module]] = hf_blocks
    """The blocks of the model or of a copy of it, in forward order."""
    config: Callable[[], transformers.PretrainedConfig] | None = None
    """A Hugging Face model's config; None for a model written here or memfit's."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The sizes of a model written here (the JSON's record of it)."""
    dropout: bool = True
    """Whether a model written here has dropout (a Hugging Face one: its config says)."""
    sequential_loss: Callable[[int], LossFn] | None = None
    """A loss that runs the blocks through ``checkpoint_sequential`` with the given number
    of segments; None where the blocks are not a sequential stack."""

    def build(self, dropout: bool = True) -> nn.Module:
        """The model in training mode (the caller seeds its weights)."""
        return self.make(dropout).train()

    @property
    def is_hf(self) -> bool:
        return self.config is not None

    def has_dropout(self) -> bool:
        return has_dropout(self.config()) if self.config is not None else self.dropout

    def describe(self) -> dict[str, Any]:
        """The config (Hugging Face) or the sizes (the others), for the JSON."""
        return self.config().to_dict() if self.config is not None else dict(self.settings)


def hf_model(
    family: str,
    config: Callable[[], transformers.PretrainedConfig],
    cls: type[nn.Module],
    batch: BatchFn,
) -> ZooModel:
    """A Hugging Face model built from ``config()`` by ``cls``, its loss its own."""

    def make(dropout: bool) -> nn.Module:
        return cls(config() if dropout else without_dropout(config()))

    return ZooModel(family, make, batch, config=config)


def lora_model(
    family: str,
    config: Callable[[], transformers.PretrainedConfig],
    cls: type[nn.Module],
    batch: BatchFn,
    lora: dict[str, Any],
    lora_dropout: float = 0.0,
) -> ZooModel:
    """A Hugging Face model built as :func:`hf_model` builds it, wrapped in LoRA adapters
    as a PEFT fine-tune makes them: ``peft.get_peft_model(model, LoraConfig(**lora))``
    freezes the model's weights, the adapters alone train; ``lora_dropout`` on the
    adapters' inputs (0 in the twin without dropout). Its loss the model's own."""

    def make(dropout: bool) -> nn.Module:
        import peft  # optional (the hf extra): only the adapter models need it

        model = cls(config() if dropout else without_dropout(config()))
        settings = peft.LoraConfig(**lora, lora_dropout=lora_dropout if dropout else 0.0)
        return peft.get_peft_model(model, settings)

    return ZooModel(family, make, batch, config=config)


# ---------------------------------------------------------------------- batches


def _images(n: int, size: int, labels: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "pixel_values": torch.randn(n, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (n,), generator=g),
        }

    return batch


def _causal(n: int, seq: int, vocab: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        # use_cache=False as Hugging Face's own checkpointing trains: memfit does not
        # recompute layers that update a key/value cache.
        return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    return batch


def _masked(n: int, seq: int, vocab: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        labels = torch.where(torch.rand(n, seq, generator=g) < 0.15, ids, -100)
        return {"input_ids": ids, "labels": labels}

    return batch


def _seq2seq(n: int, src: int, tgt: int, vocab: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_ids": torch.randint(0, vocab, (n, src), generator=g),
            "labels": torch.randint(0, vocab, (n, tgt), generator=g),
            "use_cache": False,
        }

    return batch


def _speech(n: int, mels: int, frames: int, tgt: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_features": torch.randn(n, mels, frames, generator=g),
            "labels": torch.randint(0, VOCAB, (n, tgt), generator=g),
            "use_cache": False,
        }

    return batch


def _audio_ctc(n: int, samples: int, tgt: int, vocab: int) -> BatchFn:
    """Raw audio and character targets (1..vocab-1: 0 is the CTC blank, the pad token)."""

    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_values": torch.randn(n, samples, generator=g),
            "labels": torch.randint(1, vocab, (n, tgt), generator=g),
        }

    return batch


def _segmentation(n: int, size: int, labels: int) -> BatchFn:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "pixel_values": torch.randn(n, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (n, size, size), generator=g),
        }

    return batch


def _image_text(n: int, size: int, seq: int, vocab: int) -> BatchFn:
    """Pairs of an image and a caption; the loss is CLIP's contrastive one over the batch."""

    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_ids": torch.randint(0, vocab, (n, seq), generator=g),
            "pixel_values": torch.randn(n, 3, size, size, generator=g),
            "return_loss": True,
        }

    return batch


# ---------------------------------------------------------------------- the zoo


def _bert_config() -> transformers.BertConfig:
    """The zoo's BERT, fine-tuned whole (``bert``) or through adapters (``bert-lora``)."""
    return transformers.BertConfig(
        **LM_SIZES,
        intermediate_size=256,
    )


ZOO: dict[str, ZooModel] = {
    "resnet": hf_model(
        "ResNet image classifier",
        lambda: transformers.ResNetConfig(
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[2, 2, 2, 2],
            layer_type="basic",
            num_labels=10,
        ),
        transformers.ResNetForImageClassification,
        _images(8, 128, 10),
    ),
    "convnext": hf_model(
        "ConvNeXt image classifier",
        lambda: transformers.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2], image_size=64, num_labels=10
        ),
        transformers.ConvNextForImageClassification,
        _images(8, 64, 10),
    ),
    "vit": hf_model(
        "ViT image classifier",
        lambda: transformers.ViTConfig(
            image_size=64,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            num_labels=10,
        ),
        transformers.ViTForImageClassification,
        _images(8, 64, 10),
    ),
    "gpt2": hf_model(
        "GPT-2 causal LM",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=64,
            n_layer=4,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.GPT2LMHeadModel,
        _causal(8, 128, VOCAB),
    ),
    "llama": hf_model(
        "Llama causal LM",
        lambda: transformers.LlamaConfig(
            **LM_SIZES,
            intermediate_size=176,
            num_key_value_heads=2,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.LlamaForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "bert": hf_model(
        "BERT masked LM",
        _bert_config,
        transformers.BertForMaskedLM,
        _masked(8, 128, VOCAB),
    ),
    "t5": hf_model(
        "T5 encoder-decoder",
        lambda: transformers.T5Config(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=256,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        transformers.T5ForConditionalGeneration,
        _seq2seq(8, 64, 32, VOCAB),
    ),
    "gpt": ZooModel(
        "memfit's GPT",
        make_gpt,
        gpt_batch,
        loss=gpt_loss,
        blocks=lambda m: list(m.blocks),
        settings={**GPT_SHAPE, "batch": GPT_BATCH},
        sequential_loss=peer_loss,
    ),
    "chain": ZooModel(
        "residual MLP blocks 16x apart in width",
        make_chain,
        chain_batch,
        loss=mse_loss,
        blocks=lambda m: list(m),
        settings={"widths": CHAIN_WIDTHS, "rows": CHAIN_ROWS, "dropout": 0.1},
        sequential_loss=chain_sequential_loss,
    ),
    # A mixture of experts, a speech encoder-decoder, a windowed vision transformer and a
    # state-space model (Mamba's slow path: no CUDA kernels on a CPU).
    "mixtral": hf_model(
        "Mixtral mixture of experts",
        lambda: transformers.MixtralConfig(
            **LM_SIZES,
            intermediate_size=128,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.MixtralForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "whisper": hf_model(
        "Whisper speech encoder-decoder",
        lambda: transformers.WhisperConfig(
            **SEQ2SEQ_SIZES,
            vocab_size=VOCAB,
            num_mel_bins=80,
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
    "swin": hf_model(
        "Swin windowed vision transformer",
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
    "mamba": hf_model(
        "Mamba state-space LM",
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
    "lstm": ZooModel(
        "LSTM LM",
        make_lstm,
        lstm_batch,
        loss=next_token_loss,
        blocks=lambda m: list(m.layers),
        settings={**LSTM_SHAPE, "dropout": 0.1},
    ),
    "wav2vec2": hf_model(
        "Wav2Vec2 speech encoder, CTC loss",
        lambda: transformers.Wav2Vec2Config(
            vocab_size=32,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            conv_dim=(32, 32, 32),
            conv_stride=(5, 2, 2),
            conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            pad_token_id=0,
        ),
        transformers.Wav2Vec2ForCTC,
        _audio_ctc(4, 8000, 40, 32),  # 8000 samples: 399 frames after the convolutions
    ),
    "segformer": hf_model(
        "SegFormer semantic segmentation",
        lambda: transformers.SegformerConfig(
            num_encoder_blocks=4,
            depths=[2, 2, 2, 2],
            sr_ratios=[8, 4, 2, 1],
            hidden_sizes=[16, 32, 64, 128],
            num_attention_heads=[1, 2, 4, 8],
            decoder_hidden_size=64,
            num_labels=8,
        ),
        transformers.SegformerForSemanticSegmentation,
        _segmentation(4, 128, 8),
    ),
    "clip": hf_model(
        "CLIP contrastive image-text towers",
        lambda: transformers.CLIPConfig(
            text_config={
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "intermediate_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "max_position_embeddings": 32,
            },
            vision_config={
                "image_size": 64,
                "patch_size": 8,
                "hidden_size": 64,
                "intermediate_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
            },
            projection_dim=32,
        ),
        transformers.CLIPModel,
        _image_text(16, 64, 32, VOCAB),
    ),
    "recommender": ZooModel(
        "EmbeddingBag recommender",
        make_recommender,
        recommender_batch,
        loss=click_loss,
        blocks=lambda m: [m.bottom, m.top],
        settings={**RECOMMENDER_SHAPE, "dropout": 0.1},
    ),
    # Six families measured first as held-out work (the model the planner was not tuned
    # on): a tied-embedding LM, a second encoder-decoder, disentangled relative attention,
    # a parallel residual, soft-capping with sliding windows, a vision transformer with a
    # relative position bias and stochastic depth.
    "qwen3": hf_model(
        "Qwen3 causal LM, tied embeddings",
        lambda: transformers.Qwen3Config(
            **LM_SIZES,
            intermediate_size=176,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.Qwen3ForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "bart": hf_model(
        "BART encoder-decoder",
        lambda: transformers.BartConfig(
            **SEQ2SEQ_SIZES,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        ),
        transformers.BartForConditionalGeneration,
        _seq2seq(8, 64, 32, VOCAB),
    ),
    "deberta-v2": hf_model(
        "DeBERTa-v2 masked LM, disentangled relative attention",
        lambda: transformers.DebertaV2Config(
            **LM_SIZES,
            intermediate_size=256,
            # as DeBERTa-v3 is configured: relative attention, no absolute positions
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            position_buckets=32,
            max_relative_positions=-1,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
        ),
        transformers.DebertaV2ForMaskedLM,
        _masked(8, 128, VOCAB),
    ),
    "gpt-neox": hf_model(
        "GPT-NeoX causal LM, parallel residual",
        lambda: transformers.GPTNeoXConfig(
            **LM_SIZES,
            intermediate_size=256,
            use_parallel_residual=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.GPTNeoXForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "gemma2": hf_model(
        "Gemma2 causal LM, soft-capping, sliding window",
        lambda: transformers.Gemma2Config(
            **LM_SIZES,
            intermediate_size=176,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=32,  # shorter than the sequence: the sliding layers do slide
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        ),
        transformers.Gemma2ForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "beit": hf_model(
        "BEiT image classifier, relative position bias",
        lambda: transformers.BeitConfig(
            image_size=64,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            use_relative_position_bias=True,
            num_labels=10,
        ),
        transformers.BeitForImageClassification,
        _images(8, 64, 10),
    ),
    # Adapters as users fine-tune a model: PEFT's LoRA on the attention's query and value
    # projections (r=8), the base weights frozen.
    "llama-lora": lora_model(
        "Llama causal LM, LoRA adapters (PEFT)",
        lambda: transformers.LlamaConfig(
            **LM_SIZES,
            intermediate_size=128,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.LlamaForCausalLM,
        _causal(8, 128, VOCAB),
        {
            "task_type": "CAUSAL_LM",
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
        },
    ),
    "bert-lora": lora_model(
        "BERT masked LM, LoRA adapters (PEFT)",
        _bert_config,
        transformers.BertForMaskedLM,
        _masked(8, 128, VOCAB),
        {"r": 8, "lora_alpha": 16, "target_modules": ["query", "value"]},
        lora_dropout=0.1,
    ),
}


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW: ``adamw`` (``foreach=False``, the benchmarks' default), ``adamw-foreach`` or
    ``adamw-fused``."""
    flags = {"adamw": {"foreach": False}, "adamw-foreach": {"foreach": True}}
    flags["adamw-fused"] = {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **flags[kind])
