"""``memfit estimate``: what fits, for a model of any size, estimated without allocating it.

The model comes from one of three places:

* a built-in one (``--model gpt|resnet|lstm`` with ``--set KEY=VALUE`` config fields);
* ``--hf-config gpt2|llama|bert|t5|vit``: a Hugging Face model built from its default
  config (no download; ``llama``'s is Llama-2-7B's shape) with ``--set`` changing config
  attributes, e.g. ``--set num_hidden_layers=8``, trained on its own loss (``labels``);
* ``--factory MODULE:FUNCTION``: ``FUNCTION()`` returns a
  :class:`~memfit.workload.Workload` (the form every subcommand's ``--factory`` takes),
  the arguments of :func:`memfit.estimator.estimate`: ``model_fn()`` builds the model
  (under the meta device), ``batch_fn(batch_size)`` one micro-batch, ``loss_fn(model,
  batch)`` the loss (the Engine's form; without one, the sum of the output).

``--scale`` asks instead for the capacity view (:func:`memfit.capacity_view.capacity`): over a
family of sizes (``--sizes DEPTHxWIDTH,...`` of the built-in GPT or of a ``--hf-config``),
the largest model and the largest batch that fit ``--device-memory`` under each precision
and strategy, as tables (or ``--json``) and, with ``--plot PATH``, a figure; ``--tiers all``
adds the memory tiers (8-bit optimizer state, gradients released in backward, fp8
activations, ``bf16-sr``, and for the built-in GPT its loss in token chunks).

Computing (:func:`compute`) is kept apart from printing (:func:`run`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memfit.cli.common import (
    UsageError,
    add_activation_storage_argument,
    add_factory_argument,
    add_model_choice,
    load_workload,
    model_config_cls,
    parse_overrides,
    positive_size,
    typed_value,
)

# torch is imported where it is used: building the parser (memfit --help) needs none of it.
if TYPE_CHECKING:
    import torch

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
    add_model_choice(
        p, "a built-in model's config field, or a Hugging Face config attribute (repeatable)"
    )
    p.add_argument(
        "--hf-config",
        default=None,
        choices=sorted(HF_MODELS),
        help="a Hugging Face model from its default config (no download)",
    )
    add_factory_argument(p)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size (default: 8)")
    p.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence for --hf-config (512)"
    )
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per step")
    p.add_argument(
        "--device-memory", default=None, type=positive_size, help="memory to fit, e.g. 80GB"
    )
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
        "--scale",
        action="store_true",
        help="the capacity view: the largest model and batch that fit, over --sizes",
    )
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        metavar="DxW,...",
        help=f"depth x width of each size for --scale (default: {DEFAULT_SIZES})",
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="--scale: write a PNG figure")
    p.add_argument(
        "--world-size", type=int, default=1, help="ranks of a data-parallel run (default: 1)"
    )
    p.add_argument(
        "--data-parallel",
        default=None,
        choices=("ddp", "fsdp"),
        help="estimate one rank of a DDP or FSDP2 run (--batch-size per rank)",
    )
    p.add_argument(
        "--optimizer-state",
        default="fp32",
        choices=("fp32", "bf16", "8bit"),
        help="how AdamW keeps its moments: fp32 (8 bytes a parameter) | bf16 (4) | 8bit "
        "(about 2) (default: fp32)",
    )
    p.add_argument(
        "--release-gradients",
        action="store_true",
        help="each update applied as its gradient is made in backward (Engine("
        "release_gradients=True)): the gradients are never all held",
    )
    add_activation_storage_argument(p, default=("keep", "recompute"))
    p.add_argument(
        "--tiers",
        default="none",
        choices=("none", "all"),
        help="--scale: 'all' searches the memory tiers too (8-bit state, released "
        "gradients, fp8 activations, bf16-sr, the built-in GPT's chunked loss), each row "
        "naming its tiers (default: none)",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(run=run)


#: The sizes ``--scale`` estimates by default: GPT-2 small to a 20B-class model.
DEFAULT_SIZES = "12x768,24x1024,24x2048,32x2560,32x4096,40x5120,48x6144"

#: How ``--scale`` gives a Hugging Face config a depth and a width: the attributes set, the
#: others derived from the width as the families' own sizes do (heads of 64, or 128 for
#: Llama; Llama's MLP 8/3 of the width rounded up to a multiple of 256).
HF_SIZE_KEYS: dict[str, Callable[[int, int], dict[str, int]]] = {
    "gpt2": lambda d, w: {"n_layer": d, "n_embd": w, "n_head": max(1, w // 64)},
    "llama": lambda d, w: {
        "num_hidden_layers": d,
        "hidden_size": w,
        "intermediate_size": -(-8 * w // (3 * 256)) * 256,
        "num_attention_heads": max(1, w // 128),
        "num_key_value_heads": max(1, w // 128),
    },
    "bert": lambda d, w: {
        "num_hidden_layers": d,
        "hidden_size": w,
        "intermediate_size": 4 * w,
        "num_attention_heads": max(1, w // 64),
    },
    "t5": lambda d, w: {
        "num_layers": d,
        "num_decoder_layers": d,
        "d_model": w,
        "d_ff": 4 * w,
        "num_heads": max(1, w // 64),
        "d_kv": 64,
    },
    "vit": lambda d, w: {
        "num_hidden_layers": d,
        "hidden_size": w,
        "intermediate_size": 4 * w,
        "num_attention_heads": max(1, w // 64),
    },
}


Built = tuple[Callable[[], Any], Callable[[int], Any], Any]


def builtin_spec(name: str, items: list[str]) -> Built:
    """``(model_fn, inputs_fn, loss_fn)`` of a built-in model, its batches made on meta.

    Example::

        model_fn, inputs_fn, loss_fn = builtin_spec("gpt", ["n_layer=2"])
    """
    import torch

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
    import torch

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


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"12x768,24x1024"`` as ``[(12, 768), (24, 1024)]``; a usage error otherwise.

    Example::

        parse_sizes("32x4096")  # [(32, 4096)]
    """
    sizes = []
    for item in text.split(","):
        depth, sep, width = item.strip().lower().partition("x")
        if not (sep and depth.isdigit() and width.isdigit() and int(depth) and int(width)):
            raise UsageError(
                f"--sizes: {item.strip()!r} is not DEPTHxWIDTH with positive ints, e.g. 32x4096"
            )
        sizes.append((int(depth), int(width)))
    return sizes


