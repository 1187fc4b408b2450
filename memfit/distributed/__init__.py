"""Data-parallel training on ``torch.distributed``: DDP and FSDP2, with memfit's precision,
plans, skipped steps and saved state (docs/distributed.md).

:func:`parallelize` makes a model data-parallel in one order (fp32 islands, the checkpoint
plan, then DDP or FSDP2's ``fully_shard``); the Engine recognizes either wrapping, also one
the user made, and adds what a data-parallel step needs (:mod:`.collectives`); saved state
is rank 0's file or a sharded directory (:mod:`.state_files`).

Example::

    memfit.distributed.init_from_env()                    # under torchrun
    model = memfit.parallelize(model, data_parallel="fsdp", precision="bf16-mixed")
    optimizer = torch.optim.AdamW(model.parameters())
    engine = memfit.Engine(model, optimizer, precision="bf16-mixed")
    engine.train_step(memfit.distributed.shard_batch(global_batch), loss_fn)
"""

from memfit.distributed.collectives import any_rank, from_rank0
from memfit.distributed.parallel import (
    data_parallel_kind,
    gradient_sync,
    local_module,
    mixed_precision_policy,
    parallelize,
)
from memfit.distributed.world import (
    World,
    check_global_batch,
    current_world,
    init_from_env,
    shard_batch,
)

__all__ = [
    "World",
    "any_rank",
    "check_global_batch",
    "current_world",
    "data_parallel_kind",
    "from_rank0",
    "gradient_sync",
    "init_from_env",
    "local_module",
    "mixed_precision_policy",
    "parallelize",
    "shard_batch",
]
