"""The trained model's weights for use outside memfit: a plain state dict, and a file of it.

In the ``*-master`` modes the model holds 16-bit working weights and the optimizer the fp32
masters; ``model.state_dict()`` gives the rounded 16-bit values. The state dict made here
puts the master's value in place of each mastered parameter, under the same keys as
``model.state_dict()`` (memfit's checkpoint plans and fp32 islands patch forwards in place
and rename nothing), so it loads with ``strict=True`` into a freshly built model.

Example::

    state = model_state_dict(engine.model, engine.master)   # fp32, masters included
    fresh.load_state_dict(state)                             # strict
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.distributed.parallel import local_module
from memfit.distributed.world import current_world, loaded_class
from memfit.precision.master import MasterWeights
from memfit.savefile import atomic_write


def model_state_dict(
    model: nn.Module,
    master: MasterWeights | None = None,
    dtype: torch.dtype | None = torch.float32,
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each mastered parameter's fp32 master value, as new
    tensors (detached, contiguous, sharing no storage with the model or the optimizer).

    ``dtype`` casts every floating-point tensor to it; ``None`` keeps each tensor's dtype
    (a master's is fp32). Integer and bool tensors keep theirs. A weight tied under two
    keys (an embedding and an output layer) appears under both, as two equal tensors. A
    frozen parameter (not in the optimizer) has no master: the ``*-master`` modes hold it in
    16 bits, and that rounded value is what it gives.

    Example::

        state = model_state_dict(model, engine.master, dtype=torch.float32)
        torch.save(state, "model.pt")
    """
    masters: dict[int, torch.Tensor] = {}
    if master is not None:
        masters = {id(w): m for w, m in zip(master.working, master.masters)}
    out: dict[str, torch.Tensor] = {}
    # keep_vars gives the Parameter objects themselves, so tied keys find their master too.
    # Under DDP the wrapped module's keys; under FSDP2 the full tensors (every rank calls).
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    for key, value in local_module(unwrap_compiled(model)).state_dict(keep_vars=True).items():
        tensor = masters.get(id(value), value).detach()
        if dtensor is not None and isinstance(tensor, dtensor):
            tensor = tensor.full_tensor()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        # clone() always copies, also when .to() returned the same tensor.
        out[key] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def export_model(
    model: nn.Module,
    master: MasterWeights | None,
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
) -> Path:
    """Write :func:`model_state_dict` to ``path`` atomically as a plain state dict, which
    ``torch.load(path, weights_only=True)`` reads back; return the path.

    Example::

        export_model(engine.model, engine.master, "run/model.pt")
        fresh.load_state_dict(torch.load("run/model.pt", weights_only=True))
    """
    state = {k: v.cpu() for k, v in model_state_dict(model, master, dtype).items()}
    if current_world().rank > 0:  # every rank gathers; rank 0 writes
        return Path(path)
    return atomic_write(state, path)
