"""Monitoring: metrics read from the device on demand, health checks, sinks, reports.

See ``docs/monitoring.md`` for every metric's name, meaning, cost and host syncs.
"""

from memfit.monitor.advice import Advice, RunFacts, advise, advise_run, render_advice
from memfit.monitor.health import (
    HealthCheck,
    HealthThresholds,
    check_health,
    health_from_dict,
    health_to_dict,
    render_health,
)
from memfit.monitor.metrics import (
    ActivationRanges,
    GradNormStats,
    OverflowWindow,
    UnderflowStats,
    activation_metrics,
    first_nonfinite,
    grad_norm_stats,
    gradient_underflow,
    memory_metrics,
    near_fp16_limit,
)
from memfit.monitor.monitor import Monitor, MonitorConfig
from memfit.monitor.report import make_report
from memfit.monitor.run_log import RunLog, load_run
from memfit.monitor.sinks import (
    ConsoleSink,
    JSONLSink,
    MultiSink,
    Sink,
    TensorBoardSink,
    check_log_dir,
    is_rank_zero,
)
from memfit.monitor.throughput import (
    Throughput,
    count_flops,
    recompute_overhead_from_flops,
    recompute_overhead_from_time,
    throughput_metrics,
)
from memfit.precision.scaler import FP16_MAX, suggest_initial_scale

__all__ = [
    "FP16_MAX",
    "ActivationRanges",
    "Advice",
    "ConsoleSink",
    "GradNormStats",
    "HealthCheck",
    "HealthThresholds",
    "JSONLSink",
    "Monitor",
    "MonitorConfig",
    "MultiSink",
    "OverflowWindow",
    "RunFacts",
    "RunLog",
    "Sink",
    "TensorBoardSink",
    "Throughput",
    "UnderflowStats",
    "activation_metrics",
    "advise",
    "advise_run",
    "check_health",
    "check_log_dir",
    "count_flops",
    "first_nonfinite",
    "grad_norm_stats",
    "gradient_underflow",
    "health_from_dict",
    "health_to_dict",
    "is_rank_zero",
    "load_run",
    "make_report",
    "memory_metrics",
    "near_fp16_limit",
    "recompute_overhead_from_flops",
    "recompute_overhead_from_time",
    "render_advice",
    "render_health",
    "suggest_initial_scale",
    "throughput_metrics",
]
