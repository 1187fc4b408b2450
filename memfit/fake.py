"""A training step's peak memory estimated without allocating it, on fake tensors.

The model is built on the meta device and given fake parameters (shapes, dtypes and
devices, no data); one step runs forward, backward and the optimizer, and
:mod:`memfit.memory`'s storage tracker counts it exactly as ``measure`` counts a real one.

Example::

    est = estimate_step_memory(lambda: GPT(cfg), lambda: torch.randint(0, 50257, (8, 1024)))
    print(format_bytes(est.peak_bytes))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.memory import _CUDA_BLOCK, MemoryReport, _track, _tracker_report
from memfit.nested import call_model, first_floating

__all__ = ["estimate_step_memory", "one_tensor_step_temp_bytes", "optimizer_step_temp_bytes"]


def estimate_step_memory(
    model_fn: Callable[[], nn.Module],
    inputs_fn: Callable[[], Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None = None,
    autocast_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> MemoryReport:
    """Estimate a training step's peak memory without allocating it, with fake tensors.

    Builds the model on the meta device, gives it fake parameters on ``device`` (tensors
    with shapes, dtypes and devices but no data, ``FakeTensorMode``), runs forward, backward
    and an optimizer step, and tracks storages exactly as ``measure`` does. Two steps run and
    the second is reported, so optimizer state made lazily by the first counts, as in
    steady-state training.

    Args:
        model_fn: builds the model on the default device; dtype casts (``.to(bf16)``) are
            fine, moves to a device are not (pass ``device`` instead).
        inputs_fn: builds the inputs: a tensor (``model(x)``), tuple (``model(*x)``) or dict.
        loss_fn: output -> scalar loss; default: sum of the first floating-point tensor.
        optimizer_fn: params -> optimizer; default ``torch.optim.AdamW``; ``lambda p: None``
            for no optimizer.
        autocast_dtype: run forward under ``torch.autocast`` with this dtype.
        device: the device the step would run on (nothing is allocated there).

    Sizes on CUDA are rounded to the allocator's 512-byte blocks; library workspaces and
    allocator fragmentation are not modelled.

    Example::

        est = estimate_step_memory(lambda: GPT(cfg), lambda: torch.randint(0, 50257, (8, 1024)))
        print(format_bytes(est.peak_bytes))
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # Fake CUDA tensors need the CUDA build's device hooks; without them torch aborts.
        raise ConfigError(
            "estimating for a CUDA device needs a CUDA build of torch with a visible GPU; "
            "estimate with device='cpu' instead (same bytes, without allocator rounding)"
        )
    loss_of = loss_fn or _default_loss
    make_optimizer = optimizer_fn or torch.optim.AdamW
    with torch.device("meta"):
        model = model_fn()
    # Real tensors may meet fake ones (constants a model keeps in plain attributes); they
    # are read, never allocated, so allowing them costs nothing here.
    with FakeTensorMode(allow_non_fake_inputs=True):
        # to_empty rather than building under the fake mode: casting a fake module's
        # parameters (.to(dtype)) swaps tensors, which fake parameters do not allow.
        model.to_empty(device=device)
        with torch.device(device):
            inputs = inputs_fn()
        optimizer = make_optimizer(model.parameters())

        def step() -> None:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.bfloat16,
                enabled=autocast_dtype is not None,
            ):
                loss = loss_of(call_model(model, inputs))
            loss.backward()
            if optimizer is not None:
                optimizer.step()

        step()
        # Fake tensors keep their storages on the meta device: that is what is tracked.
        round_to = _CUDA_BLOCK if device.type == "cuda" else 1
        _, tracker = _track(step, torch.device("meta"), model, optimizer, False, round_to)
    return _tracker_report(tracker, device, None)


def _default_loss(output: Any) -> torch.Tensor:
    first = first_floating(output)
    if first is None:
        raise ConfigError("the model's output holds no floating-point tensor; pass loss_fn")
    return first.float().sum()


def optimizer_step_temp_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``optimizer.step()`` allocates for itself beyond parameters, gradients and
    state, at its peak: measured on a shadow optimizer of the same class and settings over
    fake tensors of the same shapes, dtypes and devices (nothing is allocated, the real
    optimizer is not touched).

    A ``foreach`` AdamW makes about one parameter-sized temporary per group (the square
    root of its second moments); per-parameter (``foreach=False``) a few of the largest
    parameter's size; ``fused`` none.

    The answer is kept for the optimizer's class, settings and its parameters' shapes,
    dtypes and devices (a shadow step of a large model takes seconds, and planners ask
    again for every strategy they solve; an estimate builds one optimizer per precision
    over the same meta parameters): another optimizer alike gets it without a step.

    Example::

        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        optimizer_step_temp_bytes(opt)   # about the bytes of the parameters
    """
    key = _optimizer_signature(optimizer)
    known = _TEMP_BYTES.get(key)
    if known is None:
        known = _shadow_step_temp_bytes(optimizer)
        if len(_TEMP_BYTES) >= _TEMP_BYTES_KEPT:
            del _TEMP_BYTES[next(iter(_TEMP_BYTES))]  # the oldest answer
    else:
        del _TEMP_BYTES[key]  # moved to the end: the newest
    _TEMP_BYTES[key] = known
    return known


def one_tensor_step_temp_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What ``optimizer.step()`` allocates for itself when only its largest trained tensor
    has a gradient (an update applied in backward, :mod:`memfit.engine.release`): that of
    an optimizer of the same class and settings over that tensor alone
    (:func:`optimizer_step_temp_bytes`).

    Example::

        one_tensor_step_temp_bytes(torch.optim.AdamW(model.parameters()))
    """
    found = [(g, p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not found:
        return 0
    group, largest = max(found, key=lambda gp: gp[1].numel())
    settings = {k: v for k, v in group.items() if k != "params"}
    return optimizer_step_temp_bytes(type(optimizer)([{**settings, "params": [largest]}]))


#: :func:`optimizer_step_temp_bytes`'s answers by optimizer signature, oldest first.
_TEMP_BYTES: dict[Any, int] = {}
_TEMP_BYTES_KEPT = 16


def _optimizer_signature(optimizer: torch.optim.Optimizer) -> Any:
    """What the step's temporaries depend on: the optimizer's class, each group's settings
    and its parameters' shapes, dtypes, devices and whether they train."""
    return (
        type(optimizer),
        tuple(
            (
                repr(sorted((k, v) for k, v in group.items() if k != "params")),
                tuple(
                    (tuple(p.shape), p.dtype, p.device, p.requires_grad) for p in group["params"]
                ),
            )
            for group in optimizer.param_groups
        ),
    )


def _shadow_step_temp_bytes(optimizer: torch.optim.Optimizer) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        groups = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                shadow = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=p.device),
                    requires_grad=p.requires_grad,
                )
                if p.requires_grad:
                    shadow.grad = torch.empty_like(shadow)
                params.append(shadow)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        shadow_optimizer = type(optimizer)(groups)
        shadow_optimizer.step()  # the first step makes the state; the second is measured
        _, tracker = _track(
            shadow_optimizer.step, torch.device("meta"), None, shadow_optimizer, False, 1
        )
    return int(_tracker_report(tracker, torch.device("cpu"), None).by_kind["temp"])
