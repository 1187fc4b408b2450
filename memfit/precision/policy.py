"""Precision policies: which dtype computes, which dtype the weights live in, what stays fp32.

Six modes, one alias table (in the spirit of Lightning's precision strings):

====================  ===========  ==============  ============  ============
mode                  weights      compute         master copy   loss scaling
====================  ===========  ==============  ============  ============
``fp32``              fp32         fp32            no            no
``bf16-mixed``        fp32         bf16 autocast   no            no
``fp16-mixed``        fp32         fp16 autocast   no            dynamic
``bf16-master``       bf16         bf16 autocast   fp32          no
``fp16-master``       fp16         fp16 autocast   fp32          dynamic
``bf16-sr``           bf16         bf16 autocast   no            no
====================  ===========  ==============  ============  ============

``bf16-sr`` keeps no master copy: the optimizer computes each update in fp32 and stores
the weight back in bf16 with stochastic rounding (:mod:`memfit.precision.optimizer_state`),
so an update under the weight's last bit still moves it on average.

``"bf16-true"`` (Lightning's bf16 weights with no fp32 master copy, updated with plain
rounding) keeps training as ``bf16-master`` for one more release, with a warning
(:data:`FOREIGN_MODES`).

fp32 islands are module types that always run in fp32 with their inputs cast up and
autocast off inside them (default: normalization layers). Under autocast, torch already
runs losses like ``cross_entropy`` in fp32.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn

from memfit.deprecations import REMOVED_IN
from memfit.errors import ConfigError
from memfit.precision.kernels import kernel_device, missing_kernel_types

Mode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-sr"]
MODES: tuple[str, ...] = get_args(Mode)

#: Every accepted spelling, mapped to its mode. Lightning's and Apex's names are included.
ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "float32": "fp32",
    "O0": "fp32",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "fp16": "fp16-mixed",
    "16": "fp16-mixed",
    "16-mixed": "fp16-mixed",
    "fp16-mixed": "fp16-mixed",
    "float16": "fp16-mixed",
    "O1": "fp16-mixed",
    "bf16-master": "bf16-master",
    "fp16-master": "fp16-master",
    "16-true": "fp16-master",
    "O2": "fp16-master",
    "bf16-sr": "bf16-sr",
}

# Case-insensitive lookup, so "o1" and "BF16" work as "O1" and "bf16" do.
_FOLDED: dict[str, str] = {alias.lower(): mode for alias, mode in ALIASES.items()}


class ForeignMode(NamedTuple):
    """A precision name from another library that means a training memfit does not have."""

    trains_as: str  # the memfit mode it trains as until it is refused
    why: str  # what it means there, and how ``trains_as`` differs
    instead: str  # what to pass instead


#: Spellings from other libraries that name a training memfit does not have. Each trains
#: as :attr:`ForeignMode.trains_as`, with a DeprecationWarning, until memfit
#: :data:`~memfit.deprecations.REMOVED_IN` refuses it. bf16 weights updated in place with
#: plain rounding lose every update under about 1/256 of the weight (8 bits of mantissa):
#: memfit's bf16 weights come with an fp32 master copy, or with stochastic rounding.
FOREIGN_MODES: dict[str, ForeignMode] = {
    "bf16-true": ForeignMode(
        trains_as="bf16-master",
        why="in Lightning it means bf16 weights with no fp32 master copy, which memfit does "
        "not offer (bf16 weights updated in place lose small updates); memfit trains it as "
        "'bf16-master': bf16 weights plus an fp32 master copy in the optimizer, 4 more bytes "
        "a parameter",
        instead="pass precision='bf16-sr' for bf16 weights without a master copy (updates "
        "stored with stochastic rounding), 'bf16-master' for that training, or 'bf16-mixed' "
        "(fp32 weights, bf16 autocast)",
    ),
}


#: Module types kept in fp32 by default: their statistics lose accuracy in 16 bits.
DEFAULT_FP32_ISLANDS: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        nn.modules.batchnorm._BatchNorm,
        nn.modules.instancenorm._InstanceNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)


#: The precision that is measured, not named: fp32 or the device's 16-bit autocast mode,
#: whichever trains the model faster here (:func:`memfit.precision.mode_timing.auto_choice`).
AUTO = "auto"


def is_auto(precision: object) -> bool:
    """Whether ``precision`` asks memfit to choose (``"auto"``, any case).

    Example::

        is_auto("Auto"), is_auto("bf16-mixed")   # (True, False)
    """
    return isinstance(precision, str) and precision.strip().lower() == AUTO


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised in the caller at the first frame
    outside memfit: the user's line, whichever memfit function passed the name on (Python
    only shows a DeprecationWarning attributed to the user's own code)."""
    frame = sys._getframe(2)  # the caller's caller: stacklevel 2 of the caller's warning
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("memfit."):
        frame = frame.f_back
        level += 1
    return level


