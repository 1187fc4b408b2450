"""The Engine's precision, stage one of its order: what the policy needs besides the model.

When the Engine is made: its loss scaler (:func:`default_scaler`, when none is given),
the fp32 master weights of the ``*-master`` modes (:func:`fp32_masters`) and the check
that ``bf16-sr`` can train as asked (:func:`check_rounded_weights`); the Engine then
applies the policy's fp32 islands to the model (:func:`memfit.precision.apply.apply_precision`).
When ``precision="auto"`` chose a mode on the first batch (:mod:`memfit.engine.auto`):
the policy and scaler to train with from then on (:func:`switched_precision`).

Nothing here takes the Engine: it is given the model, the optimizer and the policy, and
returns what the Engine sets on itself.

Example::

    policy = PrecisionPolicy("bf16-master")
    scaler = default_scaler(policy)                              # static, scale 1
    master = fp32_masters(model, optimizer, policy, owned_elsewhere=False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.errors import ConfigError
from memfit.precision.master import MasterWeights
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import LossScaler

if TYPE_CHECKING:
    from memfit.precision.speed import PrecisionChoice


class PrecisionSwitch(NamedTuple):
    """What training in a chosen mode changes: the policy and, for fp16, the scaler."""

    policy: PrecisionPolicy
    scaler: LossScaler | None
    """A dynamic loss scaler to train with from now on, or None to keep the Engine's."""


def default_scaler(policy: PrecisionPolicy) -> LossScaler:
    """The loss scaler of an Engine given none: dynamic where the mode scales the loss
    (fp16), else a static one at scale 1 (the overflow checks and skips stay).

    Example::

        default_scaler(PrecisionPolicy("fp16-mixed")).dynamic   # True
    """
    if policy.loss_scaling:
        return LossScaler()
    return LossScaler(init_scale=1.0, dynamic=False)


def fp32_masters(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: PrecisionPolicy,
    owned_elsewhere: bool,
) -> MasterWeights | None:
    """The fp32 master weights the ``*-master`` modes update (the optimizer's param groups
    then hold them), or None: in the other modes, and where ``owned_elsewhere`` (FSDP2
    keeps its own).

    Example::

        master = fp32_masters(model, optimizer, PrecisionPolicy("bf16-master"), False)
    """
    if not policy.master_weights or owned_elsewhere:
        return None
    # Named as the uncompiled model names them (no ``_orig_mod.``): a state file's masters
    # then load into a compiled model and an uncompiled one alike.
    return MasterWeights(unwrap_compiled(model), optimizer, policy.compute_dtype, policy.is_island)


def check_rounded_weights(
    policy: PrecisionPolicy, accumulation_steps: int, auto_micro_batch: bool, parallel: bool
) -> None:
    """Raise ConfigError where ``bf16-sr`` (bf16 weights and gradients, no fp32 master)
    cannot train as asked: micro-batches would be summed in bf16, losing the fp32
    accumulation every other mode keeps; a data-parallel run is not supported yet.

    Example::

        check_rounded_weights(PrecisionPolicy("bf16-sr"), 1, False, False)   # no error
    """
    if not policy.rounded_weights:
        return
    if accumulation_steps > 1 or auto_micro_batch:
        what = (
            "micro_batch='auto' (which may accumulate)"
            if auto_micro_batch
            else f"accumulation_steps={accumulation_steps}"
        )
        raise ConfigError(
            f"precision='bf16-sr' keeps bf16 gradients, so {what} would sum micro-batches "
            "in bf16; use precision='bf16-master' (gradients accumulated in fp32) or one "
            "micro-batch a step"
        )
    if parallel:
        raise ConfigError(
            "precision='bf16-sr' does not run data-parallel yet; use precision='bf16-master' "
            "with DDP or FSDP2"
        )


def switched_precision(
    choice: PrecisionChoice, policy: PrecisionPolicy, default_scaler: bool, data_parallel: bool
) -> PrecisionSwitch:
    """Training in ``choice.mode`` instead of ``policy``'s: its policy (with the same fp32
    islands) and, for fp16, a dynamic loss scaler when the Engine made its own
    (``default_scaler``). The Engine applies the policy to the model.

    Example::

        switch = switched_precision(choice, PrecisionPolicy("fp32"), True, False)
        switch.policy.mode   # choice.mode
    """
    new = PrecisionPolicy(choice.mode, fp32_islands=policy.fp32_islands)
    scaler = None
    if new.loss_scaling and default_scaler:
        scaler = LossScaler()
        if data_parallel:  # the new scaler's skips must be decided by every rank
            from memfit.distributed.collectives import all_reduce_max

            scaler.register_found_inf_hook(all_reduce_max)
    return PrecisionSwitch(new, scaler)
