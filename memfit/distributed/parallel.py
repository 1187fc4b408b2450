"""``parallelize``: a model made data-parallel in torchtitan's order, and what it became.

The order is fixed because each step needs the one before:

1. **fp32 islands** (:func:`~memfit.precision.apply.apply_precision`): normalization layers
   run in fp32; under FSDP2 in a ``*-master`` mode each island is its own ``fully_shard``
   group that keeps fp32 parameters, since the rest is gathered in 16 bits;
2. **the checkpoint plan** (:func:`~memfit.checkpoint.apply.apply_plan`), on the plain
   modules, so unit names carry no wrapper prefix and the recomputed forwards run inside
   FSDP2's gathered parameters;
3. **DDP** (``DistributedDataParallel``, returned) **or FSDP2** (``fully_shard`` on each
   block, then on the root; in place).

Under FSDP2 the precision becomes a ``MixedPrecisionPolicy``: gradients are always reduced in
fp32; the ``*-master`` modes gather 16-bit parameters (``param_dtype``) while the sharded
fp32 parameters are what the optimizer updates, so they are the master weights and cost no
extra memory; the ``*-mixed`` modes gather fp32 parameters and compute under autocast.

Example::

    model = memfit.parallelize(model, data_parallel="fsdp", precision="bf16-master")
    optimizer = torch.optim.AdamW(model.parameters())      # after it, as torch requires
    engine = memfit.Engine(model, optimizer, precision="bf16-master")
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.distributed.world import loaded_class
from memfit.errors import ConfigError, PlanError
from memfit.precision.apply import apply_precision
from memfit.precision.policy import PrecisionPolicy

log = logging.getLogger(__name__)

KINDS = ("ddp", "fsdp")


def data_parallel_kind(model: nn.Module) -> str | None:
    """``"ddp"`` for a ``DistributedDataParallel`` wrapper, ``"fsdp"`` for a model that
    ``fully_shard`` was applied to (the root), None otherwise.

    Example::

        data_parallel_kind(memfit.parallelize(model, data_parallel="ddp"))   # "ddp"
    """
    model = getattr(model, "_orig_mod", model)  # inside torch.compile's wrapper
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    fsdp_module = loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is not None and isinstance(model, fsdp_module):
        return "fsdp"
    return None


def local_module(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (the model itself otherwise): its parameter names are
    the plain model's.

    Example::

        local_module(ddp_model).state_dict()    # keys without "module."
    """
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def mixed_precision_policy(policy: PrecisionPolicy) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a memfit precision (module docstring).

    Example::

        mixed_precision_policy(PrecisionPolicy.of("bf16-master")).param_dtype  # bfloat16
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = policy.compute_dtype if policy.master_weights else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def islands_policy(policy: PrecisionPolicy) -> PrecisionPolicy:
    """The policy whose :func:`apply_precision` makes only the fp32 islands: under FSDP2 the
    16-bit working weights come from ``param_dtype``, not from casting the shards.

    Example::

        apply_precision(model, islands_policy(PrecisionPolicy.of("bf16-master")))
    """
    if not policy.master_weights:
        return policy
    mixed = policy.mode.replace("-master", "-mixed")
    return PrecisionPolicy(mixed, fp32_islands=policy.fp32_islands)


def check_policy(kind: str, policy: PrecisionPolicy) -> None:
    """ConfigError for a precision a data-parallel kind does not run."""
    if policy.rounded_weights:
        raise ConfigError(
            f"precision={policy.mode!r} (bf16 weights without masters) does not run "
            "data-parallel yet; use precision='bf16-master' with FSDP2 or 'bf16-mixed'"
        )
    if kind == "ddp" and policy.master_weights:
        raise ConfigError(
            f"precision={policy.mode!r} keeps fp32 master weights outside the model, which "
            "DDP's gradient all-reduce does not see; use data_parallel='fsdp' (its fp32 "
            f"shards are the masters) or precision={islands_policy(policy).mode!r} under DDP"
        )


