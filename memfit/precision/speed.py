"""How fast the device computes in each dtype: a short matmul probe, measured, not assumed.

CPUs differ more than their names say: one with native bf16 instructions runs a bf16
matmul 1.7-2.7x faster than fp32, one without runs it at a fraction of fp32's speed, and
then ``bf16-mixed`` trains several times slower than ``fp32``. The probe times one square
matmul per dtype (a warm-up, then the fastest of a few turns) and reports each dtype's
speed relative to fp32 (``speedup``: above 1 is faster). It is measured once per process
and device, and cached.

``precision="auto"`` decides from the probe (:func:`choose_precision`) and then, where
the probe does not settle it (:func:`probe_settles`), from the model's own seconds per
mode (:func:`choose_from_model`; the Engine times them).

Tests, and anyone who knows better, inject the numbers instead (:func:`assumed_speed`,
and the model's seconds with :func:`assumed_model_seconds`): a decision that depends on
speed is then made from those numbers, never from the machine's timing or the CPU's name.

Example::

    speed = matmul_speed("cpu")
    speed.speedup(torch.bfloat16)        # 2.4 here: bf16 is faster
    with assumed_speed("cpu", {torch.bfloat16: 0.21}):
        matmul_speed("cpu").speedup(torch.bfloat16)   # 0.21
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.errors import ConfigError

__all__ = [
    "MatmulSpeed",
    "PrecisionChoice",
    "assumed_model_seconds",
    "assumed_speed",
    "auto_candidates",
    "choose_from_model",
    "choose_precision",
    "expand_precisions",
    "matmul_speed",
    "measure_matmul_speed",
    "model_seconds_assumed",
    "probe_settles",
    "slow_dtype_warning",
    "warn_if_slow",
]

#: The probe's matmul side: large enough that the kernel's speed shows (not the call's
#: overhead), small enough to take a few milliseconds on a 2-core CPU. A GPU gets a larger
#: one: at 512 its kernels finish in microseconds and the launch would be timed instead.
PROBE_SIZE = 512
CUDA_PROBE_SIZE = 4096
PROBE_REPEATS = 8

#: Below this speedup a 16-bit mode is called slow (it loses the numerics and gains no time).
SLOW_BELOW = 1.0


@dataclass(frozen=True)
class MatmulSpeed:
    """Seconds of one probe matmul per dtype on a device, and their ratios to fp32."""

    device: str
    """The device type the probe ran on (``"cpu"``, ``"cuda"``)."""
    seconds: dict[torch.dtype, float] = field(default_factory=dict)
    """Seconds of one :data:`PROBE_SIZE`-sided matmul per dtype (fp32 included) at the
    measured rate (a GPU is measured on a larger one)."""
    flop_rate: dict[torch.dtype, float] = field(default_factory=dict)
    """FLOP/s of the probe per dtype."""
    measured: bool = True
    """False when the numbers were injected (:func:`assumed_speed`)."""

    def speedup(self, dtype: torch.dtype) -> float:
        """fp32's time over ``dtype``'s: 2.0 means twice as fast as fp32, 0.5 half as fast.

        Example::

            matmul_speed("cpu").speedup(torch.bfloat16)
        """
        if dtype == torch.float32:
            return 1.0
        return self.flop_rate[dtype] / self.flop_rate[torch.float32]

    def rate(self, dtype: torch.dtype) -> float:
        """The probe's FLOP/s in ``dtype``."""
        return self.flop_rate[dtype]


_CACHE: dict[tuple[str, torch.dtype], float] = {}  # FLOP/s per device type and dtype
_ASSUMED: list[tuple[str, MatmulSpeed]] = []
_WARNED: set[tuple[str, str]] = set()


def _operands(device: torch.device, dtype: torch.dtype, size: int) -> tuple[Any, Any]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    return a, b


