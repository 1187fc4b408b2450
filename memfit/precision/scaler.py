"""Dynamic loss scaling with the scale, its counters and the overflow flags on the device.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a
large scale lifts them into range; the gradients are divided by it again before the
optimizer sees them. When a scaled gradient overflows, the step is skipped and the scale
backs off; after ``growth_interval`` clean steps it grows again (Micikevicius et al., 2018,
"Mixed Precision Training"; the schedule of ``torch.amp.GradScaler``).

Per optimizer, the calls follow a small state machine, and calls out of order raise
:class:`~memfit.errors.ScalerStateError`::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()-----------------------------^   (step() unscales first)

Host syncs: ``scale``, ``unscale_`` and ``update`` never read a device value. ``step``
does not either when the optimizer can skip an update on the device (torch's fused
Adam/AdamW/SGD/Adagrad take a ``found_inf`` tensor); for any other optimizer it reads the
overflow flag once (``.item()``), as ``torch.amp.GradScaler`` does, to decide whether to
call ``optimizer.step()``. One exception: fused SGD with momentum creates its momentum
buffers uninitialized on its first step and does not fill them when ``found_inf`` skips that
step, so until every buffer exists ``step`` takes the one-sync path for it.
``stats``, ``get_scale`` and ``state_dict`` read device values.

Example::

    scaler = memfit.precision.LossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)            # optional: clip unscaled gradients here
    applied = scaler.step(optimizer)      # 0-dim bool tensor, True if the update was applied
    scaler.update()
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import ConfigError, ScalerStateError

FoundInfHook = Callable[[torch.Tensor], Any]

FP16_MAX = 65504.0
"""fp16's largest finite value: a scaled gradient above it overflows and the step is skipped."""

INITIAL_SCALE_HEADROOM = 8.0
"""How far below :data:`FP16_MAX` :func:`suggest_initial_scale` keeps the largest scaled
gradient by default: gradients grow during training, and a first step that overflows is
wasted."""

MIN_SCALE = 1.0
"""The smallest loss scale by default (:class:`LossScaler`'s ``min_scale``, and the least
:func:`suggest_initial_scale` gives): below 1 the scale would only lose small gradients."""

MAX_SCALE = 2.0**24
"""The largest loss scale by default (:class:`LossScaler`'s ``max_scale``, and the most
:func:`suggest_initial_scale` gives)."""


def suggest_initial_scale(max_abs_grad: float, headroom: float = INITIAL_SCALE_HEADROOM) -> float:
    """The largest ``2**k`` with ``max_abs_grad × 2**k ≤ FP16_MAX / headroom``, clamped to
    ``[1, 2**24]``: the initial loss scale for gradients whose largest ``|g|`` (unscaled)
    is ``max_abs_grad``.

    The largest gradient then sits ``headroom`` times below fp16's maximum, so small
    gradients keep as many bits as they can without the first steps overflowing. All-zero
    gradients give ``2**24``; non-finite ones give ``1``. ``headroom`` (at least 1) is the
    caller's margin for how much the gradients may still grow: the default
    :data:`INITIAL_SCALE_HEADROOM` for gradients of a running training, more for gradients
    measured before training has moved the weights.

    Example::

        suggest_initial_scale(0.5)                # 8192.0: 0.5 * 8192 = 4096 <= 65504 / 8
        suggest_initial_scale(0.5, headroom=16)   # 4096.0
    """
    if not headroom >= 1.0:
        raise ConfigError(f"headroom must be >= 1, got {headroom}")
    if not math.isfinite(max_abs_grad):
        return MIN_SCALE
    if max_abs_grad <= 0.0:
        return MAX_SCALE
    k = math.floor(math.log2(FP16_MAX / headroom / max_abs_grad))
    # log2 can land one off at exact powers of two; step down until the bound holds.
    while k > -1000 and max_abs_grad * 2.0**k > FP16_MAX / headroom:
        k -= 1
    return min(max(2.0**k, MIN_SCALE), MAX_SCALE)


