"""The executor: apply a checkpoint plan to a model in place, and take it off again.

:func:`apply_plan` changes nothing a ``state_dict`` sees and wraps no module in a new
parent. Per unit it installs, on the module *instance*:

* ``"keep"``      nothing.
* ``"recompute"`` a ``forward`` that runs the original one under non-reentrant
  ``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout replays).
* ``"selective"`` the same, with ``create_selective_checkpoint_contexts`` and a policy that
  saves the outputs of matmul-like ops (:data:`MATMUL_OPS`) and recomputes the rest.
* segments ``{container: [(start, end), ...]}`` (inclusive) for a ``sequential`` unit:
  children ``start..end`` run as one checkpointed piece. An ``nn.Sequential`` with the
  stock ``forward`` gets a ``forward`` that walks its children in segments. Any other
  container (an ``nn.ModuleList`` its parent walks with ``for block in self.blocks``) has
  its class swapped for a subclass of the same name whose ``__iter__`` yields one callable
  per segment and the plain children elsewhere; indexing, ``len`` and ``state_dict`` are
  unchanged.

:func:`remove_plan` restores the original ``forward`` attributes and classes exactly.

Recompute runs under the forward's autocast state (non-reentrant checkpoint records it)
and in the forward's train/eval modes. Buffers a unit updates in forward (BatchNorm's
running statistics, or any buffer whose version counter moved) are put back after each
recompute, so they are updated once per forward, as without a plan; BatchNorm in training
mode normalizes with batch statistics, so its recomputed output is the forward's.

By default (``early_stop=True``, torch's default too) a recompute stops once every tensor
the piece saves is rebuilt: the trailing ops whose outputs backward does not need, often a
block's last projection and residual add, are not run again. The profiler measures that
tail per unit and the planner counts it, so a plan's recompute FLOPs are exactly what runs.
``early_stop=False`` re-runs each piece's whole forward (its tail included).

While segments are applied, iterating a swapped container yields segment callables, not
blocks; index it to reach a block. ``torch.save(model)`` (pickling the module object)
needs :func:`remove_plan` first; ``state_dict`` works either way, and so does
``copy.deepcopy``.

Example::

    apply_plan(model, plan)          # e.g. plan.decisions == {"blocks.0": "recompute", ...}
    loss_fn(model, batch).backward() # same gradients, less memory
    remove_plan(model)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memfit.checkpoint.tree import _lookup, iter_override_class, structure_fingerprint
from memfit.errors import PlanError

__all__ = [
    "DECISIONS",
    "MATMUL_OPS",
    "applied_plan",
    "apply_plan",
    "is_applied",
    "planned",
    "remove_plan",
]

log = logging.getLogger(__name__)

#: The decisions a plan may give a unit.
DECISIONS: tuple[str, ...] = ("keep", "recompute", "selective")

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

_PATCH = "_memfit_patch"  # on each changed module: a _Patch
_APPLIED = "_memfit_applied"  # on the model: the plan applied to it


def _save_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if getattr(op, "overloadpacket", None) in MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- recompute core


def _tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in ``obj``: nested mappings, lists, tuples and dataclasses."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


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


def _checkpoint(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: list[nn.Module],
    *,
    selective: bool,
    early_stop: bool,
    label: str = "a checkpointed piece",
) -> Any:
    """Run ``fn(*args, **kwargs)`` under non-reentrant checkpoint, guarding ``modules``."""
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
            fwd, rec = create_selective_checkpoint_contexts(_save_matmul_outputs)
        else:
            fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
        return fwd, _RecomputeContext(guard, rec, label)

    # checkpoint finds the devices whose RNG state it must save from its positional
    # arguments only; tensors passed by keyword are appended so dropout replays on them too.
    extra = tuple(_tensors(kwargs))
    return checkpoint(
        run,
        *args,
        *extra,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=context_fn,
        early_stop=early_stop,
    )


# --------------------------------------------------------------------------- patches


class _Patch:
    """What memfit changed on one module, and what to put back."""

    def __init__(self, name: str) -> None:
        self.name = name  # the module's qualified name in the model
        self.decision = "keep"
        self.segments: list[tuple[int, int]] = []
        self.early_stop = True
        self.forward_patched = False
        # An instance-level forward that was there before memfit (restored on removal).
        self.orig_forward: Any = None
        self.had_forward = False
        self.sequential_forward = False
        self.orig_class: type | None = None


class _SegmentCall:
    """Children ``start..end`` of a container, run as one checkpointed piece."""

    def __init__(self, modules: list[nn.Module], start: int, end: int, early_stop: bool) -> None:
        self.modules = modules
        self.start = start
        self.end = end
        self.early_stop = early_stop

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        x = self.modules[0](*args, **kwargs)
        for m in self.modules[1:]:
            x = m(x)
        return x

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        return _checkpoint(
            self._run, args, kwargs, self.modules, selective=False, early_stop=self.early_stop
        )

    def __repr__(self) -> str:
        return f"CheckpointSegment({self.start}..{self.end})"


def _segment_items(children: list[nn.Module], patch: _Patch) -> list[Any]:
    starts = dict(patch.segments)
    items: list[Any] = []
    i = 0
    while i < len(children):
        end = starts.get(i)
        if end is None:
            items.append(children[i])
            i += 1
        else:
            items.append(_SegmentCall(children[i : end + 1], i, end, patch.early_stop))
            i = end + 1
    return items


def _segmented_iter(self: nn.Module) -> Iterator[Any]:
    children = list(self._modules.values())
    patch = self.__dict__.get(_PATCH)
    # A slice of a swapped ModuleList is a fresh instance of the same class, without a patch.
    if patch is None or not patch.segments:
        return iter(children)
    return iter(_segment_items(children, patch))


def _base_forward(module: nn.Module, patch: _Patch, *args: Any, **kwargs: Any) -> Any:
    if patch.sequential_forward:
        (x,) = args
        for item in _segment_items(list(module._modules.values()), patch):
            x = item(x)
        return x
    if patch.had_forward:
        return patch.orig_forward(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _planned_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    patch: _Patch = self.__dict__[_PATCH]
    if patch.decision == "keep" or not torch.is_grad_enabled():
        return _base_forward(self, patch, *args, **kwargs)
    return _checkpoint(
        functools.partial(_base_forward, self, patch),
        args,
        kwargs,
        [self],
        selective=patch.decision == "selective",
        early_stop=patch.early_stop,
        label=f"unit {patch.name!r}",
    )


def _patch_of(module: nn.Module, name: str) -> _Patch:
    patch = module.__dict__.get(_PATCH)
    if patch is None:
        patch = _Patch(name)
        module.__dict__[_PATCH] = patch
    return patch


def _patch_forward(module: nn.Module, patch: _Patch) -> None:
    if not patch.forward_patched:
        patch.had_forward = "forward" in module.__dict__
        patch.orig_forward = module.__dict__.get("forward")
        # A bound method of a module-level function: copy.deepcopy rebinds it to the copy.
        module.__dict__["forward"] = types.MethodType(_planned_forward, module)
        patch.forward_patched = True


def _has_own_forward(module: nn.Module) -> bool:
    return "forward" in module.__dict__ or type(module).forward is not nn.Module.forward


# --------------------------------------------------------------------------- plan reading


def _read_plan(plan: Any) -> tuple[dict[str, str], dict[str, list[tuple[int, int]]]]:
    if isinstance(plan, Mapping):
        if "decisions" in plan:
            decisions, segments = plan["decisions"], plan.get("segments") or {}
        else:
            decisions, segments = plan, {}
    elif hasattr(plan, "decisions"):
        decisions, segments = plan.decisions, getattr(plan, "segments", None) or {}
    else:
        raise PlanError(
            f"cannot apply {type(plan).__name__}: expected a Plan (or any object with "
            "'decisions' and 'segments'), or a dict {unit name: decision}"
        )
    out_segments: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in dict(segments).items():
        parsed = []
        for r in ranges:
            try:
                start, end = (int(v) for v in r)
            except (TypeError, ValueError):
                raise PlanError(
                    f"segment {r!r} of {name!r} is not a (start, end) pair of ints"
                ) from None
            parsed.append((start, end))
        out_segments[str(name)] = sorted(parsed)
    return {str(k): str(v) for k, v in dict(decisions).items()}, out_segments


def _check_structure(model: nn.Module, plan: Any) -> None:
    structure = None if isinstance(plan, Mapping) else getattr(plan, "structure", None)
    if not structure:
        return
    expected = [(str(n), str(c)) for n, c in structure]
    actual = structure_fingerprint(model, [n for n, _ in expected])
    check = getattr(plan, "check_structure", None)
    if callable(check):
        if check(actual) is False:
            raise PlanError(
                f"this plan was made for another model than {type(model).__name__}; "
                "make a new plan for it"
            )
        return
    if expected != actual:
        want, have = dict(expected), dict(actual)
        diff = [
            f"{n or '<model>'}: plan {want.get(n, '<absent>')!r}, model {have.get(n, '<absent>')!r}"
            for n in list(want) + [n for n in have if n not in want]
            if want.get(n) != have.get(n)
        ]
        raise PlanError(
            f"this plan was made for another model than {type(model).__name__} "
            f"({'; '.join(diff[:4])}); make a new plan for this model"
        )


def _validate(
    model: nn.Module, decisions: dict[str, str], segments: dict[str, list[tuple[int, int]]]
) -> None:
    for name, decision in decisions.items():
        if decision not in DECISIONS:
            raise PlanError(
                f"unknown decision {decision!r} for unit {name!r}; use one of {DECISIONS}"
            )
        module = _lookup(model, name)
        if decision != "keep" and not _has_own_forward(module):
            raise PlanError(
                f"unit {name!r} ({type(module).__name__}) has no forward of its own, so it "
                "cannot be recomputed; checkpoint its children or give it segments"
            )
    for name, ranges in segments.items():
        module = _lookup(model, name)
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            raise PlanError(
                f"segments need an nn.ModuleList or nn.Sequential, but {name!r} is a "
                f"{type(module).__name__}"
            )
        n = len(module)
        last = -1
        for start, end in ranges:
            if not 0 <= start <= end < n:
                raise PlanError(
                    f"segment ({start}, {end}) of {name!r} is out of range: it has {n} children"
                )
            if start <= last:
                raise PlanError(f"segments of {name!r} overlap: {ranges}")
            last = end


# --------------------------------------------------------------------------- public API


def apply_plan(model: nn.Module, plan: Any, *, early_stop: bool = True) -> nn.Module:
    """Apply a checkpoint plan to ``model`` in place; returns ``model``.

    Idempotent: applying a plan again changes nothing, and applying another one replaces
    the previous. Take it off with :func:`remove_plan`.

    Args:
        model: The model the plan was made for.
        plan: A ``Plan`` or a solver ``Solution`` (anything with ``decisions`` ``{unit name:
            "keep" | "recompute" | "selective"}`` and ``segments`` ``{container name:
            [(start, end), ...]}``, ends inclusive), or a dict ``{unit name: decision}``.
            When the plan carries a ``structure`` fingerprint it must match the model.
        early_stop: Let torch stop each recompute once every saved tensor is rebuilt, as
            the plan counts (False re-runs each piece's trailing ops too). See the module
            docstring.

    Raises:
        PlanError: For a plan made for another model, an unknown unit name or decision, a
            recompute of a module without a forward, or bad segments.

    Example::

        apply_plan(model, {"blocks.0": "recompute", "blocks.1": "selective"})
        apply_plan(model, plan)   # replaces the previous plan
    """
    decisions, segments = _read_plan(plan)
    _check_structure(model, plan)
    _validate(model, decisions, segments)
    remove_plan(model)

    for name, ranges in segments.items():
        if not ranges:
            continue
        module = _lookup(model, name)
        patch = _patch_of(module, name)
        patch.segments = list(ranges)
        patch.early_stop = early_stop
        stock = type(module).forward is nn.Sequential.forward and "forward" not in module.__dict__
        if stock:
            patch.sequential_forward = True
            _patch_forward(module, patch)
        else:
            patch.orig_class = type(module)
            module.__class__ = iter_override_class(type(module), _segmented_iter)
    for name, decision in decisions.items():
        if decision == "keep":
            continue
        module = _lookup(model, name)
        patch = _patch_of(module, name)
        patch.decision = decision
        patch.early_stop = early_stop
        _patch_forward(module, patch)

    model.__dict__[_APPLIED] = (plan, early_stop)
    counts = {d: sum(v == d for v in decisions.values()) for d in ("recompute", "selective")}
    n_segments = sum(len(r) for r in segments.values())
    log.info(
        "checkpoint plan applied to %s: %d recomputed, %d selective, %d segments",
        type(model).__name__,
        counts["recompute"],
        counts["selective"],
        n_segments,
    )
    return model


def remove_plan(model: nn.Module) -> nn.Module:
    """Take an applied plan off ``model``, restoring every original ``forward`` and class.

    A no-op for a model without a plan. Returns ``model``.

    Example::

        remove_plan(model)
        assert not is_applied(model)
    """
    for module in model.modules():
        patch = module.__dict__.pop(_PATCH, None)
        if patch is None:
            continue
        if patch.forward_patched:
            if not patch.had_forward:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = patch.orig_forward
        if patch.orig_class is not None:
            module.__class__ = patch.orig_class
    model.__dict__.pop(_APPLIED, None)
    return model


def is_applied(model: nn.Module) -> bool:
    """Whether a checkpoint plan is applied to ``model`` (or to any module inside it).

    Example::

        apply_plan(model, plan); is_applied(model)  # True
    """
    return _APPLIED in model.__dict__ or any(_PATCH in m.__dict__ for m in model.modules())


def applied_plan(model: nn.Module) -> Any:
    """The plan :func:`apply_plan` applied to ``model``, or None.

    Example::

        applied_plan(model) is plan  # True after apply_plan(model, plan)
    """
    applied = model.__dict__.get(_APPLIED)
    return None if applied is None else applied[0]


@contextlib.contextmanager
def planned(model: nn.Module, plan: Any, *, early_stop: bool = True) -> Iterator[nn.Module]:
    """Apply ``plan`` inside a ``with`` block; afterwards the model is as it was before.

    Example::

        with planned(model, plan):
            loss_fn(model, batch).backward()
    """
    previous = model.__dict__.get(_APPLIED)
    apply_plan(model, plan, early_stop=early_stop)
    try:
        yield model
    finally:
        remove_plan(model)
        if previous is not None:
            apply_plan(model, previous[0], early_stop=previous[1])
