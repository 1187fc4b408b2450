"""What the GPT benchmarks share: the model's shape on the command line, and building it.

parser = argparse.ArgumentParser()
add_gpt_arguments(parser, n_layer=16, n_embd=128, n_head=4, block_size=256, batch_size=16)
model, loss_fn, batch_fn = build_gpt(parser.parse_args())
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from memfit.models import build_model


def add_gpt_arguments(
    parser: argparse.ArgumentParser,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    block_size: int,
    batch_size: int,
) -> None:
    """``--n-layer --n-embd --n-head --block-size --batch-size``, with these defaults."""
    for flag, default in (
        ("--n-layer", n_layer),
        ("--n-embd", n_embd),
        ("--n-head", n_head),
        ("--block-size", block_size),
        ("--batch-size", batch_size),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"(default: {default})")


def build_gpt(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any]:
    """The built-in GPT of that shape, seeded: ``(model, loss_fn, batch_fn)`` with
    synthetic batches, as :func:`memfit.models.build_model` returns them."""
    torch.manual_seed(0)
    return build_model(
        "gpt",
        data="synthetic",
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        block_size=args.block_size,
    )
