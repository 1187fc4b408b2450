"""``memfit estimate``: what fits, for a model of any size, estimated without allocating it.

The model comes from one of three places:

* a built-in one (``--model gpt|resnet|lstm`` with ``--set KEY=VALUE`` config fields);
* ``--hf-config gpt2|llama|bert|t5|vit``: a Hugging Face model built from its default
  config (no download; ``llama``'s is Llama-2-7B's shape) with ``--set`` changing config
  attributes, e.g. ``--set num_hidden_layers=8``, trained on its own loss (``labels``);
* ``--factory MODULE:FUNCTION``: ``FUNCTION()`` returns ``(model_fn, inputs_fn)`` or
  ``(model_fn, inputs_fn, loss_fn)``, the arguments of :func:`memfit.estimate.estimate`:
  ``model_fn()`` builds the model (under the meta device), ``inputs_fn(batch_size)`` one
  micro-batch, ``loss_fn(model, batch)`` the loss (the Engine's form).

Computing (:func:`compute`) is kept apart from printing (:func:`run`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from memfit.cli.common import (
    UsageError,
    load_factory,
    model_config_cls,
    parse_overrides,
    typed_value,
)

#: Hugging Face models ``--hf-config`` builds: (config class, model class, input kind).
HF_MODELS: dict[str, tuple[str, str, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "text"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "text"),
    "bert": ("BertConfig", "BertForMaskedLM", "text"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "text"),
    "vit": ("ViTConfig", "ViTForImageClassification", "image"),
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="estimate a training step's memory per precision and strategy, without allocating it",
        description="Estimate the peak memory of a training step at every precision and "
        "checkpoint strategy on fake tensors (no weights are allocated), whether it fits "
        "--device-memory, and the largest micro-batch that does.",
    )
    p.add_argument("--model", default="gpt", help="gpt | resnet | lstm (default: gpt)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a built-in model's config field, or a Hugging Face config attribute (repeatable)",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        choices=sorted(HF_MODELS),
        help="a Hugging Face model from its default config (no download)",
    )
    p.add_argument(
        "--factory",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your model: FUNCTION() returns (model_fn, inputs_fn[, loss_fn])",
    )
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size (default: 8)")
    p.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence for --hf-config (512)"
    )
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per step")
    p.add_argument("--device-memory", default=None, help="memory to fit, e.g. 80GB")
    p.add_argument(
        "--precision",
        dest="precisions",
        action="append",
        default=None,
        help="a precision mode (repeatable; default: fp32, bf16-mixed, bf16-master)",
    )
    p.add_argument(
        "--strategy",
        dest="strategies",
        action="append",
        default=None,
        help="none | full | sqrt | optimal (repeatable; default: all)",
    )
    p.add_argument(
        "--world-size", type=int, default=1, help="ranks of a data-parallel run (default: 1)"
    )
    p.add_argument(
        "--data-parallel",
        default=None,
        choices=("ddp", "fsdp"),
        help="estimate one rank of a DDP or FSDP2 run (--batch-size per rank)",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(run=run)


Built = tuple[Callable[[], Any], Callable[[int], Any], Any]


def builtin_spec(name: str, items: list[str]) -> Built:
    """``(model_fn, inputs_fn, loss_fn)`` of a built-in model, its batches made on meta.

    Example::

        model_fn, inputs_fn, loss_fn = builtin_spec("gpt", ["n_layer=2"])
    """
    from memfit.models import MODELS, GPTConfig, ResNetConfig, make_config

    overrides = parse_overrides(items, model_config_cls(name))
    cfg = make_config(name, **overrides)
    spec = MODELS[name]

    def inputs_fn(b: int) -> Any:
        with torch.device("meta"):
            if isinstance(cfg, ResNetConfig):
                size = cfg.image_size
                images = torch.empty(b, cfg.in_channels, size, size)
                return images, torch.zeros(b, dtype=torch.long)
            seq = cfg.block_size if isinstance(cfg, GPTConfig) else cfg.seq_len
            return torch.zeros(b, seq + 1, dtype=torch.long)

    return (lambda: spec.model_cls(cfg)), inputs_fn, spec.loss_fn


def hf_spec(name: str, items: list[str], seq_len: int) -> Built:
    """``(model_fn, inputs_fn, loss_fn)`` of a Hugging Face model from its default config,
    changed by ``KEY=VALUE`` items; trained on its own loss (``labels`` in the batch).

    Example::

        model_fn, inputs_fn, loss_fn = hf_spec("llama", ["num_hidden_layers=2"], 128)
    """
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf-config needs transformers: pip install transformers") from None
    config_name, model_name, kind = HF_MODELS[name]
    config = getattr(transformers, config_name)()
    if name == "t5" and getattr(config, "decoder_start_token_id", None) is None:
        # T5's checkpoints start decoding at the pad token; the bare config leaves it unset.
        config.decoder_start_token_id = config.pad_token_id
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not hasattr(config, key):
            raise UsageError(
                f"--set {item!r}: expected KEY=VALUE with KEY a {config_name} attribute"
            )
        setattr(config, key, typed_value(text, getattr(config, key), item, key))
    model_cls = getattr(transformers, model_name)

    def inputs_fn(b: int) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            if kind == "image":
                size, channels = config.image_size, config.num_channels
                return {
                    "pixel_values": torch.empty(b, channels, size, size),
                    "labels": torch.zeros(b, dtype=torch.long),
                }
            ids = torch.zeros(b, seq_len, dtype=torch.long)
            return {"input_ids": ids, "labels": ids}

    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    return (lambda: model_cls(config)), inputs_fn, loss_fn


def _factory_spec(spec: str) -> Built:
    factory = load_factory(spec, "mypkg.models:spec")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UsageError(
            f"--factory {spec}: must return (model_fn, inputs_fn) or (model_fn, inputs_fn, "
            f"loss_fn), got {type(made).__name__}"
        )
    return made[0], made[1], made[2] if len(made) == 3 else None


def compute(args: argparse.Namespace) -> Any:
    """The :class:`~memfit.estimate.Estimate` the parsed flags ask for."""
    from memfit.estimate import estimate

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.factory and args.hf_config:
        raise UsageError("give one of --factory and --hf-config")
    if args.factory:
        model_fn, inputs_fn, loss_fn = _factory_spec(args.factory)
    elif args.hf_config:
        model_fn, inputs_fn, loss_fn = hf_spec(args.hf_config, args.overrides, args.seq_len)
    else:
        model_fn, inputs_fn, loss_fn = builtin_spec(args.model, args.overrides)
    return estimate(
        model_fn,
        inputs_fn,
        batch_size=args.batch_size,
        loss_fn=loss_fn,
        precisions=args.precisions,
        strategies=args.strategies,
        accumulation_steps=args.accumulation_steps,
        device_memory=args.device_memory,
        world_size=args.world_size,
        data_parallel=args.data_parallel,
    )


def run(args: argparse.Namespace) -> int:
    est = compute(args)
    print(est.to_json() if args.json else est.summary())
    return 0