class OptState(enum.Enum):
    """Where one optimizer is in the current step."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass(frozen=True)
class ScalerStats:
    """Counters of a :class:`LossScaler` (reading them synchronizes with the device)."""

    steps: int
    """Optimizer steps attempted (calls to ``update``)."""
    skipped: int
    """Steps skipped because a gradient was non-finite."""
    consecutive_skips: int
    """Skipped steps in a row up to now (0 after an applied step)."""
    scale: float
    """The current loss scale."""

    @property
    def overflow_rate(self) -> float:
        """Skipped steps / steps (0 before the first step)."""
        return self.skipped / self.steps if self.steps else 0.0


def _lacks_momentum(optimizer: torch.optim.Optimizer) -> bool:
    # Fused SGD allocates missing momentum buffers with empty_like and fills them inside the
    # kernel, which returns early when found_inf is set: a skipped first step would leave
    # garbage in them. Such a step must be skipped on the host instead.
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(
        group.get("momentum", 0) != 0
        and p.grad is not None
        and "momentum_buffer" not in optimizer.state.get(p, {})
        for group in optimizer.param_groups
        for p in group["params"]
    )


class LossScaler:
    """Dynamic loss scaler with device-side state, hysteresis and min/max bounds.

    With ``dynamic=False`` the scale stays at ``init_scale`` (use 1.0 for bf16/fp32), and the
    scaler only checks the gradients and skips non-finite steps.

    Example::

        scaler = memfit.precision.LossScaler(init_scale=8192.0, growth_interval=2000)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 8192.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = MIN_SCALE,
        max_scale: float = MAX_SCALE,
        dynamic: bool = True,
        found_inf_hook: FoundInfHook | None = None,
    ) -> None:
        self._check_config(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
            dynamic,
        )
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = bool(dynamic)
        self._found_inf_hook = found_inf_hook
        self._device: torch.device | None = None
        # Values loaded from a state dict before the device is known.
        self._pending: dict[str, float | int] | None = None
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._steps: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self._scaled_since_update = False

    @staticmethod
    def _check_config(
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float,
        max_scale: float,
        dynamic: bool,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ConfigError(f"init_scale must be a positive finite number, got {init_scale}")
        if not 0 < min_scale <= max_scale:
            raise ConfigError(
                f"need 0 < min_scale <= max_scale, got min_scale={min_scale}, max_scale={max_scale}"
            )
        if dynamic:
            if not growth_factor > 1.0:
                raise ConfigError(f"growth_factor must be > 1, got {growth_factor}")
            if not 0.0 < backoff_factor < 1.0:
                raise ConfigError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
            if int(growth_interval) != growth_interval or growth_interval < 1:
                raise ConfigError(f"growth_interval must be an int >= 1, got {growth_interval}")
            if int(hysteresis) != hysteresis or hysteresis < 1:
                raise ConfigError(f"hysteresis must be an int >= 1, got {hysteresis}")

    # ------------------------------------------------------------------ device state

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is not None:
            if device != self._device:
                raise ScalerStateError(
                    f"this LossScaler lives on {self._device} but got a loss on {device}; "
                    "use one scaler per device"
                )
            return
        values = self._initial_values()
        self._pending = None
        self._device = device
        self._scale = torch.tensor(float(values["scale"]), dtype=torch.float32, device=device)
        self._growth_tracker = torch.tensor(
            int(values["growth_tracker"]), dtype=torch.int32, device=device
        )
        self._hysteresis_left = torch.tensor(
            int(values["hysteresis_left"]), dtype=torch.int32, device=device
        )
        self._steps = torch.tensor(int(values["steps"]), dtype=torch.int64, device=device)
        self._skipped = torch.tensor(int(values["skipped"]), dtype=torch.int64, device=device)
        self._consecutive = torch.tensor(
            int(values["consecutive_skips"]), dtype=torch.int64, device=device
        )

    def _initial_values(self) -> dict[str, float | int]:
        # The state before the first step, or what load_state_dict left to restore.
        values: dict[str, float | int] = {
            "scale": self.init_scale,
            "growth_tracker": 0,
            "hysteresis_left": self.hysteresis,
            "steps": 0,
            "skipped": 0,
            "consecutive_skips": 0,
        }
        values.update(self._pending or {})
        return values

    def _state_of(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": OptState.READY, "found_inf": None}
        )

    def register_found_inf_hook(self, hook: FoundInfHook | None) -> None:
        """Call ``hook(found_inf)`` after each unscale, before the flag is used.

        The hook may change the 0-dim float tensor in place; data-parallel training
        all-reduces it with MAX so every rank skips the same steps
        (:mod:`memfit.distributed` installs one).
        """
        self._found_inf_hook = hook

    # ------------------------------------------------------------------ the step

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """Return ``outputs * scale`` (no host sync). Call ``.backward()`` on the result."""
        if not isinstance(outputs, torch.Tensor):
            raise ScalerStateError(
                f"scale() takes the loss tensor, got {type(outputs).__name__}; "
                "return a tensor from your loss function"
            )
        self._lazy_init(outputs.device)
        self._scaled_since_update = True
        if not self.dynamic and self.init_scale == 1.0:
            return outputs
        assert self._scale is not None
        return outputs * self._scale.to(outputs.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record non-finite ones.

        Call it once per step, before clipping. No host sync.
        """
        state = self._state_of(optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise ScalerStateError(
                "unscale_() was already called on this optimizer since the last update(); "
                "call it once per step, before clipping and step()"
            )
        if state["stage"] is OptState.STEPPED:
            raise ScalerStateError(
                "unscale_() called after step(); call unscale_() before step(), "
                "then update() to begin the next step"
            )
        if not self._scaled_since_update:
            raise ScalerStateError(
                "unscale_() called before scale(loss) in this step; "
                "run scaler.scale(loss).backward() first"
            )
        assert self._scale is not None and self._device is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self._device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype is torch.float16 and self.dynamic:
                    raise ConfigError(
                        "cannot unscale fp16 gradients in place without losing small values; "
                        "keep fp32 parameters ('fp16-mixed') or use 'fp16-master', whose "
                        "optimizer updates an fp32 master copy"
                    )
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():
            flag = (
                found_inf if device == self._device else torch.zeros_like(found_inf, device=device)
            )
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
            if flag is not found_inf:
                found_inf.add_(flag.to(self._device))
        if self._found_inf_hook is not None:
            self._found_inf_hook(found_inf)
        state["found_inf"] = found_inf
        state["stage"] = OptState.UNSCALED

    def note_non_finite(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Add ``found_inf`` (a 0-dim device tensor, nonzero where a gradient was
        non-finite) to what :meth:`unscale_` recorded for ``optimizer``: for gradients
        checked and freed before it ran (released in backward,
        :mod:`memfit.engine.release`), so :meth:`step` skips and the statistics count the
        step. No host sync.

        Example::

            scaler.unscale_(optimizer); scaler.note_non_finite(optimizer, flag)
        """
        state = self._state_of(optimizer)
        if state["stage"] is not OptState.UNSCALED:
            raise ScalerStateError(
                "note_non_finite() belongs between unscale_() and step(); call unscale_() first"
            )
        state["found_inf"] = state["found_inf"] + found_inf.to(state["found_inf"].device)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Apply ``optimizer.step()`` unless a gradient was non-finite.

        Unscales first if :meth:`unscale_` was not called. Returns a 0-dim bool tensor on
        the device, True where the update was applied (reading it syncs). No host sync for
        optimizers that take ``found_inf`` (fused Adam/AdamW/SGD/Adagrad); one otherwise.
        """
        state = self._state_of(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise ScalerStateError(
                "step() was already called on this optimizer since the last update(); "
                "call update() once per step"
            )
        if not self._scaled_since_update:
            raise ScalerStateError(
                "step() called before scale(loss): scale the loss and call backward() "
                "on the result first, or the gradients are not scaled as the scaler assumes"
            )
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        found_inf = state["found_inf"]
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not _lacks_momentum(
            optimizer
        ):
            # Fused optimizers skip the update on the device when found_inf is set (they
            # also undo their step counter), so no host sync is needed. Gradients are
            # already unscaled: grad_scale stays None.
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
                del optimizer.grad_scale  # type: ignore[attr-defined]
        elif not found_inf.item():  # the one host sync, as in torch.amp.GradScaler
            optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return found_inf == 0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the step: adjust the scale and the counters (no host sync).

        On a non-finite step the hysteresis counter drops; when it reaches zero the scale
        backs off. After ``growth_interval`` clean steps in a row the scale grows. The scale
        stays within [min_scale, max_scale]. ``new_scale`` sets the scale directly.
        """
        if any(s["stage"] is OptState.UNSCALED for s in self._per_optimizer.values()):
            # Counting this as a step would record an update that never happened.
            raise ScalerStateError(
                "update() called after unscale_() but before step() on an optimizer; "
                "call step(optimizer) first (it skips the update itself on overflow)"
            )
        flags = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if not flags:
            raise ScalerStateError(
                "update() called but no optimizer was unscaled or stepped since the last "
                "update(); call step(optimizer) first"
            )
        assert self._scale is not None and self._growth_tracker is not None
        assert self._hysteresis_left is not None and self._steps is not None
        assert self._skipped is not None and self._consecutive is not None
        found = torch.stack(flags).sum() > 0
        self._steps.add_(1)
        self._skipped.add_(found.long())
        self._consecutive.copy_(torch.where(found, self._consecutive + 1, 0))
        if new_scale is not None:
            value = torch.as_tensor(new_scale, dtype=torch.float32, device=self._device)
            self._scale.copy_(value.reshape(()))
        elif self.dynamic:
            self._update_scale(found)
        self._per_optimizer.clear()
        self._scaled_since_update = False

    def discard_step(self) -> None:
        """Forget the current step's scale/unscale/step calls (after a failed micro-batch).

        The scale and the counters stay as they were; the next ``scale`` starts a new step.
        """
        self._per_optimizer.clear()
        self._scaled_since_update = False

    def _update_scale(self, found: torch.Tensor) -> None:
        assert self._scale is not None and self._growth_tracker is not None
        assert self._hysteresis_left is not None
        hysteresis_left = torch.where(found, self._hysteresis_left - 1, self.hysteresis)
        back_off = found & (hysteresis_left <= 0)
        tracker = self._growth_tracker + 1
        grow = ~found & (tracker >= self.growth_interval)
        # Multiply in float64 and round once, as torch's own scale update does.
        current = self._scale.double()
        scaled = torch.where(
            back_off,
            current * self.backoff_factor,
            torch.where(grow, current * self.growth_factor, current),
        ).float()
        scaled = torch.where(torch.isfinite(scaled), scaled, self._scale)
        self._scale.copy_(scaled.clamp(self.min_scale, self.max_scale))
        self._growth_tracker.copy_(torch.where(found | grow, 0, tracker))
        self._hysteresis_left.copy_(torch.where(back_off, self.hysteresis, hysteresis_left))

    # ------------------------------------------------------------------ reading state

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The scale as a device tensor (no sync), or None before the first ``scale``."""
        return self._scale

    @property
    def consecutive_skips_tensor(self) -> torch.Tensor | None:
        """Skipped steps in a row, as a device tensor (no sync)."""
        return self._consecutive

    def get_scale(self) -> float:
        """The current scale as a float (syncs)."""
        if self._scale is None:
            return float((self._pending or {}).get("scale", self.init_scale))
        return float(self._scale.item())

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, consecutive skips and scale (syncs)."""
        values = self._values()
        return ScalerStats(
            steps=int(values["steps"]),
            skipped=int(values["skipped"]),
            consecutive_skips=int(values["consecutive_skips"]),
            scale=float(values["scale"]),
        )

    def _values(self) -> dict[str, float | int]:
        if self._scale is None:
            return self._initial_values()
        assert self._growth_tracker is not None and self._hysteresis_left is not None
        assert self._steps is not None and self._skipped is not None
        assert self._consecutive is not None
        return {
            "scale": float(self._scale.item()),
            "growth_tracker": int(self._growth_tracker.item()),
            "hysteresis_left": int(self._hysteresis_left.item()),
            "steps": int(self._steps.item()),
            "skipped": int(self._skipped.item()),
            "consecutive_skips": int(self._consecutive.item()),
        }

    def state_dict(self) -> dict[str, Any]:
        """Settings and state, enough for a resumed run to continue exactly (syncs)."""
        if self._per_optimizer:
            raise ScalerStateError(
                "state_dict() called in the middle of a step; call it after update()"
            )
        return {
            "init_scale": self.init_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            **self._values(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = {"scale", "growth_tracker", "steps", "skipped"} - set(state)
        if missing:
            raise ConfigError(
                f"not a LossScaler state dict: missing {sorted(missing)}; "
                "pass what LossScaler.state_dict() returned"
            )
        for name in (
            "init_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "hysteresis",
            "min_scale",
            "max_scale",
            "dynamic",
        ):
            if name in state:
                setattr(self, name, type(getattr(self, name))(state[name]))
        self._pending = {
            "scale": float(state["scale"]),
            "growth_tracker": int(state["growth_tracker"]),
            "hysteresis_left": int(state.get("hysteresis_left", self.hysteresis)),
            "steps": int(state["steps"]),
            "skipped": int(state["skipped"]),
            "consecutive_skips": int(state.get("consecutive_skips", 0)),
        }
        if self._device is not None:
            device = self._device
            self._scale = None
            self._lazy_init(device)
        self._per_optimizer.clear()
        self._scaled_since_update = False

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, init_scale={self.init_scale}, growth_interval={self.growth_interval}, hysteresis={self.hysteresis})"