def measure_matmul_speed(
    device: str | torch.device = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    *,
    size: int | None = None,
    repeats: int = PROBE_REPEATS,
) -> MatmulSpeed:
    """Time one ``size`` x ``size`` matmul in fp32 and each of ``dtypes`` on ``device``
    (no cache: :func:`matmul_speed` is the cached one).

    The dtypes take turns, ``repeats`` rounds after a warm-up, and each keeps its fastest
    run: on a shared machine another process's burst slows some runs, never speeds one
    up, so the fastest is the kernel's own speed and the turns expose every dtype alike.

    Example::

        measure_matmul_speed("cpu").speedup(torch.bfloat16)
    """
    device = torch.device(device)
    size = size or (CUDA_PROBE_SIZE if device.type == "cuda" else PROBE_SIZE)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    every = (torch.float32, *(dt for dt in dtypes if dt != torch.float32))
    operands = {dt: _operands(device, dt, size) for dt in every}
    for a, b in operands.values():
        a @ b  # warm-up: kernel selection, lazy initialisation
    sync()
    best = dict.fromkeys(every, float("inf"))
    for _ in range(repeats):
        for dt, (a, b) in operands.items():
            start = time.perf_counter()
            a @ b
            sync()
            best[dt] = min(best[dt], time.perf_counter() - start)
    flops = 2.0 * size**3
    return MatmulSpeed(device.type, best, {dt: flops / s for dt, s in best.items()})