def parallelize(
    model: nn.Module,
    *,
    data_parallel: str = "ddp",
    precision: str | PrecisionPolicy = "fp32",
    checkpoint: Any = None,
    mesh: Any = None,
    units: Sequence[str] | None = None,
    device_ids: Sequence[int] | None = None,
) -> nn.Module:
    """Make ``model`` data-parallel in the documented order; return the model to train.

    Args:
        model: the plain model, on its device. Build the optimizer afterwards, on the
            returned model's ``parameters()``: FSDP2 replaces the parameters with shards.
        data_parallel: ``"ddp"`` (returns a ``DistributedDataParallel`` wrapper) or
            ``"fsdp"`` (``fully_shard`` on each block, then the root; returns ``model``).
        precision: the Engine's precision; the fp32 islands are applied here, and under
            FSDP2 it sets the ``MixedPrecisionPolicy``.
        checkpoint: a :class:`~memfit.checkpoint.plan.Plan` (``memfit.plan(...)`` made
            for one rank's micro-batch and budget), applied before wrapping; None or
            ``"none"`` for no plan.
        mesh: a ``DeviceMesh`` for FSDP2 (default: all ranks of the default group).
        units: the blocks FSDP2 shards one by one (default: the outermost units
            :func:`memfit.checkpoint.find_units` finds).
        device_ids: DDP's ``device_ids`` (default: the model's CUDA device, none on CPU).

    Raises:
        ConfigError: an unknown kind; no initialized process group; an optimizer already
            made over the model's parameters; a precision the kind does not run.

    Example::

        dist.init_process_group("gloo")              # torchrun sets the environment
        model = memfit.parallelize(model, data_parallel="ddp", precision="bf16-mixed")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    """
    if data_parallel not in KINDS:
        raise ConfigError(f"data_parallel must be one of {KINDS}, got {data_parallel!r}")
    if data_parallel_kind(model) is not None:
        raise ConfigError(f"the model is already data-parallel ({data_parallel_kind(model)})")
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"data_parallel={data_parallel!r} needs an initialized process group: start the "
            "script with torchrun (torchrun --nproc-per-node 2 train.py) and call "
            "torch.distributed.init_process_group() (or memfit.distributed.init_from_env()) "
            "before parallelize"
        )
    policy = PrecisionPolicy.of(precision)
    check_policy(data_parallel, policy)
    _check_no_optimizer(model)
    planned = checkpoint is not None and not (isinstance(checkpoint, str) and checkpoint == "none")
    if planned:
        from memfit.checkpoint.plan import Plan

        # Checked before anything is applied: a refused call leaves the model as it was.
        if not isinstance(checkpoint, Plan):
            raise ConfigError(
                f"parallelize(checkpoint=...) takes a Plan, got {checkpoint!r}: make one for a "
                "rank's micro-batch with memfit.plan(model, batch, loss_fn, strategy=..., "
                "budget=...) before parallelize (or pass checkpoint= to the Engine)"
            )
    islands = apply_precision(model, islands_policy(policy))
    if planned:
        from memfit.checkpoint.apply import apply_plan

        apply_plan(model, checkpoint)
    if data_parallel == "ddp":
        if device_ids is None:
            device = next(iter(model.parameters())).device
            device_ids = [device.index] if device.type == "cuda" else None
        # gradient_as_bucket_view: the gradients live in DDP's buckets, not beside them.
        wrapped = DistributedDataParallel(
            model, device_ids=device_ids, gradient_as_bucket_view=True
        )
        log.info("parallelize: islands %s, DDP over %d ranks", islands, dist.get_world_size())
        return wrapped
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mixed_precision_policy(policy)
    if policy.master_weights:
        for name in islands:
            fully_shard(
                model.get_submodule(name),
                mesh=mesh,
                mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
            )
    blocks = list(units) if units is not None else outer_units(model)
    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    log.info("parallelize: islands %s, FSDP2 blocks %s and the root", islands, blocks)
    return model


def outer_units(model: nn.Module) -> list[str]:
    """The units :func:`memfit.checkpoint.find_units` finds that no other unit contains: the blocks
    (none for a model without repeated blocks).

    Example::

        outer_units(gpt)   # ['blocks.0', 'blocks.1', ...]
    """
    from memfit.checkpoint.tree import find_units, outermost_blocks

    try:
        found = find_units(model).names()
    except PlanError:  # no repeated blocks: the root is the one group
        return []
    return outermost_blocks(model, found)


def _check_no_optimizer(model: nn.Module) -> None:
    """ConfigError when an optimizer over ``model``'s parameters exists: FSDP2 replaces them
    and DDP's wrapper must be what trains, so the optimizer comes after ``parallelize``."""
    params = {id(p) for p in model.parameters()}
    for obj in gc.get_objects():
        # type(), not isinstance: some module objects warn when their __class__ is read.
        if issubclass(type(obj), torch.optim.Optimizer) and any(
            id(p) in params for g in obj.param_groups for p in g["params"]
        ):
            raise ConfigError(
                f"an optimizer ({type(obj).__name__}) was built over this model's parameters "
                "before parallelize; build the optimizer after it, on the returned model's "
                "parameters(), as torch requires (FSDP2 replaces them with shards)"
            )


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """A backward inside reduces gradients across ranks only when ``enabled``: DDP's
    ``no_sync`` or FSDP2's ``set_requires_gradient_sync``; nothing on one process.

    Example::

        with gradient_sync(model, enabled=is_last_micro_batch):
            loss.backward()
    """
    kind = data_parallel_kind(model)
    inner = getattr(model, "_orig_mod", model)
    if enabled or kind is None:
        yield
    elif kind == "ddp":
        with inner.no_sync():
            yield
    else:
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
