"""What to tell the user when optimizer steps keep being skipped for non-finite values.

Nothing here takes the Engine: it is given the scaler, the model and its masters.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.errors import NonFiniteError
from memfit.precision.master import MasterWeights
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import FP16_MAX, LossScaler


def check_skips(
    scaler: LossScaler,
    max_consecutive_skips: int,
    last_loss: torch.Tensor | None,
    model: nn.Module,
    master: MasterWeights | None,
    policy: PrecisionPolicy,
) -> NonFiniteError | None:
    """The NonFiniteError to raise when ``max_consecutive_skips`` steps in a row were
    skipped (one sync: the scaler's counter), saying why (:func:`diagnose_skips`); None
    while training goes on.

    Example::

        error = check_skips(scaler, 50, loss, model, None, PrecisionPolicy("fp16-mixed"))
    """
    consecutive = scaler.consecutive_skips_tensor
    if consecutive is None:
        return None
    skips = int(consecutive.item())
    if skips < max_consecutive_skips:
        return None
    named = named_trained_params(model, master)
    return NonFiniteError(diagnose_skips(skips, last_loss, named, policy, scaler.get_scale()))


def named_trained_params(
    model: nn.Module, master: MasterWeights | None
) -> list[tuple[str, torch.Tensor]]:
    """Each model parameter by name, as its fp32 master where the mode keeps one: the
    tensors whose gradients the optimizer steps.

    Example::

        for name, param in named_trained_params(model, engine.master):
            print(name, param.grad is not None)
    """
    masters = dict(zip(master.names, master.masters)) if master else {}
    named = unwrap_compiled(model).named_parameters()
    return [(name, masters.get(name, p)) for name, p in named]


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
            f"rate, or use precision='bf16-mixed' (fp16's range ends at {FP16_MAX:g})."
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