def matmul_speed(
    device: str | torch.device = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> MatmulSpeed:
    """The probe's speeds on ``device``: injected ones when :func:`assumed_speed` is
    active for its type, else measured once per process and dtype and cached.

    Example::

        if matmul_speed(device).speedup(torch.bfloat16) < 1:
            precision = "fp32"
    """
    kind = torch.device(device).type
    for assumed_kind, speed in reversed(_ASSUMED):
        if assumed_kind == kind:
            return speed
    wanted = (torch.float32, *dtypes)
    missing = [dt for dt in wanted if (kind, dt) not in _CACHE]
    if missing:
        fresh = measure_matmul_speed(device, tuple(dt for dt in missing if dt != torch.float32))
        for dt, rate in fresh.flop_rate.items():
            _CACHE.setdefault((kind, dt), rate)
    rates = {dt: _CACHE[(kind, dt)] for dt in wanted}
    seconds = {dt: 2.0 * PROBE_SIZE**3 / r for dt, r in rates.items()}
    return MatmulSpeed(kind, seconds, rates)


@contextlib.contextmanager
def assumed_speed(
    device: str,
    speedups: Mapping[torch.dtype, float],
    fp32_flop_rate: float = 1e11,
) -> Iterator[MatmulSpeed]:
    """Inside the block, :func:`matmul_speed` on ``device`` gives these numbers instead
    of measuring: ``speedups`` maps a dtype to its speed relative to fp32 (0.21: about
    five times slower), ``fp32_flop_rate`` is fp32's FLOP/s.

    Example::

        with assumed_speed("cpu", {torch.bfloat16: 0.21}):
            engine.train_step(batch, loss_fn)   # precision="auto" chooses fp32
    """
    kind = torch.device(device).type
    base = 2.0 * PROBE_SIZE**3 / fp32_flop_rate
    seconds = {torch.float32: base, **{dt: base / float(s) for dt, s in speedups.items()}}
    speed = MatmulSpeed(
        kind, seconds, {dt: 2.0 * PROBE_SIZE**3 / s for dt, s in seconds.items()}, False
    )
    _ASSUMED.append((kind, speed))
    try:
        yield speed
    finally:
        _ASSUMED.remove((kind, speed))


def slow_dtype_warning(mode: str, dtype: torch.dtype, device: str, speedup: float) -> str:
    """The message for a 16-bit mode asked for where its matmul is slower than fp32's."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return (
        f"precision {mode!r} on {device}: a {name} matmul measured {speedup:.2f}x the speed "
        f"of fp32 here (this {device} has no fast {name} instructions), so {mode} trains "
        f"slower than fp32; use precision='fp32' (or 'auto', which measures and chooses)"
    )


def warn_if_slow(mode: str, dtype: torch.dtype, device: str | torch.device) -> float | None:
    """Warn (``UserWarning``) when ``dtype``'s matmul on a CPU ``device`` is slower than
    fp32's; return the measured speedup (None where nothing was measured: fp32, CUDA).

    Example::

        warn_if_slow("bf16-mixed", torch.bfloat16, "cpu")
    """
    kind = torch.device(device).type
    if dtype == torch.float32 or kind != "cpu":
        return None
    speed = matmul_speed(kind, (dtype,))
    speedup = speed.speedup(dtype)
    # Once per process and mode for a measured speed (the CLI and the Engine both check);
    # every time for injected numbers, which tests give.
    if speedup < SLOW_BELOW and (not speed.measured or (mode, kind) not in _WARNED):
        _WARNED.add((mode, kind))
        warnings.warn(slow_dtype_warning(mode, dtype, kind, speedup), UserWarning, stacklevel=3)
    return speedup


#: A 16-bit autocast mode is chosen over fp32 only when it is at least this much faster
#: (the model's measured ratio, or the probe's where the model is not timed): a mode that
#: gains nothing keeps fp32's numerics.
AUTO_MARGIN = 1.1

#: A probe ratio below this settles ``precision="auto"`` on fp32 without timing the model:
#: autocast computes the matmuls and convolutions in 16 bits and leaves the rest in fp32,
#: so a model cannot gain 1.1x from a 16-bit mode whose matmul runs at half fp32's speed.
PREFILTER_BELOW = 0.5


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``precision="auto"`` chose, and from which measurement."""

    mode: str
    """The mode chosen (``"fp32"``, ``"bf16-mixed"`` or, where bf16 is missing, ``"fp16-mixed"``)."""
    speedups: dict[str, float]
    """Each candidate mode's matmul speed relative to fp32 (the probe)."""
    measured: bool
    """False when the probe's speeds were injected (:func:`assumed_speed`)."""
    model_seconds: dict[str, float] = field(default_factory=dict)
    """Each candidate's fastest forward and backward of the model's first micro-batch
    (empty where the model was not timed)."""
    model_measured: bool = True
    """False when the model's seconds were injected (:func:`assumed_model_seconds`)."""
    timing_seconds: float = 0.0
    """Wall seconds the model's timing added to the first step (warm-ups included)."""
    model_timing: str = "forward+backward of the first micro-batch"
    """What ``model_seconds`` timed."""
    note: str = ""
    """Why the model was not timed, where it was not (the choice is then the probe's)."""

    @property
    def model_speedup(self) -> float | None:
        """The 16-bit candidate's measured speed relative to fp32 on the model (None where
        the model was not timed)."""
        if not self.model_seconds:
            return None
        low = [m for m in self.model_seconds if m != "fp32"][0]
        return self.model_seconds["fp32"] / self.model_seconds[low]

    def describe(self) -> str:
        """One line: the choice and what it was made from.

        Example::

            engine.auto.precision_choice.describe()
            # precision auto: bf16-mixed (forward+backward of the first micro-batch, measured:
            # fp32 41.20 ms, bf16-mixed 25.10 ms = 1.64x, timing added 0.41 s; matmul probe,
            # measured: bf16-mixed 2.40x)
        """
        probe = ", ".join(f"{m} {s:.2f}x" for m, s in self.speedups.items() if m != "fp32")
        source = "measured" if self.measured else "assumed"
        if self.model_seconds:
            times = ", ".join(f"{m} {s * 1e3:.2f} ms" for m, s in self.model_seconds.items())
            model_source = "measured" if self.model_measured else "assumed"
            return (
                f"precision auto: {self.mode} ({self.model_timing}, "
                f"{model_source}: {times} = {self.model_speedup:.2f}x, timing added "
                f"{self.timing_seconds:.2f} s; matmul probe, {source}: {probe})"
            )
        ratios = ", ".join(f"{m} {s:.2f}x" for m, s in self.speedups.items())
        why = f"; model not timed: {self.note}" if self.note else ""
        return f"precision auto: {self.mode} (matmul speed vs fp32, {source}: {ratios}{why})"


def auto_candidates(device: str | torch.device) -> tuple[str, ...]:
    """The modes ``precision="auto"`` chooses from on ``device``: fp32 and the autocast
    mode the device can compute in (weights stay fp32, so the numerics stay safe):
    ``bf16-mixed``, or ``fp16-mixed`` (with dynamic loss scaling) on a GPU without bf16.

    Example::

        auto_candidates("cpu")  # ("fp32", "bf16-mixed")
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ("fp32", "fp16-mixed")
    return ("fp32", "bf16-mixed")


def expand_precisions(precisions: Sequence[Any], device: str | torch.device = "cpu") -> list[str]:
    """Each precision resolved to its mode, ``"auto"`` to the modes it chooses between on
    ``device`` (:func:`auto_candidates`): for the tools that compare modes (estimate, the
    tuner) rather than train in one. Order kept, repeats dropped.

    Example::

        expand_precisions(["auto", "bf16-master"])   # ["fp32", "bf16-mixed", "bf16-master"]
    """
    from memfit.precision.policy import PrecisionPolicy, is_auto

    modes: list[str] = []
    for p in precisions:
        for mode in auto_candidates(device) if is_auto(p) else (PrecisionPolicy.of(p).mode,):
            if mode not in modes:
                modes.append(mode)
    return modes


def choose_precision(device: str | torch.device) -> PrecisionChoice:
    """The fastest safe autocast mode on ``device`` by the matmul probe: the 16-bit
    candidate when its matmul is at least :data:`AUTO_MARGIN` times fp32's speed, else fp32.

    Example::

        with assumed_speed("cpu", {torch.bfloat16: 0.21}):
            choose_precision("cpu").mode  # "fp32"
    """
    candidates = auto_candidates(device)
    low = torch.float16 if "fp16-mixed" in candidates else torch.bfloat16
    speed = matmul_speed(device, (low,))
    speedups = {"fp32": 1.0, candidates[1]: speed.speedup(low)}
    mode = candidates[1] if speedups[candidates[1]] >= AUTO_MARGIN else "fp32"
    return PrecisionChoice(mode, speedups, speed.measured)


def choose_from_model(
    probe: PrecisionChoice, seconds: Mapping[str, float], *, measured: bool = True
) -> PrecisionChoice:
    """The probe's choice remade from the model's own seconds per candidate mode: the
    16-bit candidate when the model runs at least :data:`AUTO_MARGIN` times faster in it,
    else fp32, whatever the probe said.

    Example::

        probe = choose_precision("cpu")                     # bf16-mixed: its matmul 2.4x
        choose_from_model(probe, {"fp32": 1.0, "bf16-mixed": 1.3}).mode   # "fp32"
    """
    low = [m for m in probe.speedups if m != "fp32"][0]
    missing = [m for m in ("fp32", low) if m not in seconds]
    if missing:
        raise ConfigError(
            f"the model's seconds per mode {dict(seconds)} give none for {missing}; give "
            f"seconds for every candidate mode ({'fp32'!r} and {low!r} here)"
        )
    mode = low if seconds["fp32"] / seconds[low] >= AUTO_MARGIN else "fp32"
    times = {"fp32": float(seconds["fp32"]), low: float(seconds[low])}
    return replace(probe, mode=mode, model_seconds=times, model_measured=measured, note="")


def probe_settles(probe: PrecisionChoice, device: str | torch.device) -> str:
    """Why ``probe`` decides without timing the model (``""``: the model is to be timed):
    injected probe speeds (tests' deterministic choice) unless the model's seconds are
    injected too, or a 16-bit ratio below :data:`PREFILTER_BELOW`.

    Example::

        with assumed_speed("cpu", {torch.bfloat16: 0.21}):
            probe_settles(choose_precision("cpu"), "cpu")   # "... below 0.5x"
    """
    low = [m for m in probe.speedups if m != "fp32"][0]
    if probe.speedups[low] < PREFILTER_BELOW:
        return f"the {low} matmul runs at {probe.speedups[low]:.2f}x, below {PREFILTER_BELOW}x"
    if not probe.measured and model_seconds_assumed(device) is None:
        return "the probe's speeds are assumed"
    return ""


_ASSUMED_MODEL: list[tuple[str, dict[str, float]]] = []


@contextlib.contextmanager
def assumed_model_seconds(device: str, seconds: Mapping[str, float]) -> Iterator[None]:
    """Inside the block, ``precision="auto"`` on ``device`` decides from these seconds per
    candidate mode instead of the model's measured ones. The model still runs its timing
    passes (so a test sees everything they do); only the clock is not believed. The probe
    still runs first (inject it too, with :func:`assumed_speed`, for a choice that is
    the same on every machine).

    Example::

        with assumed_speed("cpu", {torch.bfloat16: 2.7}), assumed_model_seconds(
            "cpu", {"fp32": 1.0, "bf16-mixed": 1.3}
        ):
            engine.train_step(batch, loss_fn)   # fp32: the model is slower in bf16
    """
    bad = {
        m: s
        for m, s in seconds.items()
        if isinstance(s, bool) or not (isinstance(s, (int, float)) and s > 0)
    }
    if bad or not seconds:
        raise ConfigError(
            f"assumed_model_seconds takes positive seconds per mode, got {bad or dict(seconds)}; e.g. "
            "{'fp32': 1.0, 'bf16-mixed': 1.3}"
        )
    entry = (torch.device(device).type, {m: float(s) for m, s in seconds.items()})
    _ASSUMED_MODEL.append(entry)
    try:
        yield
    finally:
        _ASSUMED_MODEL.remove(entry)


def model_seconds_assumed(device: str | torch.device) -> dict[str, float] | None:
    """The seconds :func:`assumed_model_seconds` injects for ``device``'s type, if any."""
    kind = torch.device(device).type
    for assumed_kind, seconds in reversed(_ASSUMED_MODEL):
        if assumed_kind == kind:
            return seconds
    return None
