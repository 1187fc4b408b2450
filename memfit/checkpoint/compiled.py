"""Checkpoint plans and ``torch.compile``: which module a plan is made for and applied to.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model as
``_orig_mod`` and traces it lazily, on its first call. memfit plans, profiles and patches
the module inside (:func:`unwrap_compiled`), so unit names are the model's own (no
``_orig_mod.`` prefix) and one plan serves the compiled model and the uncompiled one alike.
Dynamo then traces the patched forwards: every checkpointed piece becomes a
``tag_activation_checkpoint`` region whose recompute the compiler's partitioner performs
(:func:`memfit.checkpoint.recompute.run_checkpointed` takes that path while compiling).

The order is precision -> plan -> compile, as for any wrapper: a model whose *blocks*
were compiled one by one (``model.blocks[i] = torch.compile(block)``) cannot be profiled
(the profiler's hooks and dispatch modes would run inside compiled code) and its names
carry ``_orig_mod.``; :func:`check_not_compiled_inside` refuses it with a
:class:`~memfit.errors.ConfigError` that says to plan first and compile afterwards.

Example::

    memfit.apply_plan(model, plan)       # the plan's names: "blocks.0", ...
    compiled = torch.compile(model)      # traces the planned forwards on its first call
    memfit.apply_plan(compiled, plan)    # the same: applied to compiled._orig_mod
"""

from __future__ import annotations

import sys

from torch import nn

from memfit.errors import ConfigError

__all__ = ["check_not_compiled_inside", "is_compiled", "unwrap_compiled"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns.

    Example::

        is_compiled(torch.compile(model)), is_compiled(model)  # True, False
    """
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``model._orig_mod``, through any number of
    wrappers), or ``model`` itself when it is not compiled.

    Example::

        unwrap_compiled(torch.compile(model)) is model  # True
    """
    while is_compiled(model):
        model = model._orig_mod
    return model


def check_not_compiled_inside(model: nn.Module) -> None:
    """Refuse a model with compiled submodules (blocks compiled one by one).

    Raises:
        ConfigError: Naming the first compiled submodule and the order that works.

    Example::

        check_not_compiled_inside(unwrap_compiled(torch.compile(model)))  # passes
    """
    if "torch._dynamo" not in sys.modules:
        return
    for name, module in model.named_modules():
        if name and is_compiled(module):
            raise ConfigError(
                f"{name!r} of {type(model).__name__} is a compiled module "
                "(torch.compile of a submodule): memfit cannot profile or patch the "
                "model inside compiled code. Plan and apply the plan on the uncompiled "
                "model first, then compile its blocks (precision -> plan -> compile), or "
                "compile the whole model with torch.compile(model), which memfit looks "
                "through."
            )
