"""memfit's planner and monitoring in a Hugging Face ``Trainer``: :class:`MemfitCallback`.

At train begin the callback takes an example batch from the Trainer's train dataloader,
plans activation checkpointing under the budget for the loss the model computes itself
(``model(**batch).loss``), under the Trainer's precision (``bf16=True``: bf16-mixed,
``fp16=True``: fp16-mixed, else fp32) and its ``gradient_accumulation_steps``, and applies
the plan to the model. It turns off Hugging Face's own activation checkpointing and the
key/value cache (a plan and HF's checkpointing would recompute the same blocks twice; a
cache makes a decoder block do other work when run again), and says so. At every log
step it adds memfit's metrics to the ``logs`` dict and the Trainer's ``log_history``.

Example::

    from memfit.integrations.hf import MemfitCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MemfitCallback(budget="200MiB")])
    trainer.train()
    trainer.state.log_history[-2]["memfit/plan/predicted_peak_bytes"]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from memfit.integrations.common import require

require(["transformers", "accelerate"], "memfit.integrations.hf")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from memfit.checkpoint.api import Costs  # noqa: E402
from memfit.checkpoint.planner import Budget  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.common import (  # noqa: E402
    CallbackCore,
    LossFn,
    loss_from,
    say_once,
)
from memfit.integrations.terms import HF_TERMS  # noqa: E402
from memfit.monitor.health import HealthThresholds  # noqa: E402

__all__ = ["MemfitCallback", "model_loss", "trainer_precision"]


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model computes itself when the batch holds labels.

    Example::

        model_loss(model, {"input_ids": ids, "labels": ids})
    """
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    return loss_from(output, f"{type(model).__name__}(**batch)")


def trainer_precision(args: Any) -> str:
    """memfit's precision for a Trainer's ``TrainingArguments``.

    Example::

        trainer_precision(TrainingArguments(output_dir="x", bf16=True))   # "bf16-mixed"
    """
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "fp16-mixed"
    return "fp32"


class MemfitCallback(CallbackCore, TrainerCallback):
    """Plans and applies activation checkpointing at train begin; logs memfit's metrics.

    ``budget``: the peak of a whole training step ("200MiB", bytes, a fraction of device
    memory, or None for no limit). ``strategy``: "optimal" (default), "full", "sqrt",
    "uniform", "uniform:k" or "none". ``loss_fn(model, batch)``: default
    :func:`model_loss`. ``example_batch``: one micro-batch to plan with, instead of the
    first batch of the train dataloader. ``measure_memory``: measure one planned forward
    and backward at train begin (the ``memfit/memory/*`` metrics). Each log line gets a
    handful of ``memfit/*`` keys (:data:`~memfit.integrations.common.DEFAULT_KEYS`: budget,
    predicted and measured peak, recompute overhead, fp16 skips, health warnings);
    ``verbose=True`` logs every metric and prints the plan's summary (it is logged to the
    ``memfit.integrations`` logger either way). ``costs``: what recompute is weighed by,
    ``"counted"`` FLOPs and bytes (default: the same plan for the same model, batch and
    budget in every run) or ``"measured"`` timings of the profiled step. ``plan_cache``:
    where plans are kept across runs (:mod:`memfit.integrations.plan_cache`; ``"auto"``:
    ``plans/`` under ``$MEMFIT_CACHE`` or ``~/.cache/memfit``); the same training run
    again reads its plan back instead of planning. None keeps none. ``optimizer_state``:
    ``"8bit"`` or ``"bf16"`` make the Trainer's Adam/AdamW keep its moments in fewer bits
    (:mod:`memfit.precision.optimizer_state`; 2 or 4 bytes a parameter, not 8), before the
    plan is made, so a budget below what the Trainer's own options reach can fit;
    ``"auto"`` keeps them in 8 bits only when no plan fits the budget with fp32 state
    (planned each run: no plan is kept across runs).

    Example::

        callback = MemfitCallback(budget="200MiB", strategy="optimal")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        print(callback.plan.summary())
    """

    terms = HF_TERMS

    def __init__(
        self,
        budget: Budget = None,
        strategy: str = "optimal",
        *,
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
            loss_fn=loss_fn or model_loss,
            example_batch=example_batch,
            measure_memory=measure_memory,
            thresholds=thresholds,
            verbose=verbose,
            costs=costs,
            plan_cache=plan_cache,
            optimizer_state=optimizer_state,
        )

    def attach(self, trainer: Any) -> MemfitCallback:
        """Add this callback to ``trainer`` *first*, so that the reporting callbacks of
        ``report_to`` (TensorBoard, W&B, ...), which run before callbacks added later,
        see memfit's keys in ``logs`` too.

        Example::

            MemfitCallback(budget="200MiB").attach(trainer)
        """
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: nn.Module | None = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ConfigError("MemfitCallback got no model from the Trainer at train begin")
        _turn_off_hf_checkpointing(model, args)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        batch = self.planning_batch(train_dataloader, device)
        self.start_run(
            model,
            batch,
            self.loss_fn,
            precision=trainer_precision(args),
            accumulation_steps=int(args.gradient_accumulation_steps),
            # accelerate wraps the optimizer; the planner reads the optimizer's own class.
            optimizer=getattr(optimizer, "optimizer", optimizer),
            # accelerate's optimizer holds the fp16 GradScaler, when there is one.
            scaler=getattr(optimizer, "scaler", None),
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.metrics is not None:
            self.metrics.observe_step()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        if self.metrics is None or logs is None:
            return
        loss = logs.get("loss", logs.get("train_loss"))
        if loss is None:  # evaluation logs: the plan's metrics belong to training
            return
        extra = self.metrics.log_metrics(loss=loss)
        logs.update(extra)
        # The Trainer put a copy of these logs in its history before calling back.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(extra)


def _turn_off_hf_checkpointing(model: nn.Module, args: Any) -> None:
    """Hugging Face's own activation checkpointing off (memfit's plan replaces it), and the
    key/value cache off (a cached decoder block appends to the cache when run again, so
    the planner would leave every block out); each said once."""
    # Newer transformers name it "activation", older ones "gradient" checkpointing.
    name = "is_activation_checkpointing"
    if not hasattr(type(model), name):
        name = "is_gradient_checkpointing"
    on = bool(getattr(model, name, False))
    on = on or bool(getattr(args, "activation_checkpointing", False))
    on = on or bool(getattr(args, "gradient_checkpointing", False))
    if on:
        disable = getattr(model, "activation_checkpointing_disable", None)
        disable = disable or getattr(model, "gradient_checkpointing_disable", None)
        if disable is None:
            raise ConfigError(
                f"{type(model).__name__} has Hugging Face activation checkpointing on and no "
                "way to turn it off; set gradient_checkpointing=False in TrainingArguments "
                "to plan with memfit"
            )
        disable()
        say_once(
            "MemfitCallback turned off Hugging Face activation checkpointing "
            "(gradient_checkpointing=True): memfit's plan decides what is recomputed"
        )
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        say_once(
            "MemfitCallback set model.config.use_cache=False: a key/value cache makes a "
            "decoder block do other work when recomputed, and training does not read it"
        )