def _family(args: argparse.Namespace) -> tuple[Callable[[int, int], Any], Callable, Any, Any]:
    """``(family, inputs_fn, loss_fn, chunked_loss_fn)`` for ``--scale``:
    ``family(depth, width)`` builds the built-in GPT or the ``--hf-config`` model of that
    size, ``--set`` applied on top; the built-in GPT's loss in token chunks (None for a
    Hugging Face model, whose loss is its own)."""
    if args.factory:
        raise UsageError("--scale takes the built-in GPT or --hf-config, not --factory")
    if args.hf_config:
        sized = HF_SIZE_KEYS[args.hf_config]
        _, inputs_fn, loss_fn = hf_spec(args.hf_config, args.overrides, args.seq_len)

        def hf_family(depth: int, width: int) -> Any:
            items = [f"{k}={v}" for k, v in sized(depth, width).items()]
            return hf_spec(args.hf_config, items + args.overrides, args.seq_len)[0]()

        return hf_family, inputs_fn, loss_fn, None
    if args.model != "gpt":
        raise UsageError(f"--scale sizes the built-in gpt by depth and width, not {args.model!r}")
    _, inputs_fn, loss_fn = builtin_spec("gpt", args.overrides)

    def gpt_family(depth: int, width: int) -> Any:
        items = [f"n_layer={depth}", f"n_embd={width}", f"n_head={max(1, width // 64)}"]
        return builtin_spec("gpt", items + args.overrides)[0]()

    from memfit.models.gpt import chunked_gpt_loss

    return gpt_family, inputs_fn, loss_fn, chunked_gpt_loss


