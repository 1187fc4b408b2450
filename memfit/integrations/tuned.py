"""A tuned choice (``memfit.tune``) in a training framework's own settings.

``memfit.tune`` chooses precision, checkpoint strategy, micro-batch and accumulation for a
budget; a Trainer or Lightning user sets those with the framework's own arguments.
:func:`tuned_loop` says the choice that way: the arguments, the micro-batch the loader
gives, and the ``MemfitCallback`` settings that plan the checkpoint part at train begin.
The frameworks train in fp32 or 16-bit mixed precision (no fp32 master copy beside
16-bit weights), so tune with ``precisions=LOOP_PRECISIONS``; a ``*-master`` choice is
refused with that remedy. The tuner's trials run memfit's own step, which frees the
gradients before the forward; Lightning holds the last step's through its forward (and
its autocast keeps no weight cache), so a choice at the very edge of the budget can be
refused there at train begin, with the loop's settings to change
(``MemfitCallback`` plans and measures in the loop's own order).

Example::

    res = memfit.tune(workload, budget="2GiB", global_batch=32, precisions=LOOP_PRECISIONS)
    loop = tuned_loop(res, "hf")
    args = TrainingArguments(output_dir="out", **loop.arguments)
    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[MemfitCallback(**loop.callback)])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memfit.errors import ConfigError

#: The precisions the frameworks train in, to tune among.
LOOP_PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed")

Framework = Literal["hf", "lightning"]

_PRECISION_ARGUMENTS: dict[str, dict[str, dict[str, Any]]] = {
    "hf": {"fp32": {}, "bf16-mixed": {"bf16": True}, "fp16-mixed": {"fp16": True}},
    "lightning": {
        "fp32": {"precision": "32-true"},
        "bf16-mixed": {"precision": "bf16-mixed"},
        "fp16-mixed": {"precision": "16-mixed"},
    },
}


@dataclass(frozen=True)
class TunedLoop:
    """A tuned choice as one framework takes it."""

    arguments: dict[str, Any]
    """Keyword arguments: ``TrainingArguments(**arguments)`` (precision, batch size and
    accumulation) or Lightning's ``Trainer(**arguments)`` (precision and accumulation)."""
    batch_size: int
    """The micro-batch: ``per_device_train_batch_size``, or the DataLoader's batch size."""
    callback: dict[str, Any] = field(default_factory=dict)
    """``MemfitCallback(**callback)``: the budget and strategy of the checkpoint part."""


def tuned_loop(result: Any, framework: Framework) -> TunedLoop:
    """``result.best`` (a ``memfit.tune`` result) in ``framework``'s settings (``"hf"``:
    the Hugging Face Trainer; ``"lightning"``).

    Raises ConfigError for a choice the framework cannot train (a ``*-master``
    precision; tuned for several ranks) or an unknown framework.

    Example::

        loop = tuned_loop(res, "lightning")
        trainer = lightning.pytorch.Trainer(**loop.arguments,
                                            callbacks=[MemfitCallback(**loop.callback)])
        loader = DataLoader(data, batch_size=loop.batch_size)
    """
    if framework not in _PRECISION_ARGUMENTS:
        raise ConfigError(f"framework must be 'hf' or 'lightning', got {framework!r}")
    best = result.best
    if getattr(result, "world_size", 1) > 1:
        raise ConfigError(
            "this choice was tuned for several ranks; tune for one process (world_size=1) "
            "to set a Trainer's per-device arguments"
        )
    precision = _PRECISION_ARGUMENTS[framework].get(best.precision)
    if precision is None:
        raise ConfigError(
            f"memfit.tune chose {best.precision!r}, which the {framework} loop cannot train "
            "(it keeps no fp32 master copy beside 16-bit weights): tune with "
            "precisions=memfit.integrations.tuned.LOOP_PRECISIONS"
        )
    budget = result.budget if best.checkpoint == "optimal" else None
    callback = {"strategy": best.checkpoint, "budget": budget}
    steps = int(best.accumulation_steps)
    if framework == "hf":
        arguments = {
            **precision,
            "per_device_train_batch_size": int(best.micro_batch),
            "gradient_accumulation_steps": steps,
        }
    else:
        arguments = {**precision, "accumulate_grad_batches": steps}
    return TunedLoop(arguments, int(best.micro_batch), callback)
