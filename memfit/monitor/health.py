"""Health checks: compare a run's metrics with the thresholds the field's practice suggests.

Each check is ``"pass"``, ``"warn"`` (with a one-line remedy) or ``"n/a"`` (with the reason:
the check does not apply to the run, ``applies`` False, or the metric was not measured).
The tables (:func:`render_health`, the report's) leave out the checks that do not apply and
name them in one note (:func:`not_applicable_note`): an fp32 run without a plan shows the
loss alone, not six rows of "n/a". The defaults are the table in the design notes, plus two fp16-specific checks:

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import FP16_MAX

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "HealthCheck",
    "HealthThresholds",
    "Status",
    "check_health",
    "health_from_dict",
    "health_to_dict",
    "not_applicable_note",
    "render_health",
]

Status = Literal["pass", "warn", "n/a"]


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
    applies: bool = True
    """False when the check does not apply to the run (the precision needs no loss
    scaling, no plan is in use; ``detail`` says why): the tables leave it out."""

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


def _status(value: float, threshold: float | None, op: str) -> Status:
    # A check without a threshold only asks for a finite value.
    if threshold is None:
        return "pass" if math.isfinite(value) else "warn"
    if math.isnan(value):
        return "warn"
    healthy = {
        "<=": value <= threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        ">": value > threshold,
    }[op]
    return "pass" if healthy else "warn"


@dataclass(frozen=True)
class _Run:
    """What every check reads: the metrics, the thresholds, the extra context, the policy."""

    metrics: Mapping[str, Any]
    thresholds: HealthThresholds
    extra: Mapping[str, Any]
    policy: PrecisionPolicy


@dataclass(frozen=True)
class _Check:
    """One health check: where its value comes from, what it is compared with, what it says.

    Evaluated by :func:`_evaluate`: ``"n/a"`` with ``skip``'s reason when the check does not
    apply, ``"n/a"`` with "not measured (``missing``)" when the value is absent, else the
    value against ``threshold`` by ``op`` (without a threshold: whether it is finite), with
    ``remedy`` on a warning.
    """

    name: str
    keys: tuple[str, ...]
    """Metric keys for the value; the first present one wins."""
    missing: str
    """What to measure, for the detail of a check whose value is absent."""
    remedy: str | Callable[[_Run], str]
    """The one-line remedy of a warning (or what builds it from the run)."""
    threshold: str | Callable[[_Run], float] | None = None
    """The healthy bound: a :class:`HealthThresholds` field's name, or what reads it from
    the run; None: the value only has to be finite."""
    op: str = "<="
    percent: bool = False
    skip: Callable[[_Run], str | None] = lambda run: None
    """Why the check does not apply to this run, or None when it does."""
    value: Callable[[_Run], float | None] | None = None
    """Where the value comes from first; when it gives None, the first of ``keys``."""
    detail: Callable[[_Run, Status], str] = lambda run, status: ""
    """Context for a measured value."""
    value_when_skipped: bool = True
    """Whether a check that does not apply still shows the measured value."""


def _evaluate(check: _Check, run: _Run) -> HealthCheck:
    value = check.value(run) if check.value is not None else None
    if value is None:
        value = _first(run.metrics, *check.keys)
    reason = check.skip(run)
    if reason is not None:
        shown = value if check.value_when_skipped else None
        return HealthCheck(
            check.name, "n/a", shown, None, detail=reason, percent=check.percent, applies=False
        )
    if value is None:
        detail = f"not measured ({check.missing})"
        return HealthCheck(check.name, "n/a", detail=detail, percent=check.percent)
    threshold = _threshold(check, run)
    status = _status(value, threshold, check.op)
    remedy = check.remedy if isinstance(check.remedy, str) else check.remedy(run)
    return HealthCheck(
        check.name,
        status,
        value,
        threshold,
        check.op,
        percent=check.percent,
        detail=check.detail(run, status),
        remedy=remedy if status == "warn" else "",
    )


def _threshold(check: _Check, run: _Run) -> float | None:
    if check.threshold is None:
        return None
    if isinstance(check.threshold, str):
        return getattr(run.thresholds, check.threshold)
    return check.threshold(run)


def _no_scaling(run: _Run) -> str | None:
    """Why the fp16 checks (overflow, loss scale, underflow, activation range) do not apply:
    one reason for all four, so the tables' note says it once."""
    if run.policy.loss_scaling:
        return None
    return (
        f"{run.policy.mode} keeps fp32's exponent range (bf16 and fp32 share it): no loss "
        "scaling, no fp16 overflow or underflow"
    )


