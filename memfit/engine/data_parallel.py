"""What a data-parallel model (DDP or FSDP2, :mod:`memfit.distributed`) changes in the
Engine's step, in one object the Engine holds (None on one process):

* every micro-batch's backward but the step's last runs without the gradient reduction
  (``no_sync`` / ``set_requires_gradient_sync(False)``), so a step of ``accumulation_steps``
  micro-batches reduces once; a DDP step that ends early reduces at ``step()``;
* the scaler's found-inf flag is all-reduced with MAX, so every rank skips the same steps;
* the clipping norm is that of the whole model; the step's loss the mean over the ranks;
* under FSDP2 the ``*-master`` modes keep no masters of their own: the sharded fp32
  parameters are the ones the optimizer updates;
* a failure on one rank stops the others with an error that names it.

Example::

    parallel = EngineParallel.of(model, optimizer, policy, scaler)
    with parallel.sync(last=True):
        loss.backward()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.distributed.collectives import (
    all_reduce_max,
    average_gradients,
    mean_over_ranks,
    propagate_failure,
    total_norm,
)
from memfit.distributed.parallel import (
    check_policy,
    data_parallel_kind,
    gradient_sync,
    islands_policy,
)
from memfit.distributed.world import World, current_world
from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy


@dataclass
class EngineParallel:
    """The data-parallel side of one Engine (see the module docstring).

    Example::

        parallel = EngineParallel.of(ddp_model, optimizer, policy, scaler)
        parallel.kind   # "ddp"
    """

    kind: str
    model: nn.Module
    world: World
    synced: bool = field(default=True)
    """Whether the latest micro-batch's backward reduced the gradients."""

    @classmethod
    def of(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: PrecisionPolicy,
        scaler: Any,
        checkpoint: Any = None,
    ) -> EngineParallel | None:
        """The Engine's data-parallel side for ``model``; None when it is not DDP/FSDP2.

        ConfigError for a precision the kind does not run, for an optimizer built before
        FSDP2 sharded the parameters (it would update the old, unsharded ones), and for a
        ``checkpoint`` request: a data-parallel model is planned before it is wrapped.
        """
        kind = data_parallel_kind(model)
        if kind is None:
            return None
        check_policy(kind, policy)
        if checkpoint is not None and not (isinstance(checkpoint, str) and checkpoint == "none"):
            raise ConfigError(
                f"checkpoint={checkpoint!r} on a {kind.upper()} model: plan one rank's step on "
                "the plain model (memfit.plan(..., world_size=N, data_parallel=...)) and pass "
                "the Plan to memfit.parallelize(checkpoint=plan); give the Engine no checkpoint"
            )
        params = {id(p) for p in model.parameters()}
        if any(id(p) not in params for g in optimizer.param_groups for p in g["params"]):
            raise ConfigError(
                f"the optimizer updates tensors that are not the {kind.upper()} model's "
                "parameters: it was built before parallelize/fully_shard; build the "
                "optimizer after it, on model.parameters()"
            )
        scaler.register_found_inf_hook(all_reduce_max)
        return cls(kind, model, current_world())

    @property
    def owns_masters(self) -> bool:
        """Whether the parameters themselves are the fp32 masters (FSDP2's shards)."""
        return self.kind == "fsdp"

    def precision(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """The policy :func:`apply_precision` applies to the model: only the islands where
        the shards are the masters."""
        return islands_policy(policy) if self.owns_masters else policy

    def log_dir(self, log_dir: Any) -> Any:
        """Only rank 0 writes the metrics and the report (the others' are the same)."""
        return log_dir if self.world.rank == 0 else None

    def sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's backward: the reduction only on the ``last``."""
        self.synced = last
        return gradient_sync(self.model, last)

    def finish(self, params: list[torch.Tensor]) -> None:
        """Before the step: reduce the gradients of a step whose last backward did not."""
        if self.synced:
            return
        if self.kind == "fsdp":
            raise ConfigError(
                "under FSDP2 a step must feed accumulation_steps micro-batches (or use "
                "train_step, which knows its last one): the gradients of a step that ends "
                "early were not reduce-scattered; drop the last, short batch "
                "(DataLoader(drop_last=True))"
            )
        average_gradients(params)
        self.synced = True

    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole model's gradients (DTensor shards reduced)."""
        return total_norm(grads)

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as the mean over the ranks."""
        return mean_over_ranks(loss)

    def fail(self, exc: BaseException) -> None:
        """Raise DistributedError when another rank's failure caused ``exc``; else tell the
        other ranks that this one failed (the caller re-raises ``exc``)."""
        propagate_failure(exc)
