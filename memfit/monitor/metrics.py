"""Training metrics beyond what the engine reads every ``log_every`` steps.

Everything here that touches tensors works on the device and leaves the values there; the
host reads them only in the methods documented as syncing (``ActivationRanges.read``,
``gradient_underflow``, ``grad_norm_stats``, ``first_nonfinite``). Those are meant to be
called at logging time, not every step.

Metric names follow the engine's: ``<group>/<name>``, e.g. ``amp/overflow_rate_recent``,
``grad/underflow_fraction``, ``memory/kind/activations``. See ``docs/monitoring.md``.
Throughput and recompute overhead live in :mod:`memfit.monitor.throughput` and are
importable from here too.

Example::

    ranges = ActivationRanges(model, ["blocks.0", "blocks.1", "head"], every=10)
    ...  # train
    values = ranges.read()                 # {"blocks.0": 12.5, ...} (one sync)
    for unit, value in near_fp16_limit(values):
        print(f"{unit} reaches {value:g}, close to fp16's 65504")
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.errors import ConfigError
from memfit.monitor.throughput import (
    Throughput,
    count_flops,
    recompute_overhead_from_flops,
    recompute_overhead_from_time,
)
from memfit.nested import tensors
from memfit.precision.scaler import FP16_MAX, suggest_initial_scale

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "ActivationRanges",
    "GradNormStats",
    "OverflowWindow",
    "Throughput",
    "UnderflowStats",
    "activation_metrics",
    "count_flops",
    "first_nonfinite",
    "grad_norm_stats",
    "gradient_underflow",
    "memory_metrics",
    "near_fp16_limit",
    "plan_metrics",
    "recompute_overhead_from_flops",
    "recompute_overhead_from_time",
    "suggest_initial_scale",
]

FP16_MIN_NORMAL = 2.0**-14
"""Smallest positive normal fp16 value; below it values are subnormal and lose bits."""
FP16_MIN_SUBNORMAL = 2.0**-24
"""Smallest positive fp16 value (subnormal)."""


#: Old names of the initial-scale rule's constants, now :mod:`memfit.precision.scaler`'s.
_MOVED = {
    "SCALE_HEADROOM": "INITIAL_SCALE_HEADROOM",
    "MIN_SUGGESTED_SCALE": "MIN_SCALE",
    "MAX_SUGGESTED_SCALE": "MAX_SCALE",
}


def __getattr__(name: str) -> float:
    if name in _MOVED:
        from memfit.deprecations import warn_renamed
        from memfit.precision import scaler

        warn_renamed(f"memfit.monitor.metrics.{name}", f"memfit.precision.scaler.{_MOVED[name]}")
        return float(getattr(scaler, _MOVED[name]))
    raise AttributeError(f"module 'memfit.monitor.metrics' has no attribute {name!r}")


# ---------------------------------------------------------------------- activation ranges


def _floating_tensors(value: Any) -> list[torch.Tensor]:
    """The non-empty floating-point tensors in a module's output, however nested."""
    return [t for t in tensors(value) if t.is_floating_point() and t.numel() > 0]


