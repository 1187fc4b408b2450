"""Health checks: compare a run's metrics with the thresholds the field's practice suggests.

Each check is ``"pass"``, ``"warn"`` (with a one-line remedy) or ``"n/a"`` (with the reason:
the check does not apply to the precision mode, or the metric was not measured). The
defaults are the table in the design notes, plus two fp16-specific checks:

=============================  ==========================  ==================================
check                          metric                      healthy (default)
=============================  ==========================  ==================================
overflow rate                  ``amp/overflow_rate_recent``  ≤ 0.5% of steps skipped (fp16)
                               (else ``amp/overflow_rate``)
loss scale                     ``amp/scale``               above the scaler's minimum (fp16)
gradient underflow             ``grad/underflow_fraction``   ≤ 1% of non-zero elements (fp16)
activation range               ``act/max/<unit>``,         largest ``|activation|`` < 50% of
                               ``act/max_fp16_fraction``   65504 (fp16)
low-precision memory share     ``memory/low_precision_share``  ≥ 60% (mixed modes)
recompute overhead             ``recompute/overhead``      ≤ 35% extra step time (with a plan)
loss                           ``loss``                    finite
=============================  ==========================  ==================================

Example::

    checks = check_health(engine.metrics, "fp16-mixed")
    rich.print(render_health(checks))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy, resolve_mode

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "HealthCheck",
    "HealthThresholds",
    "Status",
    "check_health",
    "health_from_dict",
    "health_to_dict",
    "render_health",
]

Status = Literal["pass", "warn", "n/a"]

_FP16_MAX = 65504.0


@dataclass(frozen=True)
class HealthThresholds:
    """Where each health check turns from pass to warn. Fractions, not percents.

    Example::

        check_health(metrics, "fp16-mixed", HealthThresholds(max_overflow_rate=0.01))
    """

    max_overflow_rate: float = 0.005
    """Largest healthy share of skipped (overflowed) optimizer steps under fp16 (0.5%). A
    dynamic scaler probes upward every ``growth_interval`` steps and backs off once, so a
    rate of about ``1 / growth_interval`` is expected; much more means the scale or the
    model overflows often."""
    min_low_precision_share: float = 0.60
    """Smallest healthy share of peak memory held in 16-bit tensors under a mixed mode (60%).
    Below it most memory is fp32 and the precision mode saves less than it could."""
    max_recompute_overhead: float = 0.35
    """Largest healthy extra step time from activation checkpointing (35%): more and the
    run pays more in time than a smaller batch or micro-batching would."""
    min_loss_scale: float = 1.0
    """The scaler's ``min_scale``: a scale at or below it is pinned and cannot back off
    further (``extra={"min_scale": ...}`` overrides it per call)."""
    max_activation_fp16_fraction: float = 0.5
    """Largest healthy ``|activation| / 65504`` under fp16 (half of fp16's range, leaving a
    factor of two for activations to grow)."""
    max_gradient_underflow: float = 0.01
    """Largest healthy share of non-zero gradient elements that the loss scale leaves below
    fp16's smallest subnormal (1%). A few tiny gradients are always lost; a percent is
    where the lost signal starts to slow or bias training."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"HealthThresholds.{f.name} must be a number >= 0, got {value!r}")
        for name in (
            "max_overflow_rate",
            "min_low_precision_share",
            "max_activation_fp16_fraction",
            "max_gradient_underflow",
        ):
            if getattr(self, name) > 1:
                raise ConfigError(
                    f"HealthThresholds.{name} is a fraction in [0, 1], got {getattr(self, name)}; "
                    "write 0.005 for 0.5%"
                )


