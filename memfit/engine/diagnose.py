"""What to tell the user when optimizer steps keep being skipped for non-finite values."""

from __future__ import annotations

import torch

from memfit.precision.policy import PrecisionPolicy


def diagnose_skips(
    skips: int,
    last_loss: torch.Tensor | None,
    named_params: list[tuple[str, torch.Tensor]],
    policy: PrecisionPolicy,
    scale: float,
) -> str:
    """Why ``skips`` steps in a row were skipped, and the remedy: the loss itself when it is
    not finite, else the first parameter (by name) whose gradient is not finite.

    Example::

        raise NonFiniteError(diagnose_skips(50, loss, named_params, policy, scaler.get_scale()))
    """
    head = f"{skips} optimizer steps in a row were skipped because of non-finite values"
    if last_loss is not None and not torch.isfinite(last_loss).all():
        return (
            f"{head}: the loss itself is {last_loss.item()} (the forward pass "
            "overflowed or the data holds inf/nan). Check the inputs, lower the learning "
            "rate, or use precision='bf16-mixed' (fp16's range ends at 65504)."
        )
    for name, param in named_params:
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):  # FSDP2: this rank's shard
            grad = grad.to_local()
        if grad is not None and not torch.isfinite(grad).all():
            remedy = (
                "lower the learning rate, set clip_grad_norm, or keep that module in fp32 "
                "(PrecisionPolicy(fp32_islands=...))"
            )
            if policy.loss_scaling:
                remedy = f"lower LossScaler(init_scale=...) (now {scale:g}), " + remedy
            return f"{head}: the first parameter with a non-finite gradient is {name!r}. Remedy: {remedy}."
    return f"{head}. Lower the learning rate or set clip_grad_norm."
