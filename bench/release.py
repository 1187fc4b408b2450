"""Gradients released in backward against gradients kept: the allocator's peak of one
training step, and memfit.plan's prediction of it, on a GPT where the optimizer step is the
peak (batch 1) and on a GPT and a ResNet where activations are (docs/tiers.md's tables).

Each step is an Engine's (fp32, AdamW, no checkpointing), after a warm-up step; the
warm-up runs under the allocator's profiler too, so that the last step's gradients, named
as alive at the start, are seen to go (``memfit.allocator``). The prediction is
``memfit.plan(..., zero_grad="in_backward")`` for the released step and the usual
``memfit.plan`` for the kept one, on the same batch.

    python bench/release.py            # the table in docs/tiers.md
    python bench/release.py --zoo      # the zoo's models (bench/zoo_models.py), 8-bit state

With ``--zoo``, the models of ``bench/zoo.py`` (Hugging Face models built from their
configs, LoRA fine-tunes, an LSTM, a chain of blocks of different widths), each with its own
loss and dropout, trained with 8-bit state and gradients kept and released.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.errors import ConfigError
from memfit.models import GPT, GPTConfig, build_model, gpt_loss
from memfit.nested import tensors


@dataclass(frozen=True)
class Case:
    """A model, its batch and its loss."""

    name: str
    build: Callable[[], tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]]


def _gpt(n_layer: int, n_embd: int, batch: int) -> Case:
    def build() -> tuple[nn.Module, Any, Callable]:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd)
        return GPT(config), torch.randint(0, 256, (batch, 65)), gpt_loss

    return Case(f"GPT {n_layer} x {n_embd}, batch {batch}", build)


def _resnet(batch: int) -> Case:
    def build() -> tuple[nn.Module, Any, Callable]:
        torch.manual_seed(0)
        model, loss_fn, batch_fn = build_model("resnet", data="synthetic")
        return model, batch_fn(batch, generator=0), loss_fn

    return Case(f"ResNet (built-in), batch {batch}", build)


CASES = (_gpt(4, 256, 1), _gpt(2, 128, 4), _resnet(8))


def zoo_cases() -> list[Case]:
    """The zoo's models (``bench/zoo_models.py``), each as its library ships it."""
    from zoo_models import ZOO

    def case(name: str) -> Case:
        spec = ZOO[name]

        def build() -> tuple[nn.Module, Any, Callable]:
            torch.manual_seed(0)
            return spec.build(), spec.batch(torch.Generator().manual_seed(0)), spec.loss

        return Case(name, build)

    return [case(name) for name in ZOO]


@dataclass(frozen=True)
class Row:
    case: str
    optimizer_state: str
    released: bool
    measured_bytes: int
    predicted_bytes: float

    @property
    def error(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1


def measure(case: Case, optimizer_state: str, released: bool) -> Row:
    model, batch, loss_fn = case.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero_grad = "in_backward" if released else "before_forward"
    plan = memfit.plan(
        model, batch, loss_fn, optimizer=optimizer, precision="fp32", zero_grad=zero_grad
    )
    engine = memfit.Engine(
        model,
        optimizer,
        precision="fp32",
        checkpoint="none",
        optimizer_state=optimizer_state,
        release_gradients=released,
        monitor=False,
        log_every=10**9,
    )
    if optimizer_state != "fp32":
        plan = memfit.plan(
            model, batch, loss_fn, optimizer=engine.optimizer, precision="fp32", zero_grad=zero_grad
        )
    allocator_peak(lambda: engine.train_step(batch, loss_fn))  # warm-up, under the profiler
    optimizer = engine.optimizer
    peak = allocator_peak(
        lambda: engine.train_step(batch, loss_fn),
        live=[
            *model.parameters(),
            *model.buffers(),
            *optimizer_tensors(optimizer),
            *tensors(batch),
            *(p.grad for p in model.parameters() if p.grad is not None),
        ],
        live_complete=True,
    )
    engine.close()
    return Row(case.name, optimizer_state, released, peak.peak_bytes, plan.predicted_peak_bytes)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def render(rows: list[Row]) -> str:
    lines = [
        "| model | optimizer state | gradients | measured (allocator) | predicted | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.optimizer_state} | {'released' if r.released else 'kept'} | "
            f"{_mb(r.measured_bytes)} | {_mb(r.predicted_bytes)} | {r.error * 100:+.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--zoo", action="store_true", help="the zoo's models, 8-bit state")
    parser.add_argument("--models", help="with --zoo: only these, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases, states = (zoo_cases(), ("8bit",)) if args.zoo else (list(CASES), ("fp32", "8bit"))
    if args.models:
        cases = [c for c in cases if c.name in args.models.split(",")]
    rows, refused = [], []
    for case in cases:
        try:
            for state in states:
                for released in (False, True):
                    rows.append(measure(case, state, released))
        except ConfigError as exc:  # a batch the Engine cannot take, in any setting
            refused.append(f"{case.name}: {exc}")
    print(
        f"torch {torch.__version__}, {platform.machine()} CPU, {args.threads} thread(s), "
        "fp32, AdamW, no checkpointing"
    )
    print()
    print(render(rows))
    for line in refused:
        print(f"not run: {line}")


if __name__ == "__main__":
    main()
