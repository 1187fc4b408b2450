"""The Engine's choices made on the first batch: ``precision="auto"`` and ``micro_batch="auto"``.

``precision="auto"``: the weights stay fp32, so the candidates are the autocast modes
(``fp32`` and ``bf16-mixed``, or ``fp16-mixed`` with dynamic loss scaling on a GPU without
bf16: :func:`memfit.precision.speed.auto_candidates`). On the first micro-batch, before
the first plan (which depends on the precision), the model's own forward and backward is
timed in each candidate (:mod:`memfit.precision.timing`, which leaves training
bitwise as it was) and the Engine trains in the fastest (a 16-bit mode only when clearly
faster). The matmul probe comes first: a 16-bit ratio far below 1 settles it on fp32
without timing. The probe alone decides under DDP/FSDP2 (rank 0's, for every rank),
where injected probe speeds are given without model seconds (tests), and after an
out-of-memory error while timing. From then on ``engine.settings.precision`` names the
mode chosen, and checkpoints save it: a resumed run trains in the same mode without
measuring again.

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

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfit.engine.batches import Batch, batch_size, checked_loss, split_batch
from memfit.errors import ConfigError
from memfit.precision.policy import AUTO, PrecisionPolicy, is_auto

if TYPE_CHECKING:
    from memfit.candidates import Candidate
    from memfit.engine.core import Engine
    from memfit.precision.speed import PrecisionChoice


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
    auto = is_auto(precision)
    policy = PrecisionPolicy("fp32") if auto else PrecisionPolicy.of(precision)
    return policy, AutoRequest(auto, micro_batch == AUTO, scaler is None)


def probe_choice(engine: Engine) -> PrecisionChoice:
    """The matmul probe's choice on the Engine's device (rank 0's under DDP/FSDP2)."""
    from memfit.precision.speed import choose_precision

    choice = choose_precision(engine.device)
    if engine.parallel is not None:  # every rank trains in rank 0's choice
        from memfit.distributed.collectives import from_rank0

        choice = from_rank0(choice)
    return choice


def timed_choice(
    engine: Engine, probe: PrecisionChoice, micro: Batch, loss_fn: Any
) -> PrecisionChoice:
    """The choice remade from the model's own forward and backward of ``micro`` in each
    candidate mode (:func:`memfit.precision.timing.auto_choice`); the probe's choice under
    data parallel (collectives in the passes would time the slowest rank, differently on
    each). Errors of ``loss_fn`` propagate."""
    from dataclasses import replace

    from memfit.precision.timing import auto_choice

    if engine.parallel is not None:
        return replace(probe, note="data parallel: rank 0's probe decides for every rank")
    ranges = engine.monitor.ranges
    with ranges.unrecorded() if ranges is not None else contextlib.nullcontext():
        return auto_choice(
            engine.model,
            micro,
            lambda model, b: checked_loss(loss_fn(model, b)),
            engine.device,
            engine.policy.fp32_islands,
        )


def set_precision(engine: Engine, choice: PrecisionChoice) -> None:
    """Train in ``choice.mode`` from now on: the policy, its islands and, for fp16, a
    dynamic loss scaler (when the Engine made its own)."""
    from memfit.precision.apply import apply_precision, note_kernel_islands
    from memfit.precision.scaler import LossScaler

    auto: AutoRequest = engine.auto
    policy = PrecisionPolicy(choice.mode, fp32_islands=engine.policy.fp32_islands)
    engine.policy = policy
    engine.settings.precision = policy.mode
    parallel = engine.parallel
    engine.islands = apply_precision(
        engine.model, parallel.precision(policy) if parallel else policy
    )
    engine.settings.kernel_islands = note_kernel_islands(engine.model, policy)
    if policy.loss_scaling and auto.default_scaler:
        engine.scaler = LossScaler()
        if parallel is not None:  # the new scaler's skips must be decided by every rank
            from memfit.distributed.collectives import all_reduce_max

            engine.scaler.register_found_inf_hook(all_reduce_max)
    auto.precision_choice = choice
    auto.precision = False


def resolve_first(engine: Engine, micro: Batch, loss_fn: Any) -> None:
    """Before the first plan (``prepare``, on the first micro-batch): an ``"auto"``
    precision chosen by timing the model on ``micro``; ConfigError when a
    ``micro_batch="auto"`` Engine is fed micro-batches that are split already."""
    if engine.auto.micro_batch:
        raise ConfigError(
            "micro_batch='auto' chooses how train_step(batch) splits its batches; "
            "micro-batches fed with backward() (or given to prepare()) are split already. "
            "Call train_step(batch) with the global batch, or drop micro_batch='auto'"
        )
    if engine.auto.precision:
        set_precision(engine, timed_choice(engine, probe_choice(engine), micro, loss_fn))


def resolve_micro_batch(engine: Engine, batch: Batch, loss_fn: Any) -> None:
    """Choose how ``train_step`` splits an ``micro_batch="auto"`` Engine's batches, from its
    first batch (the global batch). With ``precision="auto"`` too, the split the probe's
    mode would get gives the micro-batch the model is timed on; a mode the timing changes
    is then split anew. (Without ``micro_batch="auto"``, ``prepare`` chooses the precision
    on the first micro-batch.)"""
    auto: AutoRequest = engine.auto
    if not auto.micro_batch:
        return
    rows = batch_size(batch)
    if auto.precision:
        probe = probe_choice(engine)
        ranked = _ranked_splits(engine, batch, loss_fn, probe.mode)
        choice = probe
        if ranked and ranked[0].fits:
            micro = split_batch(batch, min(rows, ranked[0].accumulation_steps))[0]
            choice = timed_choice(engine, probe, micro, loss_fn)
        if choice.mode != probe.mode:
            ranked = _ranked_splits(engine, batch, loss_fn, choice.mode)
        set_precision(engine, choice)
    else:
        ranked = _ranked_splits(engine, batch, loss_fn, engine.policy.mode)
    best = ranked[0] if ranked and ranked[0].fits else None
    if engine.parallel is not None:
        # Each rank ranked with its own measured speed, and near ties may fall either way:
        # every rank splits as rank 0 chose (and all raise together when nothing fits).
        from memfit.distributed.collectives import from_rank0

        best = from_rank0(best)
    if best is None:
        from memfit.candidates import nothing_fits

        raise nothing_fits(ranked, engine.settings.memory_budget or _default_budget(engine))
    engine.settings.accumulation_steps = best.accumulation_steps
    auto.split_choice = best
    auto.micro_batch = False


def _default_budget(engine: Engine) -> int:
    from memfit.units import device_memory_bytes

    return int(0.9 * device_memory_bytes(engine.device))


def _ranked_splits(engine: Engine, batch: Batch, loss_fn: Any, mode: str) -> list[Candidate]:
    """Every split of ``batch`` under ``mode`` and the checkpoint request, best first."""
    from memfit.candidates import meta_clone, rank_candidates
    from memfit.estimate import STRATEGIES

    budget = engine.settings.memory_budget or _default_budget(engine)
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
        return split_batch(batch, rows // n)[0] if n < rows else batch

    return rank_candidates(
        lambda: meta_clone(model),
        micro,
        loss_fn,
        budget=budget,
        global_batch=rows,
        precisions=[mode],
        strategies=strategies,
        optimizer_fn=lambda params: type(optimizer)(params, **_plain_defaults(optimizer)),
        device=engine.device,
    )


def _plain_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's constructor defaults, without flags a meta copy cannot use."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    skip = ("fused", "foreach", "capturable", "differentiable")
    return {k: v for k, v in optimizer.defaults.items() if k in takes and k not in skip}
