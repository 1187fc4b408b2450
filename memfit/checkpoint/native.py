"""Gradient checkpointing a model does itself (Hugging Face's ``gradient_checkpointing_enable()``),
which memfit's plan replaces.

Left on while memfit profiles and plans, the model's layers would be checkpointed twice:
the profile would measure the model's own recompute as the units' costs, the plan would be
made for a step that does not run, and the step would recompute twice. So the planner
turns it off and says so in the plan's notes and a warning.

Example::

    model.gradient_checkpointing_enable()   # a Hugging Face model
    note = disable_native_checkpointing(model)  # off again; the note says where it was on
"""

from __future__ import annotations

import warnings

from torch import nn


def native_checkpointing(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` that checkpoint their layers
    themselves: those whose ``gradient_checkpointing`` attribute is True (what Hugging
    Face's ``gradient_checkpointing_enable()`` sets, and ``is_gradient_checkpointing``
    reads). ``""`` is the model itself.

    Example::

        native_checkpointing(gpt2)  # ["transformer"] after gpt2.gradient_checkpointing_enable()
    """
    return [
        name
        for name, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
    ]


def disable_native_checkpointing(model: nn.Module) -> str | None:
    """Turn the model's own gradient checkpointing off (Hugging Face's
    ``gradient_checkpointing_disable()`` where the model has it, and any module's
    ``gradient_checkpointing`` attribute still True set to False) and return a note saying so,
    also given as a warning; None when it was not on.

    Example::

        note = disable_native_checkpointing(model)
        if note:
            plan.notes.append(note)
    """
    names = native_checkpointing(model)
    if not names:
        return None
    for module in model.modules():
        # The outermost Hugging Face model turns off all of its own; newer versions name
        # the method activation_checkpointing_disable and deprecate the old name.
        disable = getattr(module, "activation_checkpointing_disable", None) or getattr(
            module, "gradient_checkpointing_disable", None
        )
        if callable(disable):
            disable()
            break
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False
    where = ", ".join(repr(n) if n else "the model" for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    note = (
        f"the model's own gradient checkpointing (on {where}{more}) was turned off: memfit's "
        "plan replaces it (left on, the layers would be recomputed twice and the plan made "
        "for a step that does not run)"
    )
    warnings.warn(note, stacklevel=4)  # the planner's caller, through prepare_for_plan
    return note


def disable_training_cache(model: nn.Module) -> str | None:
    """Set a Hugging Face model's ``config.use_cache`` to False while it trains, and return
    a note saying so (also a warning); None when there was nothing to change.

    A decoder called with its key/value cache on builds a cache object even in training and
    appends each layer's keys to it: a layer run again in backward appends again, so it
    cannot be recomputed (the rerun probe leaves it out). Training never reads the cache,
    and Hugging Face's own gradient checkpointing turns it off the same way. A model in
    eval mode, or one called with ``use_cache=True`` explicitly, is left as it is.

    Example::

        note = disable_training_cache(gpt2.train())   # config.use_cache is now False
    """
    config = getattr(model, "config", None)
    if not model.training or getattr(config, "use_cache", None) is not True:
        return None
    config.use_cache = False
    note = (
        "memfit set model.config.use_cache=False for training: a key/value cache makes a "
        "decoder layer do other work when recomputed, and training never reads it (as "
        "Hugging Face's own gradient checkpointing does; pass use_cache=True to generate())"
    )
    warnings.warn(note, stacklevel=4)  # the planner's caller, through prepare_for_plan
    return note


def prepare_for_plan(model: nn.Module) -> tuple[str, ...]:
    """What memfit's plan replaces or cannot recompute with, turned off: the model's own
    gradient checkpointing (:func:`disable_native_checkpointing`) and a training model's
    key/value cache (:func:`disable_training_cache`); the notes saying what was changed.

    Example::

        plan.notes.extend(prepare_for_plan(model))
    """
    notes = (disable_native_checkpointing(model), disable_training_cache(model))
    return tuple(n for n in notes if n)
