"""The recompute primitives the executor (:mod:`memfit.checkpoint.apply`) and the profiler
(:mod:`memfit.checkpoint.profiler`) share, so that what the profiler times and counts is
what a plan runs.

* :data:`MATMUL_OPS`, :func:`saved_by_selective`, :func:`save_matmul_outputs` and
  :func:`selective_contexts`: the ops whose outputs selective recompute saves (those that
  draw no random numbers), the policy that saves them, and the ``context_fn`` that
  installs it.
* :func:`run_checkpointed`: one checkpointed piece, as plans run it (non-reentrant
  ``torch.utils.checkpoint``, RNG replayed, the forward's modes and buffers kept for the
  rebuild); while ``torch.compile`` traces it, a plain checkpointed region for the
  compiler instead (see :func:`_compiled_checkpoint`).
* :func:`has_own_forward` and :func:`stock_sequential`: which modules can be recomputed
  whole, and which containers memfit walks in segments itself.

Example::

    y = run_checkpointed(block, (x,), {}, [block], selective=False, early_stop=True)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memfit.errors import PlanError
from memfit.nested import tensors

__all__ = [
    "MATMUL_OPS",
    "has_own_forward",
    "run_checkpointed",
    "save_matmul_outputs",
    "saved_by_selective",
    "selective_contexts",
    "stock_sequential",
]

_MATMUL_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "cudnn_convolution",
    "convolution_overrideable",
    "mkldnn_convolution",
    "_slow_conv2d_forward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_rnn",
    "mkldnn_rnn_layer",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
)


def _packets(names: tuple[str, ...]) -> frozenset[Any]:
    found = []
    for name in names:
        try:
            found.append(getattr(torch.ops.aten, name))
        except (AttributeError, RuntimeError):  # an op this torch build does not have
            continue
    return frozenset(found)


#: Matmul-like aten ops (as ``OpOverloadPacket`` s): selective recompute saves their
#: outputs, and the profiler counts their outputs as what selective recompute keeps.
MATMUL_OPS: frozenset[Any] = _packets(_MATMUL_OP_NAMES)


def saved_by_selective(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether selective recompute saves this call's outputs: one of :data:`MATMUL_OPS`
    that draws no random numbers. An attention with dropout is recomputed instead: saved,
    it would not run in the rebuild, so it would not advance the generator, and every
    random op after it in the rebuild would draw other numbers than its forward did (on
    CUDA, a dropout's mask from another Philox offset: wrong gradients).

    Example::

        saved_by_selective(torch.ops.aten.mm.default, (a, b), {})   # True
    """
    if getattr(op, "overloadpacket", None) not in MATMUL_OPS:
        return False
    return not _dropout_p(op, args, kwargs)