@dataclass(frozen=True)
class HealthCheck:
    """One health check's outcome.

    Example::

        HealthCheck("overflow rate", "warn", 0.02, 0.005, "<=", percent=True,
                    remedy="lower the loss scale's growth ...")
    """

    name: str
    """What is checked, e.g. ``"overflow rate"``."""
    status: Status
    """``"pass"``, ``"warn"`` or ``"n/a"``."""
    value: float | None = None
    """The measured value (None when not measured)."""
    threshold: float | None = None
    """The threshold it is compared with."""
    op: str = "<="
    """How a healthy value compares with the threshold: ``"<="``, ``">="``, ``"<"`` or ``">"``."""
    remedy: str = ""
    """What to do, one line; set when the status is ``"warn"``."""
    detail: str = ""
    """Context: the reason for ``"n/a"``, or what the value means (e.g. the unit's name)."""
    percent: bool = False
    """Whether value and threshold are fractions best shown as percents."""

    def format_value(self) -> str:
        """The value for display: a percent, a number, or "-"."""
        return _fmt(self.value, self.percent)

    def format_threshold(self) -> str:
        """The healthy range for display, e.g. ``"≤ 0.5%"``."""
        if self.threshold is None:
            return "-"
        symbol = {"<=": "≤", ">=": "≥", "<": "<", ">": ">"}.get(self.op, self.op)
        return f"{symbol} {_fmt(self.threshold, self.percent)}"


def _fmt(value: float | None, percent: bool) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if percent:
        return f"{100.0 * value:.3g}%"
    return f"{value:.4g}"


