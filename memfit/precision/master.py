"""fp32 master weights for the ``*-master`` modes, with gradients accumulated in fp32.

The model keeps low-precision working weights (half the bytes, no casts in matmuls). The
optimizer is pointed at fp32 copies of them: small updates (lr * grad << weight) that would
round away in 16 bits still accumulate. Each low-precision gradient is added into the
master's fp32 ``.grad`` as soon as autograd finishes it and then freed, so k micro-batches
accumulate in fp32 exactly as one large batch would, and no 16-bit gradient outlives its
backward. After each optimizer step the masters are copied back into the working weights
with one foreach copy.

Example::

    master = MasterWeights(model, optimizer, torch.bfloat16)   # casts the model, swaps params
    ...backward()...                                            # grads land in fp32 masters
    optimizer.step(); master.copy_to_model()
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from memfit.errors import ConfigError


def holds_master_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` already updates memfit's fp32 master weights (it belongs to an
    Engine of a ``*-master`` mode): a second :class:`MasterWeights` cannot master them again.

    Example::

        holds_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))   # False
    """
    return any(
        getattr(p, "_memfit_master", False) for g in optimizer.param_groups for p in g["params"]
    )


class MasterWeights:
    """fp32 master copies of a model's trainable weights, owned by the optimizer.

    Parameters of modules for which ``keep_fp32(module)`` is true (the fp32 islands) stay
    fp32 in the model and are updated directly; every other floating-point parameter is cast
    to ``dtype``. The optimizer's param groups are edited in place: each working parameter is
    replaced by its master, and any optimizer state already present moves with it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dtype: torch.dtype,
        keep_fp32: Callable[[nn.Module], bool] = lambda m: False,
    ) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        self.working: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # Everything inside an island runs in fp32 (apply_precision casts the whole subtree),
        # so its parameters, however deep, are updated directly rather than mastered.
        fp32_params = {id(p) for m in model.modules() if keep_fp32(m) for p in m.parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if holds_master_weights(optimizer):
            raise ConfigError(
                "this optimizer already holds memfit master weights; build a new optimizer "
                "over model.parameters() for each Engine (to continue the Engine that has "
                "it from a saved state, call engine.load(path))"
            )
        foreign = [i for i in in_optimizer if i not in names]
        if foreign:
            raise ConfigError(
                f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the "
                "model; build it from model.parameters() so master weights can be made"
            )
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if id(param) in fp32_params or not param.is_floating_point():
                    continue
                master = nn.Parameter(param.detach().to(torch.float32, copy=True))
                master._memfit_master = True  # type: ignore[attr-defined]
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)
                group["params"][i] = master
                self.names.append(names[id(param)])
                self.working.append(param)
                self.masters.append(master)
                self._hooks.append(
                    param.register_post_accumulate_grad_hook(self._make_hook(master))
                )
        # Working weights outside the optimizer (frozen ones) are cast too: they are read in
        # every matmul and should not force fp32 copies.
        with torch.no_grad():
            for param in model.parameters():
                if id(param) in fp32_params or not param.is_floating_point():
                    continue
                if param.dtype != dtype:
                    param.data = param.data.to(dtype)
                    param.grad = None

    @staticmethod
    def _make_hook(master: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            param.grad = None

        return accumulate

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the fp32 masters into the working weights (one foreach copy, no sync)."""
        if self.working:
            torch._foreach_copy_([p.data for p in self.working], [m.data for m in self.masters])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name."""
        return {name: m.detach().clone() for name, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load master weights saved by :meth:`state_dict` and refresh the working weights."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ConfigError(
                f"master weights missing for {len(missing)} parameter(s), first {missing[0]!r}; "
                "the state was saved from a different model or precision"
            )
        for name, master in zip(self.names, self.masters):
            value = state[name]
            if value.shape != master.shape:
                raise ConfigError(
                    f"master weight {name!r} has shape {tuple(value.shape)} in the saved state "
                    f"but {tuple(master.shape)} in the model"
                )
            master.copy_(value)
        self.copy_to_model()

    def remove(self) -> None:
        """Stop accumulating into the masters (the optimizer keeps pointing at them)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
