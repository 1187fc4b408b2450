"""The Engine's choices made on the first batch: ``precision="auto"`` and ``micro_batch="auto"``.

``precision="auto"``: the weights stay fp32, so the candidates are the autocast modes
(``fp32`` and ``bf16-mixed``, or ``fp16-mixed`` with dynamic loss scaling on a GPU without
bf16: :func:`memfit.precision.speed.auto_candidates`). On the first batch the matmul probe
measures each candidate's speed on the Engine's device (once per process) and the Engine
trains in the fastest (a 16-bit mode only when clearly faster). From then on
``engine.settings.precision`` names the mode chosen, and checkpoints save it: a resumed
run trains in the same mode without measuring again.

``micro_batch="auto"`` (with ``memory_budget``, or 90% of the device's memory): the first
``train_step``'s batch is the global batch; the tuner's search
(:func:`memfit.candidates.rank_candidates`, on a meta copy of the model and fake tensors)
picks how to split it (``accumulation_steps``) under the Engine's precision and checkpoint
request, and the batch is split so. ``engine.settings.accumulation_steps`` then holds the
choice and is saved with it.

Example::

    engine = memfit.Engine(model, opt, precision="auto", micro_batch="auto", memory_budget="4GiB")
    engine.train_step(batch, loss_fn)
    engine.settings.precision, engine.settings.accumulation_steps   # ("bf16-mixed", 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfit.engine.batches import Batch, batch_size
from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy

if TYPE_CHECKING:
    from memfit.candidates import Candidate
    from memfit.engine.core import Engine
    from memfit.precision.speed import PrecisionChoice

AUTO = "auto"


@dataclass
class AutoRequest:
    """What the Engine still has to choose on its first batch, and what it chose."""

    precision: bool = False
    micro_batch: bool = False
    default_scaler: bool = True
    """Whether the Engine made its own loss scaler (replaced by a dynamic one when the
    choice is ``fp16-mixed``)."""
    precision_choice: PrecisionChoice | None = None
    split_choice: Candidate | None = None

    @property
    def pending(self) -> bool:
        return self.precision or self.micro_batch


def auto_policy(
    precision: Any, micro_batch: Any, accumulation_steps: Any, scaler: Any
) -> tuple[PrecisionPolicy, AutoRequest]:
    """The policy the Engine starts with (fp32 until an ``"auto"`` precision is chosen)
    and what is left to choose; ConfigError for a ``micro_batch`` it cannot use.

    Example::

        policy, auto = auto_policy("auto", None, 1, None)   # fp32 for now, auto.precision
    """
    if micro_batch not in (None, AUTO):
        raise ConfigError(
            f"micro_batch takes 'auto' or None, got {micro_batch!r}; to fix the micro-batch "
            "give accumulation_steps (train_step splits each batch into that many)"
        )
    if micro_batch == AUTO and accumulation_steps != 1:
        raise ConfigError(
            f"micro_batch='auto' chooses accumulation_steps itself; drop "
            f"accumulation_steps={accumulation_steps!r} or micro_batch='auto'"
        )
    is_auto = isinstance(precision, str) and precision.strip().lower() == AUTO
    policy = PrecisionPolicy("fp32") if is_auto else PrecisionPolicy.of(precision)
    return policy, AutoRequest(is_auto, micro_batch == AUTO, scaler is None)


def resolve_precision(engine: Engine) -> None:
    """Choose the precision of an ``precision="auto"`` Engine (before its first plan)."""
    auto: AutoRequest = engine.auto
    if not auto.precision:
        return
    from memfit.precision.apply import apply_precision
    from memfit.precision.scaler import LossScaler
    from memfit.precision.speed import choose_precision

    choice = choose_precision(engine.device)
    if engine.parallel is not None:  # every rank trains in rank 0's choice
        from memfit.distributed.collectives import from_rank0

        choice = from_rank0(choice)
    policy = PrecisionPolicy(choice.mode, fp32_islands=engine.policy.fp32_islands)
    engine.policy = policy
    engine.settings.precision = policy.mode
    parallel = engine.parallel
    engine.islands = apply_precision(
        engine.model, parallel.precision(policy) if parallel else policy
    )
    if policy.loss_scaling and auto.default_scaler:
        engine.scaler = LossScaler()
        if parallel is not None:  # the new scaler's skips must be decided by every rank
            from memfit.distributed.collectives import all_reduce_max

            engine.scaler.register_found_inf_hook(all_reduce_max)
    auto.precision_choice = choice
    auto.precision = False


def resolve_first(engine: Engine) -> None:
    """Before the first plan (``prepare``): the precision chosen; ConfigError when a
    ``micro_batch="auto"`` Engine is fed micro-batches that are split already."""
    if engine.auto.micro_batch:
        raise ConfigError(
            "micro_batch='auto' chooses how train_step(batch) splits its batches; "
            "micro-batches fed with backward() (or given to prepare()) are split already. "
            "Call train_step(batch) with the global batch, or drop micro_batch='auto'"
        )
    resolve_precision(engine)


def resolve_micro_batch(engine: Engine, batch: Batch, loss_fn: Any) -> None:
    """Choose how ``train_step`` splits an ``micro_batch="auto"`` Engine's batches, from its
    first batch (the global batch); the precision is chosen first."""
    auto: AutoRequest = engine.auto
    resolve_precision(engine)
    if not auto.micro_batch:
        return
    from memfit.candidates import meta_clone, nothing_fits, rank_candidates
    from memfit.estimate import STRATEGIES
    from memfit.units import device_memory_bytes

    budget = engine.settings.memory_budget or int(0.9 * device_memory_bytes(engine.device))
    request = engine._checkpoint_request
    if isinstance(request, str) and request != AUTO:
        strategies: tuple[str, ...] = (request,)  # the strategy asked for, at each split
    elif isinstance(request, str):
        strategies = STRATEGIES
    else:
        raise ConfigError(
            "micro_batch='auto' plans the micro-batch, so a Plan made for one micro-batch "
            "cannot be given; pass checkpoint='auto' (or a strategy) instead"
        )
    model, optimizer = engine.model, engine.optimizer
    rows = batch_size(batch)

    def micro(n: int) -> Any:
        from memfit.engine.batches import split_batch

        return split_batch(batch, rows // n)[0] if n < rows else batch

    ranked = rank_candidates(
        lambda: meta_clone(model),
        micro,
        loss_fn,
        budget=budget,
        global_batch=rows,
        precisions=[engine.policy.mode],
        strategies=strategies,
        optimizer_fn=lambda params: type(optimizer)(params, **_plain_defaults(optimizer)),
        device=engine.device,
    )
    best = ranked[0] if ranked and ranked[0].fits else None
    if engine.parallel is not None:
        # Each rank ranked with its own measured speed, and near ties may fall either way:
        # every rank splits as rank 0 chose (and all raise together when nothing fits).
        from memfit.distributed.collectives import from_rank0

        best = from_rank0(best)
    if best is None:
        raise nothing_fits(ranked, budget)
    engine.settings.accumulation_steps = best.accumulation_steps
    auto.split_choice = best
    auto.micro_batch = False


def _plain_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's constructor defaults, without flags a meta copy cannot use."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    skip = ("fused", "foreach", "capturable", "differentiable")
    return {k: v for k, v in optimizer.defaults.items() if k in takes and k not in skip}
