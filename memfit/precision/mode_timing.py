"""``precision="auto"``: the model's own first micro-batch timed in each candidate mode.

A matmul probe says how fast the device multiplies in each dtype, not how fast the model
trains: a model whose time is in convolutions on a CPU, in tiny layers where autocast's
casts dominate, or in memory-bound ops can be slower in bf16 even where the matmul is
faster. So the Engine times the model itself (:func:`time_modes`): one forward and
backward of the first micro-batch per mode as a warm-up, then rounds in which the modes
take turns, each mode keeping its fastest run, the warm-up's included (another process's
burst on a shared machine, or a first call's one-time costs, slow a run, never speed one
up).

Training must not see any of it. The runs restore what they touch: the random generators
(CPU and CUDA: dropout draws the same masks), the module buffers (BatchNorm's running
statistics and ``num_batches_tracked``), the gradients (``.grad`` as before, None before
the first step), the fp32 islands of a mixed mode (added for its runs, removed after). No
optimizer step runs, no hook is left, and autocast and grad mode are as they were. A
``loss_fn`` that raises, raises here as it would in the first step, after the restoring.

Example::

    times = time_modes(model, micro, loss_fn, [PrecisionPolicy("fp32"),
                                               PrecisionPolicy("bf16-mixed")], device)
    times.seconds   # {"fp32": 0.041, "bf16-mixed": 0.025}
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.precision.apply import precision_applied
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import (
    PrecisionChoice,
    choose_from_model,
    choose_precision,
    model_seconds_assumed,
    probe_settles,
)

__all__ = [
    "ModeTimes",
    "TIMING_BUDGET_S",
    "TIMING_ROUNDS",
    "auto_choice",
    "restored_training",
    "time_modes",
]

#: Timed rounds after the warm-up (each mode runs once per round).
TIMING_ROUNDS = 3
#: Once the warm-up and the rounds so far took this many seconds, no further round is
#: started: a model whose step takes seconds is timed in one round, not three.
TIMING_BUDGET_S = 2.0


@dataclass(frozen=True)
class ModeTimes:
    """Each mode's fastest forward and backward of one micro-batch, and the timing's cost."""

    seconds: dict[str, float]
    """Fastest run per mode name (the warm-up's included)."""
    total_seconds: float
    """Wall seconds of the whole timing, warm-ups and restoring included."""
    rounds: int
    """Timed rounds run (each mode once per round)."""


def time_modes(
    model: nn.Module,
    micro: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    policies: Sequence[PrecisionPolicy],
    device: torch.device,
    *,
    rounds: int = TIMING_ROUNDS,
    budget_s: float = TIMING_BUDGET_S,
) -> ModeTimes:
    """Time ``model``'s forward and backward of ``micro`` under each policy; leave the
    model, its gradients and the random generators as they were. ``loss_fn(model, micro)``
    returns the scalar loss (checked by the caller).

    Example::

        time_modes(model, micro, loss_fn, [PrecisionPolicy("fp32")], torch.device("cpu"))
    """
    start = time.perf_counter()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = {p.mode: float("inf") for p in policies}
    with restored_training(model, device) as restart:

        def run(policy: PrecisionPolicy) -> float:
            restart()  # every run draws what the first step will draw
            with precision_applied(model, policy):
                sync()
                begin = time.perf_counter()
                with policy.autocast(device.type):
                    loss = loss_fn(model, micro)
                loss.backward()
                sync()
                return time.perf_counter() - begin

        for policy in policies:  # warm-up: kernel choice, lazy initialisation, caches
            # Its one-time costs only slow it, so it counts among the runs too: one more
            # run per mode, never one that is faster than the mode is.
            best[policy.mode] = run(policy)
        done = 0
        while done < rounds and (done == 0 or time.perf_counter() - start < budget_s):
            # The modes alternate, and which goes first alternates too: neither always
            # runs after the other, on caches the other warmed.
            order = policies if done % 2 == 0 else list(reversed(policies))
            for policy in order:
                best[policy.mode] = min(best[policy.mode], run(policy))
            done += 1
    return ModeTimes(best, time.perf_counter() - start, done)


@contextlib.contextmanager
def restored_training(model: nn.Module, device: torch.device) -> Iterator[Callable[[], None]]:
    """Inside the block, ``restart()`` puts the random generators and the gradients back
    as they were on entry; on leaving, everything the runs touched is as it was."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        cpu_rng = torch.get_rng_state()
        cuda_rng = [torch.cuda.get_rng_state(i) for i in cuda]

        def restart() -> None:
            torch.set_rng_state(cpu_rng)
            for i, state in zip(cuda, cuda_rng):
                torch.cuda.set_rng_state(state, i)
            for p in params:  # fresh gradients, as the first step's backward makes them
                p.grad = None

        try:
            yield restart
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad
            _put_back(buffers)


def _put_back(buffers: list[tuple[nn.Module, str, torch.Tensor, Any]]) -> None:
    """Each buffer object back in its module, holding its saved values."""
    for module, name, buffer, value in buffers:
        module._buffers[name] = buffer
        with torch.no_grad():  # a restore, outside every timed run
            buffer.copy_(value)


def auto_choice(
    model: nn.Module,
    micro: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    fp32_islands: tuple[type[nn.Module], ...] | None = None,
) -> PrecisionChoice:
    """What ``precision="auto"`` trains ``model`` in, the one rule the Engine and the
    planner share: the matmul probe (:func:`~memfit.precision.speed.choose_precision`),
    then, unless the probe settles it (:func:`~memfit.precision.speed.probe_settles`),
    the model's forward and backward of ``micro`` timed in each candidate
    (:func:`time_modes`). The probe decides, with a note saying why, for a model with lazy
    modules (their first forward makes the weights, which the timing would undo) and after
    an out-of-memory error while timing. Errors of ``loss_fn`` propagate.

    Example::

        choice = auto_choice(model, micro, lambda m, b: m(b).mean(), torch.device("cpu"))
        choice.mode   # "bf16-mixed" where the model is 1.1x faster in it, else "fp32"
    """
    probe = choose_precision(device)
    why = probe_settles(probe, device)
    if why:
        return replace(probe, note=why)
    if any(nn.parameter.is_lazy(p) for p in model.parameters()):
        return replace(probe, note="lazy modules: the model is not timed before its first step")
    islands = PrecisionPolicy().fp32_islands if fp32_islands is None else fp32_islands
    policies = [PrecisionPolicy(mode, fp32_islands=islands) for mode in probe.speedups]
    try:
        times = time_modes(model, micro, loss_fn, policies, device)
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return replace(probe, note="out of memory timing one micro-batch unplanned")
    assumed = model_seconds_assumed(device)
    choice = choose_from_model(
        probe, times.seconds if assumed is None else assumed, measured=assumed is None
    )
    return replace(choice, timing_seconds=times.total_seconds)