def compute(args: argparse.Namespace) -> Any:
    """The :class:`~memfit.estimator.Estimate` (or, with ``--scale``, the
    :class:`~memfit.capacity_view.Capacity`) the parsed flags ask for."""
    from memfit.estimator import estimate

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.factory and args.hf_config:
        raise UsageError("give one of --factory and --hf-config")
    if args.scale:
        from memfit.capacity_view import capacity

        if args.device_memory is None:
            raise UsageError("--scale needs --device-memory, e.g. --device-memory 80GB")
        if args.release_gradients or len(args.activation_storage) > 2:
            flag = "--release-gradients" if args.release_gradients else "--activation-storage"
            raise UsageError(
                "--scale compares released gradients and coded activations with plain ones "
                f"under --tiers all; drop {flag}"
            )
        family, inputs_fn, loss_fn, chunked_loss_fn = _family(args)
        return capacity(
            family,
            inputs_fn,
            sizes=parse_sizes(args.sizes),
            batch_size=args.batch_size,
            device_memory=args.device_memory,
            loss_fn=loss_fn,
            precisions=args.precisions,
            strategies=args.strategies,
            world_size=args.world_size,
            data_parallel=args.data_parallel,
            optimizer_state=args.optimizer_state,
            memory_tiers=args.tiers,
            chunked_loss_fn=chunked_loss_fn,
        )
    if args.plot or args.tiers != "none":
        raise UsageError(
            f"--{'plot' if args.plot else 'tiers'} is for the capacity view: add --scale"
        )
    if args.factory:
        workload = load_workload(args.factory)
        model_fn, inputs_fn, loss_fn = workload.model_fn, workload.batch_fn, workload.loss_fn
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
        optimizer_state=args.optimizer_state,
        release_gradients=args.release_gradients,
        activation_storage=args.activation_storage,
    )


def dominated_notes(rows: list[Any]) -> list[str]:
    """A note for each strategy row that another row of the same precision beats on both
    counts (a peak no lower and a recompute no smaller, one of them strictly): with few
    blocks, ``sqrt``'s segments of several blocks each hold more while one is recomputed
    than ``full``'s single blocks do, and recompute as much or more. ``rows``: the
    estimate's :class:`~memfit.estimator.EstimateRow` objects.

    Example::

        dominated_notes(est.rows)
        # ['note: fp32 sqrt is dominated by full: peak 4.41 MiB vs 3.90 MiB, ...']
    """
    from memfit.units import format_bytes

    notes = []
    for r in rows:
        for other in rows:
            if other is r or other.precision != r.precision or other.strategy == "optimal":
                continue
            no_worse = (
                other.peak_bytes <= r.peak_bytes
                and other.recompute_fraction <= r.recompute_fraction
            )
            better = (
                other.peak_bytes < r.peak_bytes or other.recompute_fraction < r.recompute_fraction
            )
            if no_worse and better:
                notes.append(
                    f"note: {r.precision} {r.strategy} is dominated by {other.strategy}: peak "
                    f"{format_bytes(r.peak_bytes)} vs {format_bytes(other.peak_bytes)}, "
                    f"recompute {r.recompute_fraction:.0%} vs {other.recompute_fraction:.0%} "
                    f"of the forward; use {other.strategy} (with few blocks, sqrt(n) "
                    "segments hold several blocks at once while one is recomputed)"
                    if r.strategy == "sqrt"
                    else f"note: {r.precision} {r.strategy} is dominated by {other.strategy}: "
                    f"peak {format_bytes(r.peak_bytes)} vs {format_bytes(other.peak_bytes)}, "
                    f"recompute {r.recompute_fraction:.0%} vs {other.recompute_fraction:.0%}"
                )
                break
    return notes


def run(args: argparse.Namespace) -> int:
    est = compute(args)
    print(est.to_json() if args.json else est.summary())
    if not args.json and not args.scale:
        for note in dominated_notes(list(est.rows)):
            print(note)
    if args.plot:
        print(f"figure: {est.plot(args.plot)}")
    return 0
