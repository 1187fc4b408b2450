"""Stage 1 of the planner: a training step profiled, cut down to the model's own units.

:func:`profile_step` profiles a step written ``loss_fn(model, batch)`` (the model and the
loss as one module, the model's units cut out of it); :func:`profile_model` a model called
on example inputs with ``loss_fn(output)``. Both then probe what the profile's own step
cannot tell: units that do other work when run again (:mod:`memfit.checkpoint.probe`) and
the kernels' workspace (:mod:`memfit.checkpoint.workspace`). The result is a
:class:`ModelProfile`, the input of the step memory and the solvers
(:mod:`memfit.checkpoint.planner`).

Example::

    profiled = profile_step(model, batch, loss_fn, PrecisionPolicy("bf16-mixed"))
    print(profiled.root.name, profiled.output_bytes)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.apply import suspended
from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.native import prepare_for_plan
from memfit.checkpoint.probe import probe_units
from memfit.checkpoint.profiler import Profile, profile
from memfit.checkpoint.profiler.runner import default_loss, grads_set_aside
from memfit.checkpoint.tree import find_units, structure_fingerprint
from memfit.checkpoint.workspace import StepEdges, step_workspace
from memfit.errors import PlanError
from memfit.nested import call_model
from memfit.precision.apply import precision_applied
from memfit.precision.policy import PrecisionPolicy

__all__ = ["ModelProfile", "profile_model", "profile_step"]


@dataclass(frozen=True)
class ModelProfile:
    """A profiled training step, cut down to the model's own units (stage 1)."""

    profile: Profile
    """The whole profiled step (for a step, the model and its loss as one module)."""
    root: UnitCost
    """The model's unit tree; names relative to the model (``""`` is the model)."""
    structure: list[tuple[str, str]]
    """``structure_fingerprint`` of the model's units, for the plan to recognize it."""
    output_bytes: float
    """Held from the end of forward until the loss's backward: the model's output (and,
    for a step, the loss module's)."""
    loss_saved_bytes: float
    """What the loss saves for backward outside the model."""
    output_held: bool = True
    """Whether the model's output is held through backward (``out = model(x)``), or freed
    once the loss is computed (a step written ``loss_fn(model, batch)``)."""
    workspace_bytes: float = 0.0
    """What kernels allocate for themselves at the peak of the units' part of the step,
    which no dispatch-level count sees (a CPU convolution's unfold buffers): the
    allocator's peak there less the storage tracker's (:func:`step_workspace`)."""
    edges: StepEdges | None = None
    """What the step holds while no unit runs, measured (:func:`step_workspace`)."""
    unstable: dict[str, str] = dataclasses.field(default_factory=dict)
    """Units left out of every plan because their forward does other work when run again
    (:mod:`memfit.checkpoint.probe`), each with the reason; plans say so in their notes."""
    run_loss: Callable[[], torch.Tensor] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    """Computes the profiled step's loss again (the example batch it holds): the planner
    measures a plan with it when the prediction cannot decide a budget
    (:mod:`memfit.checkpoint.measured_fit`)."""
    notes: tuple[str, ...] = ()
    """What profiling changed that plans must say (the model's own gradient checkpointing
    turned off: :mod:`memfit.checkpoint.native`)."""
    forward_end_unsaved_inputs: tuple[tuple[int, float], ...] = ()
    """Units' inputs that nothing saved, alive when the model's last unit ended its forward
    (:attr:`Profile.end_unsaved_inputs`): the loss's measured spike holds them."""
    counted: bool = False
    """The tree's times are counted from FLOPs and bytes
    (:func:`~memfit.checkpoint.costs.counted_times`), not measured: what the planner adds
    to them (a storage's coding time) is counted too."""


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    policy: PrecisionPolicy,
    units: Sequence[str] | None = None,
    keep_output: bool = True,
) -> ModelProfile:
    """Stage 1 for a model called on ``example_inputs``, with ``loss_fn(output)``;
    ``keep_output``: the training loop holds the output through backward."""
    model = unwrap_compiled(model)
    native = prepare_for_plan(model)
    with precision_applied(model, policy):
        prof = profile(model, example_inputs, loss_fn=loss_fn, precision=policy, units=units)
        profiled = ModelProfile(
            profile=prof,
            root=prof.root,
            structure=prof.structure,
            output_bytes=float(prof.output_bytes),
            loss_saved_bytes=float(prof.loss_saved_bytes),
            output_held=keep_output,
            notes=native,
            forward_end_unsaved_inputs=_last_end_unsaved(prof, ""),
        )
        loss_of = loss_fn or default_loss
        return _probed(
            model,
            profiled,
            policy,
            forward=lambda: call_model(model, example_inputs),
            loss=lambda: loss_of(call_model(model, example_inputs)),
            inputs=example_inputs,
        )


def _last_end_unsaved(prof: Profile, prefix: str) -> tuple[tuple[int, float], ...]:
    """:attr:`ModelProfile.forward_end_unsaved_inputs`: those of the unit inside the model
    (named ``prefix...``, the model itself left out) whose forward ended last."""
    inside = [
        ids for name, ids in prof.end_unsaved_inputs.items() if name and name.startswith(prefix)
    ]
    return inside[-1] if inside else ()