class ActivationRanges:
    """Track each named module's largest absolute output value, on the device.

    Forward hooks on ``units`` (qualified module names, ``""`` for the model itself) record,
    on every ``every``-th call of ``model``'s forward (the first call included), the largest
    ``|x|`` over every floating-point tensor in each unit's output (nested tuples, lists,
    dicts and dataclasses too, see :func:`memfit.nested.tensors`). The running maximum since the last :meth:`read` stays in a 0-dim fp32
    tensor on the output's device: no host sync in the hooks.

    The hooks run under ``torch.no_grad()`` and return nothing, so outputs and gradients
    are unchanged. A sampled forward costs one fused min/max reduction per output tensor
    and allocates nothing the size of the activation. Modules recomputed by activation
    checkpointing during backward are recorded again; the maximum is the same value.
    Forwards without gradients (evaluation) are neither counted nor recorded.

    A NaN anywhere in a unit's output makes its value NaN and an inf makes it inf, both of
    which :func:`near_fp16_limit` reports.

    Example::

        ranges = ActivationRanges(model, ["blocks.0.mlp", "blocks.1.mlp"], every=10)
        for batch in loader:
            engine.train_step(batch, loss_fn)
        print(near_fp16_limit(ranges.read()))   # [("blocks.1.mlp", 41210.0)]
        ranges.remove()
    """

    def __init__(self, model: nn.Module, units: Sequence[str], every: int = 10) -> None:
        if int(every) != every or every < 1:
            raise ConfigError(f"every must be an int >= 1, got {every}")
        if isinstance(units, str):
            raise ConfigError(f"units must be a list of module names, got the string {units!r}")
        model = unwrap_compiled(model)  # names as in the model, not its torch.compile wrapper
        names = dict(model.named_modules())
        unknown = [u for u in units if u not in names]
        if unknown:
            sample = ", ".join(repr(n) for n in list(names)[:8])
            raise ConfigError(
                f"no module named {unknown} in the model; use qualified names from "
                f"model.named_modules(), e.g. {sample}"
            )
        self.units: list[str] = list(dict.fromkeys(units))
        self.every = int(every)
        self.calls = 0
        """Calls of the model's forward seen so far."""
        self._active = False
        self._max: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        # The root's pre-hook runs before any unit's hook in the same forward, so it decides
        # for the whole call whether this forward is sampled.
        self._handles.append(model.register_forward_pre_hook(self._count))
        for name in self.units:
            self._handles.append(names[name].register_forward_hook(self._recorder(name)))

    def _count(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            # An evaluation forward (eval_context, generate): the ranges describe training.
            self._active = False
            return
        self._active = self.calls % self.every == 0
        self.calls += 1

    def _recorder(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            with torch.no_grad():
                for t in _floating_tensors(output):
                    # aminmax is one pass without an |x| temporary; it propagates NaN.
                    low, high = torch.aminmax(t.detach())
                    value = torch.maximum(low.abs(), high.abs()).float()
                    prev = self._max.get(name)
                    if prev is None:
                        self._max[name] = value
                    else:
                        self._max[name] = torch.maximum(prev, value.to(prev.device))

        return hook

    def read(self, reset: bool = True) -> dict[str, float]:
        """Each recorded unit's largest ``|output|`` since the last reset (one host sync).

        Units not called in a sampled forward since then are left out.
        """
        if not self._max:
            return {}
        names = list(self._max)
        device = self._max[names[0]].device
        values = torch.stack([self._max[n].to(device) for n in names]).tolist()
        if reset:
            self._max.clear()
        return dict(zip(names, values))

    @staticmethod
    def near_fp16_limit(
        values: Mapping[str, float], margin: float = 0.5
    ) -> list[tuple[str, float]]:
        """See :func:`near_fp16_limit`."""
        return near_fp16_limit(values, margin)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Forwards inside the block leave no trace: afterwards the count of forwards and
        the maxima are as before it. The hooks still run, so a timing of the block (the
        Engine's ``precision="auto"``) still pays what they cost in training.

        Example::

            with ranges.unrecorded():
                model(x).sum().backward()   # ranges.calls unchanged
        """
        calls, active, kept = self.calls, self._active, dict(self._max)
        try:
            yield
        finally:
            self.calls, self._active, self._max = calls, active, kept

    def remove(self) -> None:
        """Remove every hook; recorded values are kept until read."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ActivationRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def near_fp16_limit(values: Mapping[str, float], margin: float = 0.5) -> list[tuple[str, float]]:
    """Units whose largest ``|output|`` is at least ``margin × 65504`` (or not finite).

    Sorted by value, largest first. ``margin=0.5`` leaves a factor of two before fp16's
    maximum, since activations grow as training goes on.

    Example::

        near_fp16_limit({"mlp": 40000.0, "attn": 12.0})   # [("mlp", 40000.0)]
    """
    if not 0.0 < margin <= 1.0:
        raise ConfigError(f"margin must be in (0, 1], got {margin}")
    limit = margin * FP16_MAX
    hits = [(k, float(v)) for k, v in values.items() if not math.isfinite(v) or v >= limit]
    # NaN sorts first: it is the worst case.
    return sorted(
        hits, key=lambda kv: (math.isnan(kv[1]), 0.0 if math.isnan(kv[1]) else kv[1]), reverse=True
    )


def activation_metrics(values: Mapping[str, float]) -> dict[str, float]:
    """``ActivationRanges.read()`` values as metrics: ``act/max/<unit>`` for each unit and
    ``act/max_fp16_fraction``, the largest of them divided by 65504.

    Example::

        activation_metrics({"mlp": 32752.0})   # {"act/max/mlp": 32752.0, "act/max_fp16_fraction": 0.5}
    """
    out = {f"act/max/{k}": float(v) for k, v in values.items()}
    if values:
        worst = max(values.values(), key=lambda v: math.inf if math.isnan(v) else v)
        out["act/max_fp16_fraction"] = float(worst) / FP16_MAX
    return out


# ---------------------------------------------------------------------- gradient underflow


@dataclass(frozen=True)
class UnderflowStats:
    """How many gradient elements a loss scale leaves below fp16's range.

    Example::

        stats = gradient_underflow([p.grad for p in model.parameters()], scale=8192.0)
        stats.fraction, stats.suggested_scale
    """

    nonzero: int
    """Non-zero gradient elements counted."""
    below_subnormal: int
    """Non-zero elements with ``|g × scale| < 2**-24`` (lost in fp16, see :func:`gradient_underflow`)."""
    below_normal: int
    """Non-zero elements with ``|g × scale| < 2**-14`` (subnormal or lost: fewer than 11 bits)."""
    max_abs: float
    """Largest ``|g|`` (unscaled); inf or NaN when a gradient is not finite."""
    scale: float
    """The loss scale the counts are for."""
    suggested_scale: float
    """:func:`~memfit.precision.scaler.suggest_initial_scale` of ``max_abs``: the largest
    power of two keeping ``max_abs × scale ≤ FP16_MAX / 8``, within ``[1, 2**24]``."""

    @property
    def fraction(self) -> float:
        """``below_subnormal / nonzero`` (0 when every gradient is zero)."""
        return self.below_subnormal / self.nonzero if self.nonzero else 0.0

    @property
    def fraction_below_normal(self) -> float:
        """``below_normal / nonzero`` (0 when every gradient is zero)."""
        return self.below_normal / self.nonzero if self.nonzero else 0.0

    def to_metrics(self) -> dict[str, float]:
        """As metrics: ``grad/underflow_fraction``, ``grad/subnormal_fraction``,
        ``grad/max_abs`` and ``amp/suggested_scale``."""
        return {
            "grad/underflow_fraction": self.fraction,
            "grad/subnormal_fraction": self.fraction_below_normal,
            "grad/max_abs": self.max_abs,
            "amp/suggested_scale": self.suggested_scale,
        }


def gradient_underflow(
    grads: Iterable[torch.Tensor], scale: float | torch.Tensor
) -> UnderflowStats:
    """Count the non-zero *unscaled* gradient elements that ``scale`` leaves below fp16's range.

    An element underflows when ``|g × scale| < 2**-24``, fp16's smallest subnormal. Values
    below ``2**-25`` round to zero and the ones between round to ``2**-24`` itself, an error
    of up to 100%, so below ``2**-24`` the gradient is lost either way. The count below
    the smallest *normal*, ``2**-14``, is also given: those survive as subnormals with
    fewer than 11 significant bits.

    Call it on unscaled gradients (after ``LossScaler.unscale_``, or from an fp32 run when
    choosing a scale). All counting runs on the device; the result is read in one host
    sync at the end. It allocates one ``|g|`` temporary per gradient (fp32 for 16-bit ones).
    ``None`` entries are ignored, sparse gradients count their stored values.

    Example::

        stats = gradient_underflow([p.grad for p in model.parameters()], scaler.get_scale())
        if stats.fraction > 0.01:
            print(f"raise the scale to {stats.suggested_scale:g}")
    """
    tensors = []
    for g in grads:
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        if g.is_floating_point() and g.numel() > 0:
            tensors.append(g.detach())
    scale_value = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    if not tensors:
        value = float(scale_value)
        return UnderflowStats(0, 0, 0, 0.0, value, suggest_initial_scale(0.0))
    device = tensors[0].device
    scale_t = scale_value.detach().to(device=device, dtype=torch.float64).reshape(())
    # Compare |g| with bound/scale rather than forming g*scale: no second temporary.
    sub_bound = FP16_MIN_SUBNORMAL / scale_t
    normal_bound = FP16_MIN_NORMAL / scale_t
    rows = []
    for g in tensors:
        a = g.abs()
        if a.dtype in (torch.float16, torch.bfloat16):
            a = a.float()  # bounds like 2**-24/scale may not exist in 16 bits
        bound_dtype = a.dtype
        nonzero = a > 0
        rows.append(
            torch.stack(
                [
                    torch.count_nonzero(nonzero).double(),
                    torch.count_nonzero(nonzero & (a < sub_bound.to(bound_dtype))).double(),
                    torch.count_nonzero(nonzero & (a < normal_bound.to(bound_dtype))).double(),
                    a.amax().double(),
                ]
            ).to(device)
        )
    table = torch.stack(rows)
    counts = table[:, :3].sum(dim=0)
    max_abs = table[:, 3].max()
    values = torch.cat([counts, max_abs.reshape(1), scale_t.reshape(1)]).tolist()  # the sync
    nonzero_n, below_sub, below_norm, max_abs_v, scale_v = values
    return UnderflowStats(
        nonzero=int(nonzero_n),
        below_subnormal=int(below_sub),
        below_normal=int(below_norm),
        max_abs=max_abs_v,
        scale=scale_v,
        suggested_scale=suggest_initial_scale(max_abs_v),
    )


# ---------------------------------------------------------------------- gradient norms


@dataclass(frozen=True)
class GradNormStats:
    """The total gradient norm and how it spreads over parameters.

    Example::

        stats = grad_norm_stats({n: p.grad for n, p in model.named_parameters()})
        print(stats.largest, stats.max)
    """

    total: float
    """L2 norm of all gradients together (what ``clip_grad_norm_`` computes)."""
    min: float
    """Smallest per-parameter L2 norm."""
    median: float
    """Median per-parameter L2 norm (linear interpolation)."""
    p90: float
    """90th percentile of the per-parameter L2 norms (linear interpolation)."""
    max: float
    """Largest per-parameter L2 norm."""
    largest: str
    """Name of the parameter with the largest norm (the first non-finite one if any is)."""
    count: int
    """Number of gradients counted."""

    def to_metrics(self) -> dict[str, float]:
        """As metrics: ``grad/norm_total``, ``grad/norm_min``, ``grad/norm_median``,
        ``grad/norm_p90``, ``grad/norm_max`` (the name is not a number; read ``largest``)."""
        return {
            "grad/norm_total": self.total,
            "grad/norm_min": self.min,
            "grad/norm_median": self.median,
            "grad/norm_p90": self.p90,
            "grad/norm_max": self.max,
        }


def _present(named_grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    out = {}
    for name, g in named_grads.items():
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        out[name] = g.detach()
    return out


def _per_tensor_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 L2 norms, one per tensor, on the first tensor's device (no sync)."""
    device = grads[0].device
    norms: list[torch.Tensor | None] = [None] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    for (_, _), idx in groups.items():
        # One fused kernel launch per device/dtype group, as clip_grad_norm_ does.
        # Accumulate in fp32: a 16-bit sum of squares loses the norm's low bits.
        results = torch._foreach_norm([grads[i] for i in idx], 2.0, dtype=torch.float32)
        for i, n in zip(idx, results):
            norms[i] = n.float().to(device)
    return torch.stack(norms)  # type: ignore[arg-type]


def grad_norm_stats(named_grads: Mapping[str, torch.Tensor | None]) -> GradNormStats:
    """Total gradient norm, the per-parameter norm distribution and the largest parameter.

    Norms are computed on the device in fp32 and read in one host sync. ``None`` gradients
    are skipped. Call it after unscaling, before ``zero_grad``.

    Example::

        stats = grad_norm_stats({n: p.grad for n, p in model.named_parameters()})
        metrics.update(stats.to_metrics())
    """
    present = _present(named_grads)
    if not present:
        raise ConfigError(
            "no gradients to measure: every entry is None; call grad_norm_stats after backward "
            "and before zero_grad"
        )
    names = list(present)
    norms = _per_tensor_norms(list(present.values()))
    total = torch.linalg.vector_norm(norms)
    # Ranking by norm with NaN as +inf names a non-finite parameter as the largest.
    rank = torch.where(torch.isnan(norms), torch.full_like(norms, math.inf), norms)
    q = torch.quantile(norms, torch.tensor([0.0, 0.5, 0.9, 1.0], device=norms.device))
    packed = torch.cat([total.reshape(1), q, rank.argmax().float().reshape(1)])
    total_v, lo, med, p90, hi, index = packed.tolist()  # the sync
    return GradNormStats(
        total=total_v,
        min=lo,
        median=med,
        p90=p90,
        max=hi,
        largest=names[int(index)],
        count=len(names),
    )


def first_nonfinite(named_grads: Mapping[str, torch.Tensor | None]) -> str | None:
    """Name of the first gradient (in the mapping's order) holding an inf or NaN, else None.

    One host sync. Use it to name the module that overflowed after a skipped step.

    Example::

        bad = first_nonfinite({n: p.grad for n, p in model.named_parameters()})
    """
    present = _present(named_grads)
    if not present:
        return None
    tensors = list(present.values())
    device = tensors[0].device
    flags = []
    for g in tensors:
        if not g.is_floating_point() or g.numel() == 0:
            flags.append(torch.zeros((), dtype=torch.bool, device=device))
            continue
        low, high = torch.aminmax(g)  # NaN and inf both show up in min/max
        flags.append((~torch.isfinite(low) | ~torch.isfinite(high)).to(device))
    bad = torch.stack(flags).nonzero()
    if bad.numel() == 0:  # the sync
        return None
    return list(present)[int(bad[0, 0])]


# ---------------------------------------------------------------------- overflow window


class OverflowWindow:
    """The skip rate over the last ``size`` optimizer steps, kept on the host.

    Feed it per-step flags with :meth:`push`, or the cumulative counters the engine reads
    every ``log_every`` steps with :meth:`update` (``step`` and ``amp/skipped``). Between
    two reads only the count of skips is known, not their order; when more steps than
    ``size`` passed, the window is filled in the same proportion.

    Example::

        window = OverflowWindow(size=100)
        window.update(steps=m["step"], skipped=m["amp/skipped"])
        m.update(window.metrics())   # {"amp/overflow_rate_recent": ...}
    """

    def __init__(self, size: int = 100) -> None:
        if int(size) != size or size < 1:
            raise ConfigError(f"size must be an int >= 1, got {size}")
        self.size = int(size)
        self._flags: deque[bool] = deque(maxlen=self.size)
        self._last: tuple[int, int] | None = None

    def push(self, skipped: bool) -> None:
        """Record one optimizer step: True where it was skipped."""
        self._flags.append(bool(skipped))

    def update(self, steps: float, skipped: float) -> None:
        """Record the steps since the last call from the cumulative step and skip counters."""
        steps_i, skipped_i = int(steps), int(skipped)
        if skipped_i < 0 or skipped_i > steps_i:
            raise ConfigError(f"skipped steps ({skipped_i}) must be within 0..steps ({steps_i})")
        last_steps, last_skipped = self._last if self._last is not None else (0, 0)
        self._last = (steps_i, skipped_i)
        d_steps, d_skipped = steps_i - last_steps, skipped_i - last_skipped
        if d_steps < 0 or d_skipped < 0 or d_skipped > d_steps:
            # Counters went back (a resumed or restarted run): start the window afresh.
            self._flags.clear()
            d_steps, d_skipped = steps_i, skipped_i
        if d_steps > self.size:
            d_skipped = round(d_skipped * self.size / d_steps)
            d_steps = self.size
        # Skips first, clean steps after: the order is unknown, the count is what matters.
        self._flags.extend([True] * d_skipped + [False] * (d_steps - d_skipped))

    @property
    def steps(self) -> int:
        """Steps in the window (at most ``size``)."""
        return len(self._flags)

    @property
    def rate(self) -> float:
        """Skipped / steps in the window (0 when empty)."""
        return sum(self._flags) / len(self._flags) if self._flags else 0.0

    def metrics(self) -> dict[str, float]:
        """``{"amp/overflow_rate_recent": rate}``."""
        return {"amp/overflow_rate_recent": self.rate}


# ---------------------------------------------------------------------- memory


def _dtype_name(dtype: str) -> str:
    return dtype.removeprefix("torch.")


def memory_metrics(report: Any) -> dict[str, float]:
    """A :class:`memfit.memory.MemoryReport` (or its ``to_dict()``) as metrics.

    Keys: ``memory/peak_bytes``, ``memory/kind/<kind>`` (params, grads, optimizer,
    activations, temp), ``memory/dtype/<dtype>`` (``float32``, ``bfloat16``, ...) and
    ``memory/low_precision_share``. No tensors are touched.

    Example::

        metrics.update(memory_metrics(memfit.measure(step, model=model, optimizer=opt)))
    """
    data = report if isinstance(report, Mapping) else None
    get = data.get if data is not None else (lambda k, d=None: getattr(report, k, d))
    peak = get("peak_bytes")
    if peak is None:
        raise ConfigError(
            f"memory_metrics needs a MemoryReport (from memfit.measure), got {type(report).__name__}"
        )
    out: dict[str, float] = {"memory/peak_bytes": float(peak)}
    for kind, n in (get("by_kind") or {}).items():
        out[f"memory/kind/{kind}"] = float(n)
    for dtype, n in (get("by_dtype") or {}).items():
        out[f"memory/dtype/{_dtype_name(str(dtype))}"] = float(n)
    share = get("low_precision_share")
    if share is not None:
        out["memory/low_precision_share"] = float(share)
    return out


def plan_check_metrics(check: Any) -> dict[str, float]:
    """The closed loop's metrics from a ``PlanCheck`` (none before the first planned step).

    Example::

        metrics.update(plan_check_metrics(engine.plan_check))
    """
    if check is None:
        return {}
    return {
        "plan/predicted_peak_bytes": float(check.predicted_peak_bytes),
        "plan/measured_peak_bytes": float(check.measured_peak_bytes),
        "plan/replanned": float(check.replanned),
    }


def plan_metrics(plan: Any) -> dict[str, float]:
    """A checkpoint :class:`memfit.Plan`'s prediction and cost as metrics (``plan/...``),
    for the callbacks of other training loops. No tensors are touched.

    Example::

        metrics.update(plan_metrics(plan))   # {"plan/predicted_peak_bytes": ..., ...}
    """
    out = {
        "plan/predicted_peak_bytes": float(plan.predicted_peak_bytes),
        "plan/static_bytes": float(plan.static_bytes),
        "plan/kept_bytes": float(plan.kept_bytes),
        "plan/transient_bytes": float(plan.transient_bytes),
        "plan/recomputed_units": float(sum(d != "keep" for d in plan.decisions.values())),
        "plan/recompute_flops": float(plan.recompute_flops),
    }
    if plan.budget_bytes is not None:
        out["plan/budget_bytes"] = float(plan.budget_bytes)
    return out