def resolve_mode(name: str) -> str:
    """Map a mode name or alias to one of :data:`MODES`; raise with the valid names if unknown."""
    if isinstance(name, PrecisionPolicy):
        return name.mode
    key = str(name).strip()
    foreign = FOREIGN_MODES.get(key.lower())
    if foreign is not None:
        warnings.warn(
            f"precision {key!r}: {foreign.why}. It will be refused from memfit "
            f"{REMOVED_IN}: {foreign.instead}",
            DeprecationWarning,
            stacklevel=_user_stacklevel(),
        )
        return foreign.trains_as
    mode = ALIASES.get(key) or _FOLDED.get(key.lower())
    if mode is None:
        aliases = ", ".join(sorted(a for a in ALIASES if a not in MODES))
        raise ConfigError(
            f"unknown precision {name!r}. Valid modes: {', '.join(MODES)}; aliases: {aliases}"
        )
    return mode


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a model trains: compute dtype, weight dtype, master copy, loss scaling, fp32 islands.

    Example::

        policy = memfit.PrecisionPolicy("bf16-mixed")
        with policy.autocast("cpu"):
            loss = model(x).float().mean()
    """

    mode: str = "bf16-mixed"
    """A mode from :data:`MODES` or an alias from :data:`ALIASES`; stored resolved."""
    fp32_islands: tuple[type[nn.Module], ...] = field(default=DEFAULT_FP32_ISLANDS)
    """Module types that run in fp32 (inputs cast up, autocast off inside). ``()`` for none."""
    autocast_cache: bool = True
    """Whether autocast keeps its 16-bit copy of each fp32 weight it casts until the region
    ends (torch's default, and memfit's Engine and the Hugging Face Trainer train so), or
    casts it again at each use (Lightning's mixed precision turns the cache off): the end
    of forward then holds no copies beyond those the ops save."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", resolve_mode(self.mode))
        islands = tuple(self.fp32_islands)
        for t in islands:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise ConfigError(f"fp32_islands must be nn.Module subclasses, got {t!r}")
        object.__setattr__(self, "fp32_islands", islands)

    @classmethod
    def of(cls, value: str | PrecisionPolicy | None) -> PrecisionPolicy:
        """A policy from a mode string, a policy (returned as is) or None (fp32)."""
        if isinstance(value, PrecisionPolicy):
            return value
        return cls("fp32" if value is None else value)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls and convolutions run in."""
        if self.mode == "fp32":
            return torch.float32
        return torch.bfloat16 if self.mode.startswith("bf16") else torch.float16

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the model's working weights (fp32 except in the master modes and
        ``bf16-sr``)."""
        return self.compute_dtype if self.low_precision_weights else torch.float32

    @property
    def master_weights(self) -> bool:
        """True when the model holds low-precision weights and the optimizer an fp32 copy."""
        return self.mode.endswith("-master")

    @property
    def rounded_weights(self) -> bool:
        """True when the model holds low-precision weights and no master copy: each update
        is stored into them with stochastic rounding (``bf16-sr``)."""
        return self.mode.endswith("-sr")

    @property
    def low_precision_weights(self) -> bool:
        """True when the model's weights (outside fp32 islands) are 16-bit."""
        return self.master_weights or self.rounded_weights

    @property
    def loss_scaling(self) -> bool:
        """True for the fp16 modes, whose small gradients underflow without a loss scale."""
        return self.mode.startswith("fp16")

    @property
    def mixed(self) -> bool:
        """True for every mode that computes in 16 bits."""
        return self.mode != "fp32"

    def autocast(self, device_type: str = "cpu") -> contextlib.AbstractContextManager:
        """The autocast context of this policy on ``device_type`` (a no-op for fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=device_type, dtype=self.compute_dtype, cache_enabled=self.autocast_cache
        )

    def is_island(self, module: nn.Module) -> bool:
        """Whether ``module`` runs as an fp32 island: one of :attr:`fp32_islands`, or in a
        16-bit mode a layer kind with no kernel in that dtype on the module's device (an
        LSTM in bf16 on an AVX2-only CPU; :mod:`memfit.precision.kernels`)."""
        if self.is_declared_island(module):
            return True
        if not self.mixed:
            return False
        no_kernel = missing_kernel_types(kernel_device(module), self.compute_dtype)
        return bool(no_kernel) and isinstance(module, no_kernel)

    def is_declared_island(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the types in :attr:`fp32_islands`."""
        return bool(self.fp32_islands) and isinstance(module, self.fp32_islands)

    def check_device(self, device: torch.device | str) -> None:
        """Raise if ``device`` cannot compute in this policy's dtype; warn when it is slow
        (fp16 on a CPU; bf16 on a CPU whose bf16 matmul measures slower than fp32's)."""
        import warnings

        device = torch.device(device)
        if not self.mixed:
            return
        if device.type == "cuda":
            if self.compute_dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                name = torch.cuda.get_device_name(device)
                raise ConfigError(
                    f"{name} cannot compute in bf16 (needs compute capability 8.0+); "
                    f"use precision='fp16-mixed' instead of {self.mode!r}"
                )
        elif device.type == "cpu" and self.compute_dtype is torch.float16:
            warnings.warn(
                f"precision {self.mode!r} on CPU: fp16 matmul is very slow on most CPUs; "
                "use 'bf16-mixed' unless you are testing the fp16 path",
                stacklevel=3,
            )
        elif device.type == "cpu":
            # Measured (once per process), not assumed from the CPU's name.
            from memfit.precision.speed import warn_if_slow

            warn_if_slow(self.mode, self.compute_dtype, device)

    def __str__(self) -> str:
        return self.mode
