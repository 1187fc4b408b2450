"""The calls ``memfit.plan`` and ``plan_step`` took before ``plan(model, batch, loss_fn,
budget=..., ...)``: told apart from the new one here, translated by
:func:`memfit.checkpoint.api.plan`, each kept for one release with a DeprecationWarning.

* a ``loss_fn(output)`` (:func:`takes_output`), where the step's is ``loss_fn(model, batch)``;
* the settings by position, in ``memfit.plan``'s old order (:data:`PLAN_ORDER`) or
  ``plan_step``'s (:data:`PLAN_STEP_ORDER`), where they are now keywords
  (:func:`by_position`).

Example::

    takes_output(lambda out: out.loss)                       # True: the old form
    by_position(PLAN_ORDER, ("1GiB",), {}, {}, "memfit.plan()")  # {'budget': '1GiB'}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: ``memfit.plan(model, example_inputs, budget, strategy, loss_fn, precision, ...)``: the
#: settings in the order it took them by position.
PLAN_ORDER = tuple(
    "budget strategy loss_fn precision optimizer units accumulation_steps keep_output "
    "world_size data_parallel".split()
)
#: ``plan_step(model, batch, loss_fn, budget, strategy, precision, ...)``: the same.
PLAN_STEP_ORDER = tuple(
    "budget strategy precision optimizer frontier accumulation_steps units world_size "
    "data_parallel".split()
)


def takes_output(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` is written ``loss_fn(output)``: its signature has exactly one
    required positional parameter and no ``*args``. A callable whose signature cannot be
    read (a builtin such as ``torch.sum``) could only ever take an output: it counts too.

    Example::

        takes_output(lambda out: out.loss)               # True
        takes_output(lambda model, batch: model(batch))  # False
    """
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is p.empty]
    return len(required) == 1


def by_position(
    order: Sequence[str],
    values: Sequence[Any],
    settings: Mapping[str, Any],
    defaults: Mapping[str, Any],
    called: str,
) -> dict[str, Any]:
    """``settings`` (the keywords of the call, ``defaults`` where not given) with
    ``values``, given by position in the old ``order``, put in; a TypeError for more
    values than the order had or for a setting given both ways.

    Example::

        by_position(PLAN_STEP_ORDER, (None, "full"), {"precision": "fp32"}, {}, "plan_step()")
        # {'precision': 'fp32', 'budget': None, 'strategy': 'full'}
    """
    if len(values) > len(order):
        raise TypeError(
            f"{called} takes model, batch and loss_fn by position and its settings by "
            f"keyword; got {len(values)} settings by position, more than the old order "
            f"({', '.join(order)}) had"
        )
    named = dict(zip(order, values))
    for name in named:
        if name in settings and settings[name] is not defaults.get(name, inspect.Parameter.empty):
            raise TypeError(f"{called} got multiple values for argument {name!r}")
    return {**settings, **named}
