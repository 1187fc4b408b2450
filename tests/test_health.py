"""Health checks flag what is unhealthy, pass what is healthy, and skip what does not apply."""

from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from memfit.errors import ConfigError
from memfit.monitor.health import (
    HealthCheck,
    HealthThresholds,
    check_health,
    health_from_dict,
    health_to_dict,
    render_health,
)

HEALTHY_FP16 = {
    "loss": 2.1,
    "amp/scale": 8192.0,
    "amp/skipped": 1.0,
    "amp/overflow_rate": 0.002,
    "grad/underflow_fraction": 0.001,
    "act/max/blocks.0": 1200.0,
    "act/max/blocks.1": 900.0,
    "memory/low_precision_share": 0.72,
    "recompute/overhead": 0.2,
}

FAILING_FP16 = {
    "loss": math.nan,
    "amp/scale": 1.0,
    "amp/skipped": 40.0,
    "amp/overflow_rate": 0.04,
    "grad/underflow_fraction": 0.2,
    "amp/suggested_scale": 65536.0,
    "act/max/blocks.0": 1200.0,
    "act/max/blocks.1": 50000.0,
    "memory/low_precision_share": 0.3,
    "recompute/overhead": 0.6,
}


def _by_name(checks: list[HealthCheck]) -> dict[str, HealthCheck]:
    return {c.name: c for c in checks}


def test_healthy_fp16_run_passes_everything() -> None:
    checks = check_health(HEALTHY_FP16, "fp16-mixed")
    assert {c.status for c in checks} == {"pass"}
    assert all(c.remedy == "" for c in checks)


def test_failing_fp16_run_flags_each_check_with_a_remedy() -> None:
    checks = _by_name(check_health(FAILING_FP16, "fp16-mixed"))
    assert {name for name, c in checks.items() if c.status == "warn"} == {
        "overflow rate",
        "loss scale",
        "gradient underflow",
        "activation range",
        "low-precision memory share",
        "recompute overhead",
        "loss",
    }
    for c in checks.values():
        assert c.remedy and "\n" not in c.remedy
    assert "blocks.1" in checks["activation range"].remedy
    assert "blocks.1" in checks["activation range"].detail
    assert "65536" in checks["gradient underflow"].remedy
    assert checks["overflow rate"].value == pytest.approx(0.04)


@pytest.mark.parametrize(
    "key, value, check",
    [
        ("amp/overflow_rate", 0.006, "overflow rate"),
        ("amp/scale", 1.0, "loss scale"),
        ("grad/underflow_fraction", 0.011, "gradient underflow"),
        ("act/max/blocks.0", 0.5 * 65504.0, "activation range"),
        ("memory/low_precision_share", 0.59, "low-precision memory share"),
        ("recompute/overhead", 0.36, "recompute overhead"),
        ("loss", math.inf, "loss"),
    ],
)
def test_each_threshold_flags_only_its_check(key: str, value: float, check: str) -> None:
    metrics = dict(HEALTHY_FP16, **{key: value})
    warned = [c.name for c in check_health(metrics, "fp16-mixed") if c.status == "warn"]
    assert warned == [check]


def test_recent_overflow_rate_wins_over_run_total() -> None:
    metrics = dict(HEALTHY_FP16, **{"amp/overflow_rate": 0.05, "amp/overflow_rate_recent": 0.0})
    assert _by_name(check_health(metrics, "fp16"))["overflow rate"].status == "pass"


def test_bf16_skips_fp16_checks_with_reasons() -> None:
    checks = _by_name(check_health(FAILING_FP16, "bf16-mixed"))
    for name in ("overflow rate", "loss scale", "gradient underflow", "activation range"):
        assert checks[name].status == "n/a"
        assert checks[name].detail
    assert checks["low-precision memory share"].status == "warn"
    assert checks["recompute overhead"].status == "warn"


def test_fp32_skips_the_memory_share_and_missing_metrics_are_na() -> None:
    checks = _by_name(check_health({"loss": 1.0}, "fp32"))
    assert checks["low-precision memory share"].status == "n/a"
    assert checks["recompute overhead"].status == "n/a"
    assert "no checkpoint plan" in checks["recompute overhead"].detail
    assert checks["loss"].status == "pass"
    fp16 = _by_name(check_health({}, "O1"))
    assert {c.status for c in fp16.values()} == {"n/a"}
    assert "not measured" in fp16["overflow rate"].detail


def test_plan_without_measured_overhead_is_na() -> None:
    checks = _by_name(check_health({}, "bf16", extra={"has_plan": True}))
    assert checks["recompute overhead"].status == "n/a"
    assert "not measured" in checks["recompute overhead"].detail


def test_thresholds_are_configurable() -> None:
    metrics = dict(HEALTHY_FP16, **{"amp/overflow_rate": 0.02, "amp/scale": 4.0})
    loose = HealthThresholds(max_overflow_rate=0.05, min_loss_scale=2.0)
    assert {c.status for c in check_health(metrics, "fp16-mixed", loose)} == {"pass"}
    strict = _by_name(check_health(metrics, "fp16-mixed", extra={"min_scale": 4.0}))
    assert strict["loss scale"].status == "warn"
    with pytest.raises(ConfigError, match="fraction"):
        HealthThresholds(max_overflow_rate=0.5 * 100)
    with pytest.raises(ConfigError):
        HealthThresholds(max_recompute_overhead=-1.0)
    with pytest.raises(ConfigError, match="unknown precision"):
        check_health({}, "fp8")


def test_render_and_dict_round_trip() -> None:
    checks = check_health(FAILING_FP16, "fp16-mixed")
    table = render_health(checks)
    assert table.row_count == len(checks)
    console = Console(record=True, width=160)
    console.print(table)
    text = console.export_text()
    assert "overflow rate" in text and "warn" in text and "≤ 0.5%" in text
    data = health_to_dict(checks)
    assert data["ok"] is False and data["warnings"] == 7
    text = json.dumps(data, allow_nan=False)  # strict JSON: non-finite values are strings
    back = health_from_dict(json.loads(text))
    assert len(back) == len(checks)
    for a, b in zip(checks, back):
        assert a.name == b.name and a.status == b.status and a.remedy == b.remedy
        assert (
            (a.value is None and b.value is None)
            or (math.isnan(a.value) and math.isnan(b.value))
            or a.value == b.value
        )
    with pytest.raises(ConfigError):
        health_from_dict({"checks": [{"value": 1}]})
