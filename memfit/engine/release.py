"""Gradients released in backward: each parameter updated as soon as its gradient is made.

A usual step holds every parameter's gradient when the optimizer steps: for a large model
with AdamW that is 4 bytes a parameter on top of the weights and the state, and the
step's peak is often there. With ``Engine(..., release_gradients=True)`` each trained
tensor's update is applied from a hook that runs when its gradient has been accumulated
in backward, and the gradient is freed right after: at most one parameter's gradient is
held at a time beside the in-flight activation gradients (torchtune's
``optimizer_in_bwd`` and LOMO do the same; Lv et al., "Full Parameter Fine-tuning for
Large Language Models with Limited Resources", 2023).

The update is the user's own optimizer: its ``step()`` runs with only that tensor's
gradient present (torch's optimizers skip parameters without a gradient), so its param
groups, learning rates, scheduler and state are the ones a usual step uses, and with
``foreach=False`` the updates are bitwise those of a usual step (tested). In the
``*-master`` modes the hook runs after the fp32 master has taken the gradient, steps the
master and copies it into the 16-bit weight.

**Where it is not legal** (:func:`resolve_release`): gradient accumulation (an update needs
every micro-batch's gradient), clipping by the global norm (it needs every gradient
first), fp16's loss scaling (an overflow must skip the whole step), and data-parallel
runs (the hook would update before the gradients are reduced). ``release_gradients="auto"``
turns it on only where it is legal.

**Non-finite gradients.** A usual step is skipped whole when any gradient is non-finite.
Here earlier parameters are updated before a later gradient is made, so a non-finite
gradient leaves only its own parameter (and its state) unchanged; the step counts as
skipped in the loss scaler's statistics. Checking each gradient costs one host sync per
trained tensor (none on a CPU, where there is no device to wait for).

Example::

    engine = memfit.Engine(model, optimizer, precision="bf16-mixed", release_gradients=True)
    engine.train_step(batch, loss_fn)   # no moment holds every gradient
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.precision.master import MasterWeights
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import LossScaler
from memfit.precision.speed import auto_candidates

__all__ = ["GradientRelease", "release_choice", "resolve_release"]

_WHY = {
    "accumulation": "gradient accumulation (an update needs every micro-batch's gradient)",
    "clip": "clip_grad_norm (clipping by the global norm needs every gradient first)",
    "fp16": "fp16's loss scaling (an overflow must skip the whole step)",
    "parallel": "a data-parallel run (the update would come before the gradients are reduced)",
}


def _illegal(
    accumulation_steps: int, clip_grad_norm: float | None, loss_scaling: bool, parallel: bool
) -> list[str]:
    reasons = []
    if accumulation_steps > 1:
        reasons.append("accumulation")
    if clip_grad_norm is not None:
        reasons.append("clip")
    if loss_scaling:
        reasons.append("fp16")
    if parallel:
        reasons.append("parallel")
    return reasons


def resolve_release(
    release: Any,
    accumulation_steps: int,
    clip_grad_norm: float | None,
    loss_scaling: bool,
    parallel: bool,
) -> bool:
    """Whether gradients are released: False as given; True, or a ConfigError saying why
    and what to change where it is not legal; ``"auto"`` where legal. Any other value is a
    ConfigError. ``loss_scaling``: the precision scales the loss (fp16; for
    ``precision="auto"``, where one of the modes it may choose does).

    Example::

        resolve_release("auto", 4, None, False, False)   # False: accumulating
    """
    if release not in (True, False, "auto"):
        raise ConfigError(f"release_gradients must be True, False or 'auto', got {release!r}")
    reasons = _illegal(accumulation_steps, clip_grad_norm, loss_scaling, parallel)
    if release is True and reasons:
        raise ConfigError(
            "release_gradients=True applies each update as its gradient is made, which "
            f"{' and '.join(_WHY[r] for r in reasons)} does not allow; use "
            "release_gradients='auto' (on only where legal), or train with "
            "accumulation_steps=1, clip_grad_norm=None, a bf16 or fp32 precision and one process"
        )
    return release is True or (release == "auto" and not reasons)


class GradientRelease:
    """The hooks that update each trained tensor as its gradient is made (module doc).

    ``model``'s parameters that the optimizer updates (or whose fp32 ``master`` it
    updates) get a post-accumulate-grad hook, which acts inside :meth:`releasing` only;
    :meth:`begin` starts a step's bookkeeping, :meth:`found_inf` is the step's non-finite
    flag (a device tensor), :meth:`grad_norm` the norm of the gradients released in it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        master: MasterWeights | None,
    ) -> None:
        self.optimizer = optimizer
        masters = dict(zip(map(id, master.working), master.masters)) if master else {}
        updated = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._found_inf: torch.Tensor | None = None
        self._square_sum: torch.Tensor | None = None
        self._active = False
        self._handles = []
        for p in model.parameters():
            target = masters.get(id(p), p)
            if id(target) not in updated or not p.requires_grad:
                continue
            # Registered after MasterWeights' own hook (made first): it runs after the
            # master has taken the gradient.
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(p, target)))

    def begin(self, device: torch.device) -> None:
        """Start a step: no non-finite gradient seen yet, no norm summed."""
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._square_sum = torch.zeros((), dtype=torch.float32, device=device)

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """The hooks act inside this block (a training step's backward)."""
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def _hook(self, param: nn.Parameter, target: torch.Tensor) -> Any:
        optimizer = self.optimizer

        @torch.no_grad()
        def release(_: torch.Tensor) -> None:
            grad = target.grad
            if grad is None or not self._active:
                return
            assert self._found_inf is not None and self._square_sum is not None
            # The norm, not an elementwise check: no temporary of the gradient's size (a
            # non-finite element makes it non-finite; so would a finite overflow, 1e19+).
            values = grad.coalesce()._values() if grad.is_sparse else grad
            norm = torch.linalg.vector_norm(values, dtype=torch.float32)
            if not bool(torch.isfinite(norm)):  # the one host sync per tensor
                self._found_inf.fill_(1.0)
            else:
                self._square_sum += norm.square()
                optimizer.step()  # only this tensor holds a gradient now
                if target is not param:
                    param.data.copy_(target.data)
            target.grad = None
            param.grad = None

        return release

    def found_inf(self) -> torch.Tensor:
        """1.0 where a gradient of this step was non-finite (a device tensor, no sync)."""
        assert self._found_inf is not None
        return self._found_inf

    def grad_norm(self) -> torch.Tensor:
        """The total norm of the finite gradients released this step (no sync)."""
        assert self._square_sum is not None
        return self._square_sum.sqrt()

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def release_choice(
    release: Any,
    settings: Any,
    auto_precision: bool,
    auto_micro_batch: bool,
    policy: PrecisionPolicy,
    scaler: LossScaler,
    parallel: bool,
    device: torch.device,
) -> bool:
    """Whether the Engine releases gradients for ``release_gradients=release`` (a
    ConfigError where True is not legal), kept in ``settings.release_gradients``; decided
    before the Engine changes the model or the optimizer. With ``precision="auto"`` the
    loss is scaled where one of the modes it may choose scales it (fp16, on a GPU without
    bf16); a scaler given with a dynamic scale scales it too; ``micro_batch="auto"`` may
    choose to accumulate.

    Example::

        release_choice("auto", settings, False, False, PrecisionPolicy("fp32"), scaler,
                       False, torch.device("cpu"))
    """
    modes = auto_candidates(device) if auto_precision else (policy.mode,)
    scaling = scaler.dynamic or any(PrecisionPolicy(m).loss_scaling for m in modes)
    accumulation = 2 if auto_micro_batch else settings.accumulation_steps
    on = resolve_release(release, accumulation, settings.clip_grad_norm, scaling, parallel)
    settings.release_gradients = on
    return on
