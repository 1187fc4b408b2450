"""memfit's advice in a training framework's own settings.

memfit's messages name its own knobs (``precision='fp32'``, a smaller micro-batch with
more accumulation steps, a ``'*-master'`` precision). A callback's user sets none of
them: they set ``TrainingArguments(bf16=True, gradient_accumulation_steps=4)`` or
``Trainer(precision="bf16-mixed", accumulate_grad_batches=4)``. :class:`LoopTerms` says
each knob the framework's way, and :meth:`LoopTerms.say` puts it into memfit's messages.

Example::

    HF_TERMS.say("or use bf16-mixed")   # "or use TrainingArguments(bf16=True)"
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from memfit.monitor.sinks import is_rank_zero
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import SLOW_BELOW, matmul_speed


@dataclass(frozen=True)
class LoopTerms:
    """How one framework's settings say memfit's advice."""

    framework: str
    """The loop's name, as its users say it."""
    fp32: str
    """How to train in fp32."""
    bf16: str
    """How to train in bf16 mixed precision."""
    accumulation: str
    """How to set the micro-batches per optimizer step."""
    micro_batch: str
    """How to set the micro-batch size."""
    half_weights: str
    """How to train with 16-bit weights (and gradients)."""

    def say(self, text: str) -> str:
        """``text`` (a memfit remedy or error) with memfit's knobs said the loop's way.

        >>> LIGHTNING_TERMS.say("or use bf16-mixed")
        "or use Trainer(precision='bf16-mixed')"
        >>> HF_TERMS.say("use a smaller micro-batch (more accumulation steps)")
        'use a smaller per_device_train_batch_size with a larger gradient_accumulation_steps'
        """
        for memfit_words, loop_words in (
            (
                "a smaller micro-batch (more accumulation steps)",
                f"a smaller {self.micro_batch} with a larger {self.accumulation}",
            ),
            (
                "a '*-master' precision",
                f"16-bit weights ({self.half_weights}; memfit's own Engine keeps fp32 "
                "masters beside them with precision='bf16-master')",
            ),
            (
                "use a *-master mode so weights and gradients are 16-bit",
                f"{self.framework} keeps fp32 weights and gradients in mixed precision: "
                f"use 16-bit weights ({self.half_weights})",
            ),
            ("precision='fp32'", self.fp32),
            ("use bf16-mixed", f"use {self.bf16}"),
        ):
            text = text.replace(memfit_words, loop_words)
        return text

    def warn_if_slow(self, policy: PrecisionPolicy, device: torch.device) -> float | None:
        """Warn (once per call, rank zero) when the loop's 16-bit precision computes slower
        than fp32 on this CPU, with the loop's way to train in fp32; return the measured
        matmul speed relative to fp32 (None where nothing was measured: fp32, CUDA)."""
        if not policy.mixed or device.type != "cpu":
            return None
        dtype = policy.compute_dtype
        speedup = matmul_speed("cpu", (dtype,)).speedup(dtype)
        if speedup < SLOW_BELOW and is_rank_zero():
            name = "bf16" if dtype is torch.bfloat16 else "fp16"
            warnings.warn(
                f"{self.framework} trains in {policy.mode} on this CPU, where a {name} "
                f"matmul measured {speedup:.2f}x the speed of fp32's (no fast {name} "
                f"instructions): training runs slower than in fp32; use {self.fp32}",
                UserWarning,
                stacklevel=4,
            )
        return speedup


HF_TERMS = LoopTerms(
    framework="the Hugging Face Trainer",
    fp32="TrainingArguments without bf16=True or fp16=True",
    bf16="TrainingArguments(bf16=True)",
    accumulation="gradient_accumulation_steps",
    micro_batch="per_device_train_batch_size",
    half_weights="the model loaded in bf16: from_pretrained(..., dtype=torch.bfloat16)",
)

LIGHTNING_TERMS = LoopTerms(
    framework="Lightning",
    fp32="Trainer(precision='32-true')",
    bf16="Trainer(precision='bf16-mixed')",
    accumulation="Trainer(accumulate_grad_batches=...)",
    micro_batch="DataLoader batch_size",
    half_weights="Trainer(precision='bf16-true')",
)

ACCELERATE_TERMS = LoopTerms(
    framework="accelerate",
    fp32="Accelerator(mixed_precision='no')",
    bf16="Accelerator(mixed_precision='bf16')",
    accumulation="Accelerator(gradient_accumulation_steps=...)",
    micro_batch="DataLoader batch_size",
    half_weights="the model cast to bf16 before accelerator.prepare, model.to(torch.bfloat16), "
    "with Accelerator(mixed_precision='no')",
)