def _first(metrics: Mapping[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = metrics.get(key)
        if value is None:
            continue
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def _status(value: float, threshold: float, op: str) -> Status:
    if math.isnan(value):
        return "warn"
    healthy = {
        "<=": value <= threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        ">": value > threshold,
    }[op]
    return "pass" if healthy else "warn"


def check_health(
    metrics: Mapping[str, float],
    precision: str | PrecisionPolicy,
    thresholds: HealthThresholds | None = None,
    extra: Mapping[str, Any] | None = None,
) -> list[HealthCheck]:
    """Check ``metrics`` (as the engine and :mod:`memfit.monitor.metrics` name them).

    Args:
        metrics: the latest metric values; missing ones make their check ``"n/a"``.
        precision: the run's precision mode (or alias, or a ``PrecisionPolicy``).
        thresholds: where checks turn to ``"warn"``; default :class:`HealthThresholds()`.
        extra: optional context. ``"min_scale"``: the scaler's ``min_scale`` (default
            ``thresholds.min_loss_scale``); ``"has_plan"``: whether a checkpoint plan is in
            use (default: whether ``recompute/overhead`` is in ``metrics``).

    Example::

        checks = check_health({"amp/overflow_rate": 0.02, "amp/scale": 1.0}, "fp16-mixed")
        [c.name for c in checks if c.status == "warn"]   # ["overflow rate", "loss scale"]
    """
    t = thresholds if thresholds is not None else HealthThresholds()
    extra = dict(extra or {})
    mode = resolve_mode(precision.mode if isinstance(precision, PrecisionPolicy) else precision)
    fp16 = mode.startswith("fp16")
    mixed = mode != "fp32"
    no_scaling = f"{mode} does not scale the loss: bf16 and fp32 share fp32's exponent range"
    checks: list[HealthCheck] = []

    # Overflow rate: the recent window says what happens now, the run total what happened.
    rate = _first(metrics, "amp/overflow_rate_recent", "amp/overflow_rate")
    if not fp16:
        checks.append(
            HealthCheck("overflow rate", "n/a", rate, None, detail=no_scaling, percent=True)
        )
    elif rate is None:
        checks.append(
            HealthCheck(
                "overflow rate", "n/a", detail="not measured (amp/overflow_rate)", percent=True
            )
        )
    else:
        status = _status(rate, t.max_overflow_rate, "<=")
        skipped = _first(metrics, "amp/skipped")
        checks.append(
            HealthCheck(
                "overflow rate",
                status,
                rate,
                t.max_overflow_rate,
                "<=",
                percent=True,
                detail=f"{skipped:g} steps skipped in all" if skipped is not None else "",
                remedy=(
                    "overflows are frequent: raise LossScaler(growth_interval=...) or "
                    "hysteresis, keep the overflowing module in fp32 (first_nonfinite names "
                    "it), or use bf16-mixed"
                )
                if status == "warn"
                else "",
            )
        )

    # Loss scale pinned at its minimum: gradients overflow even at the smallest scale.
    scale = _first(metrics, "amp/scale")
    min_scale = float(extra.get("min_scale", t.min_loss_scale))
    if not fp16:
        checks.append(HealthCheck("loss scale", "n/a", scale, None, detail=no_scaling))
    elif scale is None:
        checks.append(HealthCheck("loss scale", "n/a", detail="not measured (amp/scale)"))
    else:
        status = _status(scale, min_scale, ">")
        checks.append(
            HealthCheck(
                "loss scale",
                status,
                scale,
                min_scale,
                ">",
                detail="pinned at the scaler's minimum" if status == "warn" else "",
                remedy=(
                    "gradients overflow even unscaled: lower the learning rate, set "
                    "clip_grad_norm, keep the overflowing module in fp32, or use bf16-mixed"
                )
                if status == "warn"
                else "",
            )
        )

    # Gradient underflow: small gradients the scale leaves below fp16's smallest subnormal.
    under = _first(metrics, "grad/underflow_fraction")
    if not fp16:
        checks.append(
            HealthCheck(
                "gradient underflow",
                "n/a",
                under,
                None,
                detail=f"{mode} gradients keep fp32's range",
                percent=True,
            )
        )
    elif under is None:
        checks.append(
            HealthCheck(
                "gradient underflow",
                "n/a",
                detail="not measured (grad/underflow_fraction, see gradient_underflow)",
                percent=True,
            )
        )
    else:
        status = _status(under, t.max_gradient_underflow, "<=")
        suggested = _first(metrics, "amp/suggested_scale")
        hint = f" (suggested: {suggested:g})" if suggested is not None else ""
        checks.append(
            HealthCheck(
                "gradient underflow",
                status,
                under,
                t.max_gradient_underflow,
                "<=",
                percent=True,
                remedy=(
                    f"raise the loss scale{hint} with LossScaler(init_scale=..., "
                    "min_scale=...), or use bf16-mixed"
                )
                if status == "warn"
                else "",
            )
        )

    # Activation range: the unit with the largest |output| against fp16's maximum.
    unit_values = {
        k.removeprefix("act/max/"): float(v)
        for k, v in metrics.items()
        if k.startswith("act/max/") and isinstance(v, (int, float))
    }
    fraction = _first(metrics, "act/max_fp16_fraction")
    worst_unit = ""
    if unit_values:
        worst_unit, worst = max(
            unit_values.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1]
        )
        fraction = worst / _FP16_MAX
    if not fp16:
        checks.append(
            HealthCheck(
                "activation range",
                "n/a",
                fraction,
                None,
                detail=f"{mode} activations keep fp32's range",
                percent=True,
            )
        )
    elif fraction is None:
        checks.append(
            HealthCheck(
                "activation range",
                "n/a",
                detail="not measured (act/max/<unit>, see ActivationRanges)",
                percent=True,
            )
        )
    else:
        status = _status(fraction, t.max_activation_fp16_fraction, "<")
        where = worst_unit or "the module with the largest outputs"
        checks.append(
            HealthCheck(
                "activation range",
                status,
                fraction,
                t.max_activation_fp16_fraction,
                "<",
                percent=True,
                detail=f"largest in {worst_unit!r}, share of fp16's 65504" if worst_unit else "",
                remedy=(
                    f"keep {where} in fp32 (PrecisionPolicy(fp32_islands=...)), add a "
                    "normalization before it, or use bf16-mixed"
                )
                if status == "warn"
                else "",
            )
        )

    # Low-precision memory share: what a mixed mode is meant to buy.
    share = _first(metrics, "memory/low_precision_share")
    if not mixed:
        checks.append(
            HealthCheck(
                "low-precision memory share",
                "n/a",
                share,
                None,
                detail="fp32 run: no 16-bit tensors expected",
                percent=True,
            )
        )
    elif share is None:
        checks.append(
            HealthCheck(
                "low-precision memory share",
                "n/a",
                detail="not measured (memory/low_precision_share, see memory_metrics)",
                percent=True,
            )
        )
    else:
        status = _status(share, t.min_low_precision_share, ">=")
        remedy = (
            "most memory is fp32: use a *-master mode so weights and gradients are 16-bit, "
            "check that outputs are not cast to float early, and keep fp32 islands few"
        )
        if mode.endswith("-master"):
            remedy = (
                "most memory is fp32: the fp32 master copy and optimizer state dominate; use "
                "a larger micro-batch or shard the optimizer state (FSDP)"
            )
        checks.append(
            HealthCheck(
                "low-precision memory share",
                status,
                share,
                t.min_low_precision_share,
                ">=",
                percent=True,
                remedy=remedy if status == "warn" else "",
            )
        )

    # Recompute overhead: only meaningful when a checkpoint plan is in use.
    overhead = _first(metrics, "recompute/overhead")
    has_plan = bool(extra.get("has_plan", overhead is not None))
    if not has_plan:
        checks.append(
            HealthCheck(
                "recompute overhead", "n/a", detail="no checkpoint plan in use", percent=True
            )
        )
    elif overhead is None:
        checks.append(
            HealthCheck(
                "recompute overhead",
                "n/a",
                detail="not measured (recompute/overhead)",
                percent=True,
            )
        )
    else:
        status = _status(overhead, t.max_recompute_overhead, "<=")
        checks.append(
            HealthCheck(
                "recompute overhead",
                status,
                overhead,
                t.max_recompute_overhead,
                "<=",
                percent=True,
                remedy=(
                    "checkpointing costs too much time: raise the memory budget, use "
                    "strategy='optimal' or selective recompute, or lower the micro-batch"
                )
                if status == "warn"
                else "",
            )
        )

    # A non-finite loss makes every other number moot.
    loss = _first(metrics, "loss")
    if loss is None:
        checks.append(HealthCheck("loss", "n/a", detail="not measured (loss)"))
    else:
        finite = math.isfinite(loss)
        checks.append(
            HealthCheck(
                "loss",
                "pass" if finite else "warn",
                loss,
                None,
                op="",
                detail="finite" if finite else "the loss is not finite",
                remedy=""
                if finite
                else "check the inputs for inf/nan, lower the learning rate, or use bf16-mixed",
            )
        )
    return checks


_STYLES = {"pass": "green", "warn": "bold yellow", "n/a": "dim"}


def render_health(checks: Sequence[HealthCheck], title: str = "health") -> Table:
    """A rich table of ``checks``: name, status, value, healthy range, remedy or note.

    Example::

        rich.print(render_health(check_health(metrics, "bf16-mixed")))
    """
    from rich.table import Table

    table = Table(title=title)
    table.add_column("check")
    table.add_column("status")
    table.add_column("value", justify="right")
    table.add_column("healthy", justify="right")
    table.add_column("remedy / note", overflow="fold")
    for c in checks:
        style = _STYLES.get(c.status, "")
        note = c.remedy or c.detail
        table.add_row(
            c.name, f"[{style}]{c.status}[/]", c.format_value(), c.format_threshold(), note
        )
    return table


def health_to_dict(checks: Sequence[HealthCheck]) -> dict[str, Any]:
    """A JSON-able dict: ``{"ok": no warnings, "warnings": n, "checks": [...]}``.

    Non-finite values are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``.
    This is the format of a run's ``health.json``; :func:`health_from_dict` reads it back.

    Example::

        json.dump(health_to_dict(checks), open(run_dir / "health.json", "w"))
    """
    rows = []
    for c in checks:
        row = asdict(c)
        for key in ("value", "threshold"):
            v = row[key]
            if isinstance(v, float) and not math.isfinite(v):
                row[key] = str(v)
        rows.append(row)
    warnings = sum(c.status == "warn" for c in checks)
    return {"ok": warnings == 0, "warnings": warnings, "checks": rows}


def health_from_dict(data: Mapping[str, Any]) -> list[HealthCheck]:
    """The checks :func:`health_to_dict` wrote (unknown keys are ignored).

    Example::

        checks = health_from_dict(json.loads((run_dir / "health.json").read_text()))
    """
    names = {f.name for f in fields(HealthCheck)}
    out = []
    for row in data.get("checks", []):
        if not isinstance(row, Mapping) or "name" not in row or "status" not in row:
            raise ConfigError(f"not a health check: {row!r}; expected what health_to_dict() writes")
        kwargs = {k: v for k, v in row.items() if k in names}
        for key in ("value", "threshold"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = float(kwargs[key])
        out.append(HealthCheck(**kwargs))
    return out
