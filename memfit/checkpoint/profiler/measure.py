"""The profiler's entry point: :func:`profile`, one instrumented step, then the timed ones,
turned into a :class:`~memfit.checkpoint.profiler.result.Profile`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.compiled import check_not_compiled_inside, unwrap_compiled
from memfit.checkpoint.profiler.build import build_costs, mark_shared_inputs, pool_times
from memfit.checkpoint.profiler.flops import DEFAULT_BANDWIDTH, DEFAULT_FLOP_RATE
from memfit.checkpoint.profiler.recorder import Recorder
from memfit.checkpoint.profiler.result import Profile
from memfit.checkpoint.profiler.retained import RetainedTracker
from memfit.checkpoint.profiler.rnn import lstm_workspaces
from memfit.checkpoint.profiler.runner import (
    collector_paused,
    default_loss,
    fake_run,
    is_fake,
    preserved,
    run_step,
)
from memfit.checkpoint.profiler.stats import Stats
from memfit.checkpoint.profiler.storage import storage_of
from memfit.checkpoint.profiler.timing import (
    Timing,
    piece_overhead,
    selective_overheads,
    time_steps,
)
from memfit.checkpoint.tree import UnitTree, find_units, structure_fingerprint, unit_tree
from memfit.errors import ConfigError
from memfit.nested import tensors
from memfit.precision.policy import PrecisionPolicy

__all__ = ["profile"]

log = logging.getLogger(__name__)


def _resolve_tree(
    model: nn.Module, units: UnitTree | Sequence[str] | None, extra: Sequence[str] | None
) -> UnitTree:
    if isinstance(units, UnitTree):
        return units
    if units is None:
        return find_units(model, extra)
    if isinstance(units, str):
        units = [units]
    return unit_tree(model, [*units, *(extra or [])])


def profile(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    precision: str | PrecisionPolicy | None = None,
    units: UnitTree | Sequence[str] | None = None,
    extra: Sequence[str] | None = None,
    train: bool | None = True,
    flop_rate: float = DEFAULT_FLOP_RATE,
    bandwidth: float = DEFAULT_BANDWIDTH,
    fake_device: str | None = None,
    timed_steps: int = 3,
) -> Profile:
    """Measure the per-unit costs of a training step of ``model`` on ``example_inputs``:
    one instrumented step, then ``timed_steps`` timed ones.

    Args:
        model: The model, as it will train (after ``precision.apply``; low-precision
            weights are fine). A plan applied to it is taken off for the step and put back.
        example_inputs: A tensor (``model(x)``), a tuple (``model(*args)``) or a dict
            (``model(**kwargs)``), of the batch size training will use.
        loss_fn: ``loss_fn(output) -> scalar``; default: the sum of the first floating-point
            tensor in the output.
        precision: The training precision (a mode string or policy; default fp32).
        units: The candidate units: None to find them (:func:`find_units`), a
            :class:`UnitTree`, or a list of qualified module names (exactly those units).
        extra: Module names to add to the found units.
        train: Put the model in train mode for the step (``None``: leave modes alone). The
            modes are restored afterwards either way.
        flop_rate, bandwidth: Device speed for time estimates on fake/meta tensors.
        fake_device: The device type fake tensors stand in for when the model is on the
            meta device (default: ``"cuda"`` when available, else ``"cpu"``).
        timed_steps: Steps timed after the instrumented one; each time is the median
            over them (default 3).

    Returns:
        A :class:`Profile`; ``profile.root`` is the planner's input.

    Raises:
        PlanError: When no units are found (the message says how to name them), for an
            unknown unit name, or when the loss cannot backpropagate.
        ConfigError: For a model whose submodules were compiled one by one (a model
            ``torch.compile`` wrapped whole is profiled uncompiled, inside the wrapper).

    Example::

        prof = profile(model, batch[:, :-1], precision="bf16-mixed")
        prof["blocks.0"].fwd_flops, prof.activation_bytes
    """
    if isinstance(timed_steps, bool) or not isinstance(timed_steps, int) or timed_steps < 1:
        raise ConfigError(f"timed_steps must be a whole number >= 1, got {timed_steps!r}")
    model = unwrap_compiled(model)  # profiled eagerly: hooks and dispatch modes see every op
    check_not_compiled_inside(model)
    policy = PrecisionPolicy.of(precision)
    tree = _resolve_tree(model, units, extra)
    loss_fn = loss_fn or default_loss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    first = next(iter([*model.parameters(), *tensors(example_inputs)]), None)
    rng_devices = (
        [first.device.index or 0]
        if first is not None and first.device.type == "cuda" and not is_fake(first)
        else []
    )
    stats = {u.name: Stats() for u in tree}
    with preserved(model, train, rng_devices):
        with fake_run(model, example_inputs, fake_device) as (inputs, fake_mode, device):
            measured = fake_mode is None
            settings: dict[str, Any] = dict(
                measured=measured,
                sync=measured and device.type == "cuda",
                flop_rate=flop_rate,
                bandwidth=bandwidth,
            )
            rec = Recorder(tree, stats, full=True, **settings)
            rec.resident = {
                storage_of(t)[0] for t in [*model.parameters(), *model.buffers(), *tensors(inputs)]
            }
            if measured:  # fake tensors hold no memory to be retained
                rec.retained = RetainedTracker(rec.resident)
            # On fake tensors an LSTM's CPU kernel saves nothing it really keeps: put its
            # measured workspace back (a real step saves it itself).
            workspaces = lstm_workspaces(model, device.type) if not measured else nullcontext()
            with collector_paused(not measured), workspaces:
                output, bwd_seconds = run_step(
                    model, inputs, loss_fn, policy, device.type, rec, tree
                )
            grad_bytes = _unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            sparse_grads = {
                name: storage_of(p.grad)[1]
                for name, p in model.named_parameters()
                if p.grad is not None and p.grad.layout != torch.strided
            }
            input_bytes = _unique_bytes(tensors(inputs))
            output_bytes = rec.nonresident_bytes(tensors(output))
            loss_saved = rec.loss_saved
            head_backward = rec.head_peak
            retained = dict(rec.retained_bytes)
            end_unsaved = dict(rec.end_unsaved_inputs)
            grad_order = tuple(rec.grad_order)
            iterated = {name: bool(marks) for name, marks in rec.iterated.items()}
            chains = rec.chains
            saved_owner = dict(rec.saved_owner)
            saved_by = dict(rec.saved_by)
            del output, rec  # frees the step's saved references before the timed step
            if measured:
                # The instrumented step above doubles as warm-up; these are only timed.
                timing = Timing(model, inputs, loss_fn, policy, device.type, tree, settings)
                bwd_seconds = time_steps(timed_steps, timing, stats)
                if any(st.matmul_output_bytes_own > 0 for st in stats.values()):
                    try:
                        selective_overheads(timed_steps, timing, stats)
                    except Exception as exc:  # the option is lost, not the profile
                        why = f"selective recompute could not be timed: {type(exc).__name__}: {exc}"
                        log.warning("%s; plans will not use it", why)
                        for st in stats.values():
                            st.not_selective_reason = st.not_selective_reason or why
                piece_seconds = piece_overhead(policy, device, settings["sync"])
            else:
                piece_seconds = 0.0
    # The timed steps timed each unit's tail unless they synchronize the device (CUDA),
    # where that would take a sync per saved tensor: the tail's time is then its ops' share.
    timed_tails = measured and not settings["sync"]
    root = build_costs(tree.root, stats, chains, iterated, measured, timed_tails)
    if measured:
        pool_times(tree.root, root)
    for unit in root.walk():
        # A module called several times in a step is checkpointed on every call.
        unit.piece_seconds = piece_seconds * max(1, stats[unit.name].call_count)
    mark_shared_inputs(tree.root, root, stats, saved_owner, saved_by)
    return Profile(
        root=root,
        structure=structure_fingerprint(model, tree),
        precision=policy.mode,
        device=str(device),
        measured=measured,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        buffer_bytes=buffer_bytes,
        activation_bytes=int(root.total_saved_bytes()),
        loss_saved_bytes=loss_saved,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        fwd_flops=root.fwd_flops,
        fwd_seconds=root.fwd_seconds,
        bwd_seconds=bwd_seconds if measured else root.bwd_seconds,
        flop_rate=flop_rate,
        bandwidth=bandwidth,
        reasons={
            n: list(st.not_recomputable_reasons)
            for n, st in stats.items()
            if st.not_recomputable_reasons
        },
        no_selective={
            n: st.not_selective_reason for n, st in stats.items() if st.not_selective_reason
        },
        piece_seconds=piece_seconds,
        head_backward_bytes=head_backward,
        sparse_grad_bytes=sparse_grads,
        grad_order=grad_order,
        retained_bytes=retained,
        end_unsaved_inputs={
            name: tuple((i, float(n)) for i, n in ids.items()) for name, ids in end_unsaved.items()
        },
    )


def _unique_bytes(items: list[torch.Tensor]) -> int:
    return sum({key: nbytes for key, nbytes, _ in map(storage_of, items)}.values())