def _overflow_detail(run: _Run, status: Status) -> str:
    skipped = _first(run.metrics, "amp/skipped")
    return f"{skipped:g} steps skipped in all" if skipped is not None else ""


def _underflow_remedy(run: _Run) -> str:
    suggested = _first(run.metrics, "amp/suggested_scale")
    hint = f" (suggested: {suggested:g})" if suggested is not None else ""
    return (
        f"raise the loss scale{hint} with LossScaler(init_scale=..., min_scale=...), "
        "or use bf16-mixed"
    )


def _worst_unit(metrics: Mapping[str, Any]) -> tuple[str, float] | None:
    """The unit with the largest ``act/max/<unit>`` (NaN counts as largest), or None.

    The model itself is the unit ``""``: it has a value but no name to show.
    """
    unit_values = {
        k.removeprefix("act/max/"): float(v)
        for k, v in metrics.items()
        if k.startswith("act/max/") and isinstance(v, (int, float))
    }
    if not unit_values:
        return None
    return max(unit_values.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])


def _worst_unit_fraction(run: _Run) -> float | None:
    worst = _worst_unit(run.metrics)
    return None if worst is None else worst[1] / FP16_MAX


def _worst_unit_name(run: _Run) -> str:
    worst = _worst_unit(run.metrics)
    return worst[0] if worst is not None else ""


def _activation_detail(run: _Run, status: Status) -> str:
    unit = _worst_unit_name(run)
    return f"largest in {unit!r}, share of fp16's {FP16_MAX:g}" if unit else ""


def _activation_remedy(run: _Run) -> str:
    where = _worst_unit_name(run) or "the module with the largest outputs"
    return (
        f"keep {where} in fp32 (PrecisionPolicy(fp32_islands=...)), add a "
        "normalization before it, or use bf16-mixed"
    )


def _memory_share_remedy(run: _Run) -> str:
    if run.policy.master_weights:
        return (
            "most memory is fp32: the fp32 master copy and optimizer state dominate; use "
            "a larger micro-batch or shard the optimizer state (FSDP)"
        )
    return (
        "most memory is fp32: use a *-master mode so weights and gradients are 16-bit, "
        "check that outputs are not cast to float early, and keep fp32 islands few"
    )


def _no_plan(run: _Run) -> str | None:
    has_plan = run.extra.get("has_plan", _first(run.metrics, "recompute/overhead") is not None)
    return None if has_plan else "no checkpoint plan in use"


