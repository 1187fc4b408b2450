"""The executor: apply a checkpoint plan to a model in place, and take it off again.

:func:`apply_plan` changes nothing a ``state_dict`` sees and wraps no module in a new
parent. Per unit it installs, on the module *instance*:

* ``"keep"``      nothing.
* ``"recompute"`` a ``forward`` that runs the original one under non-reentrant
  ``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout replays).
* ``"selective"`` the same, with ``create_selective_checkpoint_contexts`` and a policy that
  saves the outputs of matmul-like ops (:data:`MATMUL_OPS`) and recomputes the rest.
  Both run :func:`memfit.checkpoint.recompute.run_checkpointed`, the piece the profiler
  times too.
* segments ``{container: [(start, end), ...]}`` (inclusive) for a ``sequential`` unit:
  children ``start..end`` run as one checkpointed piece. An ``nn.Sequential`` with the
  stock ``forward`` gets a ``forward`` that walks its children in segments. Every
  container (an ``nn.ModuleList`` or ``nn.Sequential`` its parent walks with ``for block in
  self.blocks``) has its class swapped for a subclass of the same name whose ``__iter__``
  yields one callable per segment and the plain children elsewhere; indexing, ``len`` and
  ``state_dict`` are unchanged.

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
``early_stop=False`` re-runs each piece's whole forward (its tail included). A selective
piece always runs its whole forward again: stopped early, it would leave the matmul
outputs cached for its tail held until its backward ends.

``torch.compile``: a plan is applied to the model inside the compile wrapper (the same
names), before or after compiling; Dynamo traces the patched forwards, each piece becomes
a checkpointed region of the compiled graph, and the compiler's partitioner does the
recompute (:mod:`memfit.checkpoint.compiled`). Apply it before compiling blocks one by one.

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
import functools
import logging
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.compiled import check_not_compiled_inside, unwrap_compiled
from memfit.checkpoint.costs import DECISIONS, KEEP, RECOMPUTE, SELECTIVE, Decision
from memfit.checkpoint.native import prepare_for_plan
from memfit.checkpoint.recompute import (
    MATMUL_OPS,
    has_own_forward,
    run_checkpointed,
    stock_sequential,
)
from memfit.checkpoint.storage import CODINGS, apply_storage, remove_storage
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
    "suspended",
]

log = logging.getLogger(__name__)

_PATCH = "_memfit_patch"  # on each changed module: a _Patch
_APPLIED = "_memfit_applied"  # on the model: the plan applied to it


# --------------------------------------------------------------------------- patches


class _Patch:
    """What memfit changed on one module, and what to put back."""

    def __init__(self, name: str) -> None:
        self.name = name  # the module's qualified name in the model
        self.decision: Decision = KEEP
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
        return run_checkpointed(
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
    if patch.decision == KEEP or not torch.is_grad_enabled():
        return _base_forward(self, patch, *args, **kwargs)
    selective = patch.decision == SELECTIVE
    return run_checkpointed(
        functools.partial(_base_forward, self, patch),
        args,
        kwargs,
        [self],
        selective=selective,
        # A selective piece never stops early: a stop leaves the matmul outputs cached for
        # the ops after it in the cache until the unit's backward ends (a Llama layer held
        # its last projection's output, 32 KiB above the plan, through the rebuild). Its
        # cost is counted as its whole non-matmul forward anyway.
        early_stop=patch.early_stop and not selective,
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


def _within(unit: str, outer: str) -> bool:
    """Whether ``unit`` is ``outer`` or inside it (every unit is inside the root, ``""``)."""
    return unit == outer or not outer or unit.startswith(outer + ".")


def _stored(
    plan: Any, decisions: dict[str, str], segments: dict[str, list[tuple[int, int]]]
) -> dict[str, str]:
    """The plan's activation storage, checked: each stored unit is kept whole, outside
    every recomputed piece (a checkpoint's own hooks hold what a recomputed piece saves)."""
    storage = dict(getattr(plan, "storage", None) or {})
    recomputed = [n for n, d in decisions.items() if d != KEEP]
    for name, ranges in segments.items():
        recomputed += [
            f"{name}.{i}" if name else str(i) for a, b in ranges for i in range(a, b + 1)
        ]
    for unit, kind in storage.items():
        if kind not in CODINGS:
            raise PlanError(
                f"the plan stores unit {unit!r} as {kind!r}; activation storage is one of "
                f"{', '.join(map(repr, CODINGS))}"
            )
        for other in recomputed:
            if _within(unit, other) or _within(other, unit):
                raise PlanError(
                    f"the plan stores unit {unit!r} as {kind!r} and recomputes {other!r}: a "
                    "stored unit must be kept whole, outside every recomputed piece. Make the "
                    "plan again with memfit.plan(..., activation_storage=...)"
                )
    return storage


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
        if decision != KEEP and not has_own_forward(module):
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
    the previous. Take it off with :func:`remove_plan`. The model's own gradient
    checkpointing (Hugging Face's), when on, is turned off with a warning
    (:mod:`memfit.checkpoint.native`).

    Args:
        model: The model the plan was made for, or ``torch.compile(model)`` (the plan is
            applied to the model inside; see :mod:`memfit.checkpoint.compiled`).
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
        ConfigError: For a model whose submodules were compiled one by one.

    Example::

        apply_plan(model, {"blocks.0": "recompute", "blocks.1": "selective"})
        apply_plan(model, plan)   # replaces the previous plan
    """
    model = unwrap_compiled(model)
    check_not_compiled_inside(model)
    decisions, segments = _read_plan(plan)
    _check_structure(model, plan)
    _validate(model, decisions, segments)
    storage = _stored(plan, decisions, segments)  # checked before anything changes
    remove_plan(model)
    prepare_for_plan(model)  # no recompute twice over its own, no cache in a recomputed layer

    for name, ranges in segments.items():
        if not ranges:
            continue
        module = _lookup(model, name)
        patch = _patch_of(module, name)
        patch.segments = list(ranges)
        patch.early_stop = early_stop
        if stock_sequential(module):
            # Called, it walks its children in segments; iterated by its parent instead
            # (Hugging Face's ResNet stages: ``for layer in self.layers``), it yields them.
            patch.sequential_forward = True
            _patch_forward(module, patch)
        patch.orig_class = type(module)
        module.__class__ = iter_override_class(type(module), _segmented_iter)
    for name, decision in decisions.items():
        if decision == KEEP:
            continue
        module = _lookup(model, name)
        patch = _patch_of(module, name)
        patch.decision = decision
        patch.early_stop = early_stop
        _patch_forward(module, patch)

    if storage:
        apply_storage(model, storage)
    model.__dict__[_APPLIED] = (plan, early_stop)
    counts = {d: sum(v == d for v in decisions.values()) for d in (RECOMPUTE, SELECTIVE)}
    n_segments = sum(len(r) for r in segments.values())
    log.info(
        "checkpoint plan applied to %s: %d recomputed, %d selective, %d segments, %d stored",
        type(model).__name__,
        counts[RECOMPUTE],
        counts[SELECTIVE],
        n_segments,
        len(storage),
    )
    return model


def remove_plan(model: nn.Module) -> nn.Module:
    """Take an applied plan off ``model``, restoring every original ``forward`` and class.

    A no-op for a model without a plan. Returns ``model``.

    Example::

        remove_plan(model)
        assert not is_applied(model)
    """
    model = unwrap_compiled(model)
    remove_storage(model)
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
    model = unwrap_compiled(model)
    return _APPLIED in model.__dict__ or any(_PATCH in m.__dict__ for m in model.modules())


def applied_plan(model: nn.Module) -> Any:
    """The plan :func:`apply_plan` applied to ``model``, or None.

    Example::

        applied_plan(model) is plan  # True after apply_plan(model, plan)
    """
    applied = unwrap_compiled(model).__dict__.get(_APPLIED)
    return None if applied is None else applied[0]


@contextlib.contextmanager
def planned(model: nn.Module, plan: Any, *, early_stop: bool = True) -> Iterator[nn.Module]:
    """Apply ``plan`` inside a ``with`` block; afterwards the model is as it was before.

    Example::

        with planned(model, plan):
            loss_fn(model, batch).backward()
    """
    previous = unwrap_compiled(model).__dict__.get(_APPLIED)
    apply_plan(model, plan, early_stop=early_stop)
    try:
        yield model
    finally:
        remove_plan(model)
        if previous is not None:
            apply_plan(model, previous[0], early_stop=previous[1])


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[nn.Module]:
    """Take the plan applied to ``model`` off inside a ``with`` block, and put it back
    afterwards, also when the block raises. A no-op for a model without a plan.

    Example::

        apply_plan(model, plan)
        with suspended(model):
            loss_fn(model, batch).backward()   # runs as if no plan were applied
        assert applied_plan(model) is plan
    """
    applied = unwrap_compiled(model).__dict__.get(_APPLIED)
    remove_plan(model)
    try:
        yield model
    finally:
        if applied is not None:
            apply_plan(model, applied[0], early_stop=applied[1])
