"""The monitor works from plain data (a model, gradients, a policy, metrics), without an Engine."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import torch
from torch import nn

from memfit.monitor import Monitor, MonitorConfig
from memfit.precision.policy import PrecisionPolicy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_monitor_without_an_engine_logs_gradients_activations_and_health(tmp_path: Path) -> None:
    model = _model()
    monitor = Monitor(model, MonitorConfig(activation_units=["0"], activation_every=1), tmp_path)
    model(torch.randn(3, 4)).square().mean().backward()
    policy = PrecisionPolicy("fp16-mixed")
    metrics = {"step": 1.0, "amp/skipped": 0.0, "loss": 0.5, "amp/scale": 1024.0}
    grads = monitor.gradient_metrics(model.named_parameters(), policy, torch.tensor(1024.0))
    assert grads["grad/norm_total"] > 0 and "grad/underflow_fraction" in grads
    logged = monitor.log({**metrics, **grads})
    assert logged["amp/overflow_rate_recent"] == 0.0 and "act/max/0" in logged
    monitor.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["grad/norm_total"] == grads["grad/norm_total"]
    checks = {c.name: c for c in monitor.health(logged, policy, min_scale=1.0, has_plan=False)}
    assert checks["loss scale"].status == "pass"
    assert checks["recompute overhead"].detail == "no checkpoint plan in use"
    assert monitor.near_fp16_limit({"act/max/0": 40000.0, "act/max/2": 1.0}) == [("0", 40000.0)]


def test_gradient_metrics_skip_missing_grads_and_fp32_underflow() -> None:
    model = _model()
    monitor = Monitor(model, MonitorConfig(), None)
    fp32 = PrecisionPolicy("fp32")
    assert monitor.gradient_metrics(model.named_parameters(), fp32, None) == {}
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad = None
    out = monitor.gradient_metrics(model.named_parameters(), fp32, None)
    assert "grad/norm_total" in out and "grad/underflow_fraction" not in out
    monitor.close()


def test_monitor_package_does_not_import_the_engine() -> None:
    import memfit.monitor

    package = Path(memfit.monitor.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n == "memfit.engine" for n in names), path.name


def test_engine_read_metrics_reads_between_log_steps(tmp_path: Path) -> None:
    import memfit

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = memfit.Engine(model, opt, precision="fp32", log_every=10, log_dir=tmp_path)
    batch = torch.randn(4, 4)
    for _ in range(3):
        engine.train_step(batch, lambda m, b: m(b).square().mean())
    assert engine.metrics == {}
    metrics = engine.read_metrics()
    assert metrics["step"] == 3.0 and engine.metrics == metrics
    engine.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3]