_CHECKS: tuple[_Check, ...] = (
    # Overflow rate: the recent window says what happens now, the run total what happened.
    _Check(
        "overflow rate",
        ("amp/overflow_rate_recent", "amp/overflow_rate"),
        missing="amp/overflow_rate",
        threshold="max_overflow_rate",
        percent=True,
        skip=_no_scaling,
        detail=_overflow_detail,
        remedy=(
            "overflows are frequent: raise LossScaler(growth_interval=...) or "
            "hysteresis, keep the overflowing module in fp32 (first_nonfinite names "
            "it), or use bf16-mixed"
        ),
    ),
    # Loss scale pinned at its minimum: gradients overflow even at the smallest scale.
    _Check(
        "loss scale",
        ("amp/scale",),
        missing="amp/scale",
        threshold=lambda run: float(run.extra.get("min_scale", run.thresholds.min_loss_scale)),
        op=">",
        skip=_no_scaling,
        detail=lambda run, status: "pinned at the scaler's minimum" if status == "warn" else "",
        remedy=(
            "gradients overflow even unscaled: lower the learning rate, set "
            "clip_grad_norm, keep the overflowing module in fp32, or use bf16-mixed"
        ),
    ),
    # Gradient underflow: small gradients the scale leaves below fp16's smallest subnormal.
    _Check(
        "gradient underflow",
        ("grad/underflow_fraction",),
        missing="grad/underflow_fraction, see gradient_underflow",
        threshold="max_gradient_underflow",
        percent=True,
        skip=_no_scaling,
        remedy=_underflow_remedy,
    ),
    # Activation range: the unit with the largest |output| against fp16's maximum.
    _Check(
        "activation range",
        ("act/max_fp16_fraction",),
        missing="act/max/<unit>, see ActivationRanges",
        threshold="max_activation_fp16_fraction",
        op="<",
        percent=True,
        skip=_no_scaling,
        value=_worst_unit_fraction,
        detail=_activation_detail,
        remedy=_activation_remedy,
    ),
    # Low-precision memory share: what a mixed mode is meant to buy.
    _Check(
        "low-precision memory share",
        ("memory/low_precision_share",),
        missing="memory/low_precision_share, see memory_metrics",
        threshold="min_low_precision_share",
        op=">=",
        percent=True,
        skip=lambda run: None if run.policy.mixed else "fp32 run: no 16-bit tensors expected",
        remedy=_memory_share_remedy,
    ),
    # Recompute overhead: only meaningful when a checkpoint plan is in use.
    _Check(
        "recompute overhead",
        ("recompute/overhead",),
        missing="recompute/overhead",
        threshold="max_recompute_overhead",
        percent=True,
        skip=_no_plan,
        value_when_skipped=False,
        remedy=(
            "checkpointing costs too much time: raise the memory budget, use "
            "strategy='optimal' or selective recompute, or lower the micro-batch"
        ),
    ),
    # A non-finite loss makes every other number moot.
    _Check(
        "loss",
        ("loss",),
        missing="loss",
        op="",
        detail=lambda run, status: "finite" if status == "pass" else "the loss is not finite",
        remedy=("check the inputs for inf/nan, lower the learning rate, or use bf16-mixed"),
    ),
)


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
    policy = precision if isinstance(precision, PrecisionPolicy) else PrecisionPolicy(precision)
    run = _Run(
        metrics=metrics,
        thresholds=thresholds if thresholds is not None else HealthThresholds(),
        extra=dict(extra or {}),
        policy=policy,
    )
    return [_evaluate(check, run) for check in _CHECKS]


_STYLES = {"pass": "green", "warn": "bold yellow", "n/a": "dim"}


def not_applicable_note(checks: Sequence[HealthCheck]) -> str | None:
    """One note naming the checks that do not apply to the run (``applies`` False), each
    reason said once; None when every check applies.

    Example::

        not_applicable_note(check_health({"loss": 2.0}, "fp32"))
        # 'left out, as they do not apply: overflow rate, loss scale, gradient underflow,
        #  activation range (fp32 keeps fp32's exponent range ...); ...'
    """
    groups: dict[str, list[str]] = {}
    for c in checks:
        if not c.applies:
            groups.setdefault(c.detail, []).append(c.name)
    if not groups:
        return None
    parts = [
        f"{', '.join(names)} ({reason})" if reason else ", ".join(names)
        for reason, names in groups.items()
    ]
    return "left out, as they do not apply: " + "; ".join(parts)


def render_health(checks: Sequence[HealthCheck], title: str = "health") -> Table:
    """A rich table of the ``checks`` that apply: name, status, value, healthy range,
    remedy or note; those that do not apply are named in one caption
    (:func:`not_applicable_note`).

    Example::

        rich.print(render_health(check_health(metrics, "bf16-mixed")))
    """
    from rich.table import Table

    table = Table(title=title, caption=not_applicable_note(checks), caption_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("value", justify="right")
    table.add_column("healthy", justify="right")
    table.add_column("remedy / note", overflow="fold")
    for c in checks:
        if not c.applies:
            continue
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