def _probed(
    model: nn.Module,
    profiled: ModelProfile,
    policy: PrecisionPolicy,
    forward: Callable[[], Any],
    loss: Callable[[], torch.Tensor],
    inputs: Any,
) -> ModelProfile:
    """``profiled`` with what the profile's own step cannot tell: the units that do other
    work when run again and each unit's forward workspace (:func:`_without_unstable`),
    and the kernels' workspace and the edges of a whole step (:func:`step_workspace`).
    Runs under the precision the profile ran under; the model's gradients are as they were
    after it, as after the profile's own step."""
    with grads_set_aside(model.parameters()):
        profiled = _without_unstable(model, profiled, forward, policy)
        units = [u.name for u in profiled.root.walk() if u.name]
        measured = step_workspace(model, loss, policy, inputs, units)
    return dataclasses.replace(
        profiled,
        workspace_bytes=float(measured.workspace_bytes),
        edges=measured.edges,
        run_loss=loss,
    )


def _without_unstable(
    model: nn.Module,
    profiled: ModelProfile,
    run_forward: Callable[[], Any],
    policy: PrecisionPolicy,
) -> ModelProfile:
    """``profiled`` with the units whose forward does other work when run again (state
    kept between calls, e.g. a key/value cache) marked as not recomputable, with the
    reason in ``profile.reasons``, and each other unit's forward and backward workspaces
    (what a kernel of its rebuild holds for itself; :mod:`memfit.checkpoint.probe`)."""
    names = [u.name for u in profiled.root.walk() if u.name and u.can_recompute]
    device = next((p.device.type for p in model.parameters()), "cpu")
    with suspended(model):
        probed = probe_units(
            model,
            run_forward,
            names,
            autocast=(device, policy.compute_dtype, policy.mixed),
            workspace=True,
        )
    found = probed.unstable
    for name, why in found.items():
        profiled.profile.reasons.setdefault(name, []).append(why)

    def mark(unit: UnitCost) -> UnitCost:
        children = [mark(c) for c in unit.children]
        stable = unit.can_recompute and unit.name not in found
        return dataclasses.replace(
            unit,
            children=children,
            can_recompute=stable,
            forward_workspace_bytes=float(probed.forward_workspace.get(unit.name, 0)),
            rebuild_forward_bytes=float(probed.rebuild_forward.get(unit.name, 0)),
            backward_workspace_bytes=float(probed.backward_workspace.get(unit.name, 0)),
        )

    return dataclasses.replace(profiled, root=mark(profiled.root), unstable=found)


class _StepModule(nn.Module):
    """The model and the engine's loss as one module, so a whole micro-step can be profiled."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss_fn(self.model, batch)


def _with_step_levels(root: UnitCost, step: UnitCost) -> UnitCost:
    """The model's ``root`` with the moments the whole ``step`` noted for parameters the
    model's own backward did not: those a loss updates outside the model's forward (a
    chunked loss runs the head and the embedding itself, whose gradients are accumulated
    under the step's ops), so the model's backward is charged their updates there."""
    levels = dict(root.release_levels)
    for name, level in step.release_levels.items():
        if name.startswith("model."):
            levels.setdefault(name.removeprefix("model."), level)
    return dataclasses.replace(root, release_levels=levels)


def _strip_prefix(unit: UnitCost, prefix: str) -> UnitCost:
    """``unit``'s tree named as in the model: its units and the parameters it notes."""
    name = unit.name[len(prefix) :] if unit.name.startswith(prefix) else ""
    children = [_strip_prefix(c, prefix) for c in unit.children]
    levels = {n.removeprefix(prefix): v for n, v in unit.release_levels.items()}
    return dataclasses.replace(unit, name=name, children=children, release_levels=levels)


def profile_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    policy: PrecisionPolicy,
    units: Sequence[str] | None = None,
) -> ModelProfile:
    """Stage 1 for a step written ``loss_fn(model, batch)``: the model and the loss are
    profiled as one module, then the model's units are cut out of it. ``units``: the
    candidate units (qualified names) instead of those ``find_units`` finds. A compiled
    model is profiled uncompiled: ``loss_fn`` is given the module inside
    ``torch.compile``'s wrapper."""
    model = unwrap_compiled(model)
    native = prepare_for_plan(model)
    if units is not None:
        names = ["", *dict.fromkeys(n for n in units if n)]  # the model is always one
    else:
        names = find_units(model).names()
    step_module = _StepModule(model, loss_fn)
    prefixed = ["model" if not n else f"model.{n}" for n in names]
    with precision_applied(model, policy):
        prof = profile(
            step_module,
            (batch,),
            loss_fn=lambda loss: loss,
            precision=policy,
            units=["", *prefixed],
        )
        model_root = next((c for c in prof.root.children if c.name == "model"), None)
        if model_root is None:
            raise PlanError("profiling did not see the model run; loss_fn must call the model")
        # Named as the model's own parameters, as the step's memory looks them up.
        prof.sparse_grad_bytes = {
            name.removeprefix("model."): n for name, n in prof.sparse_grad_bytes.items()
        }
        prof.grad_order = tuple(name.removeprefix("model.") for name in prof.grad_order)
        # The loss outside the model saves its own tensors (e.g. fp32 logits), and the
        # model's output lives until the loss's backward: neither can be recomputed.
        profiled = ModelProfile(
            profile=prof,
            root=_with_step_levels(_strip_prefix(model_root, "model."), prof.root),
            structure=structure_fingerprint(model, names),
            output_bytes=float(prof.output_bytes + model_root.output_bytes),
            loss_saved_bytes=float(prof.loss_saved_bytes + prof.root.own_saved_bytes),
            output_held=False,  # loss_fn returns the loss: the output it made is its own
            notes=native,
            forward_end_unsaved_inputs=_last_end_unsaved(prof, "model."),
        )

        def step() -> torch.Tensor:  # the probe runs its forward, the workspace all of it
            return loss_fn(model, batch)

        return _probed(model, profiled, policy, forward=step, loss=step, inputs=batch)