def _dropout_p(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The ``dropout_p`` argument of a call (0 where the op has none)."""
    schema = getattr(op, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "dropout_p":
            if "dropout_p" in kwargs:
                return float(kwargs["dropout_p"])
            return float(args[i]) if i < len(args) else float(arg.default_value or 0.0)
    return 0.0


def save_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpoint's policy: save the outputs of :data:`MATMUL_OPS` (those that
    draw no random numbers: :func:`saved_by_selective`), recompute the rest."""
    if saved_by_selective(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """Selective checkpoint's ``context_fn`` with :func:`save_matmul_outputs`.

    A module-level function on purpose: under ``torch.compile`` Dynamo accepts a
    ``context_fn`` only when it is a plain function (or a ``functools.partial`` of one),
    not a closure.
    """
    return create_selective_checkpoint_contexts(save_matmul_outputs)


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a forward to recompute (an ``nn.ModuleList`` has none).

    Example::

        has_own_forward(nn.Linear(2, 2)), has_own_forward(nn.ModuleList())  # True, False
    """
    return "forward" in module.__dict__ or type(module).forward is not nn.Module.forward


def stock_sequential(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` running the stock ``forward``, which the
    executor replaces with a walk over its children in segments."""
    return type(module).forward is nn.Sequential.forward and "forward" not in module.__dict__


def _unique_modules(modules: list[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for top in modules:
        for m in top.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


class _RecomputeGuard:
    """Makes a recompute see the forward's modes and leave buffers as the forward left them."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = _unique_modules(modules)
        self.training: list[bool] = []
        self.versions: list[tuple[nn.Module, str, torch.Tensor, int]] = []
        self.mutated: list[tuple[nn.Module, str]] = []

    def forward_started(self) -> None:
        self.training = [m.training for m in self.modules]
        self.versions = [
            (m, name, buf, buf._version)
            for m in self.modules
            for name, buf in m._buffers.items()
            if buf is not None
        ]

    def forward_done(self) -> None:
        mutated = {
            (id(m), name): (m, name)
            for m, name, buf, version in self.versions
            if m._buffers.get(name) is not buf or buf._version != version
        }
        self.versions = []
        # BatchNorm's kernels update running_mean/var without bumping their version
        # counters, so normalization layers that track statistics are listed explicitly.
        for m in self.modules:
            if (
                isinstance(m, nn.modules.batchnorm._NormBase)
                and m.training
                and m.track_running_stats
            ):
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    if m._buffers.get(name) is not None:
                        mutated[(id(m), name)] = (m, name)
        self.mutated = list(mutated.values())

    def enter_recompute(self) -> None:
        self._saved = []
        for m, name in self.mutated:
            buf = m._buffers.get(name)
            if buf is not None:
                self._saved.append((m, name, buf, buf.detach().clone()))
        self._modes = [m.training for m in self.modules]
        # Set only what differs: Module.__setattr__ is slow, and in training every mode
        # usually matches already (a piece of a GPT block holds a dozen modules).
        for m, mode in zip(self.modules, self.training):
            if m.training != mode:
                m.training = mode

    def exit_recompute(self) -> None:
        with torch.no_grad():
            for m, name, buf, value in self._saved:
                m._buffers[name] = buf
                buf.copy_(value)
        for m, mode in zip(self.modules, self._modes):
            if m.training != mode:
                m.training = mode
        self._saved = []


#: What torch's selective checkpoint says in backward when a cached output was changed.
_SAC_MUTATED = "cached during selective activation checkpoint has been mutated"


class _RecomputeContext:
    """checkpoint's recompute context: the guard around torch's own (e.g. selective) one.

    The guard's buffer copies run outside selective checkpoint's dispatch mode, which
    would otherwise take them for ops of the recomputed region. A class, not a generator,
    because checkpoint enters the same object again on every recompute.
    """

    def __init__(self, guard: _RecomputeGuard, inner: Any, label: str) -> None:
        self.guard = guard
        self.inner = inner
        self.label = label

    def __enter__(self) -> _RecomputeContext:
        self.guard.enter_recompute()
        try:
            self.inner.__enter__()
        except BaseException:
            self.guard.exit_recompute()
            raise
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.guard.exit_recompute()
            error = exc[1]
            if isinstance(error, RuntimeError) and _SAC_MUTATED in str(error):
                raise PlanError(
                    f"{self.label} is checkpointed 'selective', but a matmul output it "
                    "caches was changed in place after forward made it (e.g. "
                    "ReLU(inplace=True) right after a Linear or a convolution), so the "
                    "rebuild cannot use it. Give this unit 'recompute' instead, or make "
                    "that op out of place; memfit.plan does not choose 'selective' there."
                ) from error


def run_checkpointed(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: list[nn.Module],
    *,
    selective: bool,
    early_stop: bool,
    label: str = "a checkpointed piece",
) -> Any:
    """Run ``fn(*args, **kwargs)`` as one piece under non-reentrant checkpoint, guarding
    ``modules``: the rebuild sees the forward's train/eval modes, and the buffers the
    forward updated are put back after it. ``selective`` saves the outputs of
    :data:`MATMUL_OPS` and recomputes the rest; ``early_stop`` is torch's. ``label`` names
    the piece in the error a selective rebuild can raise. While ``torch.compile`` traces
    it, the piece is a checkpointed region of the compiled graph instead
    (:func:`_compiled_checkpoint`).

    Example::

        y = run_checkpointed(torch.sin, (x,), {}, [], selective=False, early_stop=True)
    """
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(fn, args, kwargs, selective=selective)
    guard = _RecomputeGuard(modules)
    first = [True]
    n_args = len(args)

    def run(*flat: Any) -> Any:
        call_args = flat[:n_args]
        if first[0]:  # checkpoint calls fn once in forward; later calls recompute
            first[0] = False
            guard.forward_started()
            try:
                return fn(*call_args, **kwargs)
            finally:
                guard.forward_done()
        return fn(*call_args, **kwargs)

    def context_fn() -> tuple[Any, Any]:
        if selective:
            fwd, rec = create_selective_checkpoint_contexts(save_matmul_outputs)
        else:
            fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
        return fwd, _RecomputeContext(guard, rec, label)

    # checkpoint finds the devices whose RNG state it must save from its positional
    # arguments only; tensors passed by keyword are appended so dropout replays on them too.
    extra = tuple(tensors(kwargs))
    return checkpoint(
        run,
        *args,
        *extra,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=context_fn,
        early_stop=early_stop,
    )


def _compiled_checkpoint(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, selective: bool
) -> Any:
    """One checkpointed piece as Dynamo traces it: a ``tag_activation_checkpoint`` region
    whose recompute the compiler's partitioner decides.

    No guard and no closure in ``context_fn``: the forward and its rebuild are one traced
    graph, so train/eval modes are those it was traced with, buffer updates
    (BatchNorm's statistics) are functionalized and happen once, and random ops are
    replayed by the compiler (torch ignores ``preserve_rng_state`` and ``early_stop`` here).
    """

    def call(*flat: Any) -> Any:
        return fn(*flat, **kwargs)

    if selective:
        return checkpoint(call, *args, use_reentrant=False, context_fn=selective_contexts)
    return checkpoint(call, *args, use_reentrant=False)
