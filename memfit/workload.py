"""Your own model in one object: :class:`Workload` (how to build the model, make a
micro-batch, compute the loss), taken by ``memfit.tune`` and ``memfit.estimate`` in place of
their first three arguments, and returned by every ``memfit ... --factory MODULE:FUNCTION``.

It lives below the tuner and the estimator (they unpack it with :func:`unpack_workload`),
and imports no torch, so ``memfit.Workload`` stays as light as ``import memfit``.

Example::

    work = memfit.Workload(model_fn=lambda: MyNet(), batch_fn=lambda n: torch.randn(n, 8))
    memfit.estimate(work, batch_size=8)
    memfit.tune(work, budget="60MiB", global_batch=16)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.errors import ConfigError

__all__ = ["Workload", "unpack_workload"]


@dataclass(frozen=True)
class Workload:
    """How to build the model, make a micro-batch, and compute the loss: the first
    argument of ``memfit.tune`` and ``memfit.estimate`` (in place of ``model_fn, batch_fn,
    loss_fn``), and what a ``--factory MODULE:FUNCTION`` (or ``path/to/file.py:FUNCTION``)
    returns to every subcommand (``memfit train``, ``memfit plan``, ``memfit estimate``,
    ``memfit tune``). ``memfit train`` trains ``model_fn()`` on ``batch_fn(--batch-size)``,
    a new batch drawn for every step (``batch_fn`` should return fresh samples each call).
    A full example: ``examples/my_model.py``.

    Example::

        # mypkg/models.py; then: memfit plan --factory mypkg.models:workload --budget 1GiB
        import memfit, torch

        def workload() -> memfit.Workload:
            return memfit.Workload(
                model_fn=lambda: torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                                     torch.nn.Linear(64, 1)),
                batch_fn=lambda n: (torch.randn(n, 8), torch.randn(n, 1)),
                loss_fn=lambda model, batch: torch.nn.functional.mse_loss(
                    model(batch[0]), batch[1]),
            )

        # and in Python, the same object:
        res = memfit.tune(workload(), budget="60MiB", global_batch=16)
        est = memfit.estimate(workload(), batch_size=8)
    """

    model_fn: Callable[[], Any]
    """Builds the model, with no arguments and without moving it to a device: ``estimate``
    builds it on the meta device (no weights allocated), ``plan`` moves it to
    ``--device``, ``tune`` builds one per measured trial."""
    batch_fn: Callable[[int], Any]
    """``batch_fn(batch_size)``: one micro-batch (a tensor, a tuple or a dict of them) as
    the step takes it; ``plan`` moves its tensors to ``--device``."""
    loss_fn: Callable[[Any, Any], Any] | None = None
    """``loss_fn(model, batch) -> scalar``, the Engine's form; None: the sum of the first
    floating-point tensor of the model's output (``model(x)``, ``model(*x)``,
    ``model(**x)``)."""

    def __post_init__(self) -> None:
        nn = sys.modules.get("torch.nn")  # a built model is callable too; torch is loaded then
        if nn is not None and isinstance(self.model_fn, nn.Module):
            raise ConfigError(
                "Workload.model_fn must be a function that builds the model, got a built "
                f"{type(self.model_fn).__name__}; write model_fn=lambda: MyModel() (estimate "
                "builds it on the meta device, without allocating its weights)"
            )
        for name in ("model_fn", "batch_fn", "loss_fn"):
            value = getattr(self, name)
            if not (callable(value) or (name == "loss_fn" and value is None)):
                raise ConfigError(
                    f"Workload.{name} must be a function, got {type(value).__name__}; "
                    "write Workload(model_fn=lambda: Model(), batch_fn=lambda n: batch_of(n), "
                    "loss_fn=lambda model, batch: ...)"
                )


def unpack_workload(
    first: Workload | Callable[[], Any],
    batch_fn: Callable[[int], Any] | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    *,
    call: str,
    batch_name: str = "batch_fn",
) -> tuple[Callable[[], Any], Callable[[int], Any], Callable[[Any, Any], Any] | None]:
    """``(model_fn, batch_fn, loss_fn)`` of a call that takes either a :class:`Workload`
    or the three functions (``call`` names it in errors, ``batch_name`` its batch
    argument). A Workload beside a separate batch function or loss is a ConfigError that
    says which to drop: two of each would leave it unclear which one runs.

    Example::

        unpack_workload(work, None, None, call="memfit.tune")        # work's three
        unpack_workload(model_fn, batch_fn, None, call="memfit.tune")  # as given
        unpack_workload(work, batch_fn, None, call="memfit.tune")    # ConfigError
    """
    if isinstance(first, Workload):
        given = ((batch_name, batch_fn), ("loss_fn", loss_fn))
        extra = [name for name, value in given if value is not None]
        if extra:
            both = " and ".join(extra)
            raise ConfigError(
                f"{call}(workload, ...) takes the batch and the loss from the Workload, "
                f"and was also given {both}: drop {both}, or put it in the Workload "
                f"(dataclasses.replace(workload, {extra[0]}=...)), or pass model_fn, "
                f"{batch_name}, loss_fn without a Workload"
            )
        return first.model_fn, first.batch_fn, first.loss_fn
    if batch_fn is None:
        raise ConfigError(
            f"{call} needs a batch: write {call}(model_fn, {batch_name}, loss_fn, ...) or "
            f"{call}(memfit.Workload(model_fn, {batch_name}, loss_fn), ...)"
        )
    return first, batch_fn, loss_fn
