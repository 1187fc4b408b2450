"""memfit's planner and monitoring in a Lightning ``Trainer``: :class:`MemfitCallback`.

At train start (the optimizers and the train dataloader exist by then) the callback takes
an example batch from ``trainer.train_dataloader``, plans activation checkpointing under
the budget for the loss ``training_step(batch, 0)`` returns (a tensor, or a dict with
``"loss"``), under the precision Lightning trains with (``Trainer(precision=...)``:
"32-true", "bf16-mixed", "16-mixed", ... mapped by memfit's precision aliases) and its
``accumulate_grad_batches``, and applies the plan to the LightningModule (or to the
submodule named by ``module=``). At Lightning's log steps it logs memfit's metrics with
``pl_module.log_dict``, so they reach ``trainer.logger`` and ``trainer.callback_metrics``.

Example::

    from memfit.integrations.lightning import MemfitCallback

    trainer = lightning.pytorch.Trainer(max_steps=100, precision="bf16-mixed",
                                        callbacks=[MemfitCallback(budget="200MiB")])
    trainer.fit(module, datamodule=data)
    trainer.callback_metrics["memfit/plan/predicted_peak_bytes"]
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from memfit.integrations.common import require

require(["lightning"], "memfit.integrations.lightning")

import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from torch import nn  # noqa: E402

from memfit.checkpoint.api import Costs  # noqa: E402
from memfit.checkpoint.planner import Budget  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.common import (  # noqa: E402
    CallbackCore,
    LossFn,
    loss_from,
)
from memfit.integrations.terms import LIGHTNING_TERMS  # noqa: E402
from memfit.monitor.health import HealthThresholds  # noqa: E402
from memfit.precision.policy import PrecisionPolicy, resolve_mode  # noqa: E402

__all__ = ["MemfitCallback", "lightning_precision", "training_step_loss"]

#: Lightning's "-true" 16-bit precisions: 16-bit weights and gradients, no fp32 master
#: copy, a training memfit does not offer. Lightning trains, memfit only plans: under the
#: master mode of the same dtype, which counts fp32 masters and fp32 gradients the run does
#: not have, so the plan over-predicts (by about 6 bytes a parameter), never under.
_PLANNED_AS: dict[str, str] = {"bf16-true": "bf16-master", "16-true": "fp16-master"}


def lightning_precision(precision: Any) -> str:
    """memfit's precision for Lightning's ``trainer.precision`` ("32-true", "bf16-mixed",
    "16-mixed"; also 32, 16), or the mode it plans "bf16-true" and "16-true" under (the
    ``*-master`` mode of the same dtype, which over-predicts). Other settings (64-bit,
    transformer-engine, bitsandbytes) raise a ConfigError.

    Example::

        lightning_precision("16-mixed")   # "fp16-mixed"
        lightning_precision("bf16-true")  # "bf16-master"
    """
    planned_as = _PLANNED_AS.get(str(precision).strip().lower())
    if planned_as is not None:
        return planned_as
    try:
        return resolve_mode(str(precision))
    except ConfigError as exc:
        raise ConfigError(
            f"MemfitCallback cannot plan under Lightning precision {precision!r}: {exc}"
        ) from exc


@contextlib.contextmanager
def _logging_ignored(module: nn.Module) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` ignored while planning runs training_step."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def training_step_loss(pl_module: nn.Module) -> LossFn:
    """A planner loss ``(model, batch) -> loss`` that runs ``pl_module.training_step(batch,
    0)``, with its logging calls ignored.

    Example::

        loss_fn = training_step_loss(module)
        loss_fn(module, batch).backward()
    """

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with _logging_ignored(pl_module):
            output = pl_module.training_step(batch, 0)
        return loss_from(output, f"{type(pl_module).__name__}.training_step(batch, 0)")

    return loss_fn


class MemfitCallback(CallbackCore, Callback):
    """Plans and applies activation checkpointing at train start; logs memfit's metrics.

    ``budget``: the peak of a whole training step ("200MiB", bytes, a fraction of device
    memory, or None for no limit). ``strategy``: "optimal" (default), "full", "sqrt",
    "uniform", "uniform:k" or "none". ``module``: the attribute path of the submodule to
    plan (default: the LightningModule itself; name one when training_step calls it
    directly, ``self.net(x)``, rather than ``self(x)``). ``loss_fn(model, batch)``:
    default :func:`training_step_loss`. ``example_batch``: one micro-batch to plan with,
    instead of the first batch of the train dataloader. ``measure_memory``: measure one
    planned forward and backward at train start. Each log step gets a handful of
    ``memfit/*`` keys (:data:`~memfit.integrations.common.DEFAULT_KEYS`); ``verbose=True``
    logs every metric and prints the plan's summary. ``costs``: what recompute is weighed
    by, ``"counted"`` FLOPs and bytes (default: the same plan in every run) or
    ``"measured"`` timings of the profiled step. ``plan_cache``: where plans are kept
    across runs (``"auto"``: ``plans/`` under ``$MEMFIT_CACHE`` or ``~/.cache/memfit``;
    None keeps none): the same training again reads its plan back instead of planning.
    ``optimizer_state``: ``"8bit"`` or ``"bf16"`` make the module's Adam/AdamW or SGD keep
    its state in fewer bits (:mod:`memfit.precision.optimizer_state`), before planning;
    ``"auto"``: 8 bits only when no plan fits the budget with fp32 state.

    Example::

        callback = MemfitCallback(budget="200MiB", strategy="sqrt")
        lightning.pytorch.Trainer(callbacks=[callback]).fit(module, loader)
        print(callback.plan.summary())
    """

    terms = LIGHTNING_TERMS

    def __init__(
        self,
        budget: Budget = None,
        strategy: str = "optimal",
        *,
        module: str | None = None,
        loss_fn: LossFn | None = None,
        example_batch: Any = None,
        measure_memory: bool = True,
        thresholds: HealthThresholds | None = None,
        verbose: bool = False,
        costs: Costs = "counted",
        plan_cache: str | os.PathLike[str] | None = "auto",
        optimizer_state: str = "fp32",
    ) -> None:
        super().__init__(
            budget,
            strategy,
            loss_fn=loss_fn,
            example_batch=example_batch,
            measure_memory=measure_memory,
            thresholds=thresholds,
            verbose=verbose,
            costs=costs,
            plan_cache=plan_cache,
            optimizer_state=optimizer_state,
        )
        self.module = module
        self._observed_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        model = pl_module
        if self.module is not None:
            try:
                model = pl_module.get_submodule(self.module)
            except AttributeError as exc:
                raise ConfigError(
                    f"MemfitCallback(module={self.module!r}): {type(pl_module).__name__} has "
                    "no such submodule; name one of its named_modules()"
                ) from exc
        batch = self.planning_batch(_first_loader(trainer.train_dataloader), pl_module.device)
        optimizers = trainer.optimizers
        self.start_run(
            model,
            batch,
            self.loss_fn or training_step_loss(pl_module),
            precision=PrecisionPolicy(
                lightning_precision(trainer.precision), autocast_cache=_autocast_caches(trainer)
            ),
            accumulation_steps=int(trainer.accumulate_grad_batches),
            optimizer=optimizers[0] if optimizers else None,
            scaler=getattr(trainer, "scaler", None),
            # Automatic optimization runs training_step, then zero_grad, then backward: the
            # last step's gradients are alive through the forward. A manual loop's order
            # is the user's; planned as zero_grad before the forward.
            zero_grad="before_backward" if _automatic(pl_module) else "before_forward",
        )
        self._observed_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.metrics is None:
            return
        if trainer.global_step == self._observed_step:
            return  # an accumulation micro-batch: no optimizer step was taken
        self._observed_step = trainer.global_step
        self.metrics.observe_step()
        if trainer.global_step % max(1, int(trainer.log_every_n_steps)) != 0:
            return
        loss = None
        if outputs is not None:
            # One host sync per log step, for the loss check of the health table.
            loss = float(loss_from(outputs, "training_step").detach().float().item())
        pl_module.log_dict(self.metrics.log_metrics(loss=loss), on_step=True, on_epoch=False)


def _autocast_caches(trainer: Any) -> bool:
    """Whether the autocast of ``trainer``'s precision plugin keeps its weight cache:
    Lightning 2.5 and later turn it off (``cache_enabled=False``), earlier ones keep
    torch's default (on)."""
    plugin = getattr(trainer, "precision_plugin", None)
    make = getattr(plugin, "autocast_context_manager", None)
    if make is None:  # no autocast: nothing cached either way
        return True
    cache = getattr(make(), "_cache_enabled", None)
    return True if cache is None else bool(cache)


def _automatic(pl_module: Any) -> bool:
    """Whether Lightning optimizes ``pl_module`` itself (``automatic_optimization``)."""
    return bool(getattr(pl_module, "automatic_optimization", True))


def _first_loader(loaders: Any) -> Any:
    """The first dataloader of what ``trainer.train_dataloader`` holds (one, or a
    collection of them)."""
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders
