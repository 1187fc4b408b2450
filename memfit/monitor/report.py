"""Turn a run directory into figures and one self-contained HTML page.

A run directory (what ``memfit train`` writes) holds ``metrics.jsonl`` (one JSON object per
logged step), ``summary.json``, ``config.json``, and optionally ``health.json`` (what
:func:`memfit.monitor.health.health_to_dict` writes) and ``plan.json`` (the checkpoint
plan with its Pareto frontier), read by :func:`memfit.monitor.run_log.load_run`.
:func:`make_report` writes one PNG per figure and
``report.html`` with the figures embedded as data URIs, so the page can be mailed or
archived alone. Plotting needs matplotlib (``pip install memfit[plot]``); it draws on
``matplotlib.figure.Figure`` directly, so the caller's pyplot backend is left alone.

Example::

    path = make_report("runs/gpt-bf16-mixed-20250101-120000")
    print(path)   # runs/.../report/report.html
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError
from memfit.monitor.advice import advise_run
from memfit.monitor.health import (
    HealthCheck,
    check_health,
    health_from_dict,
    not_applicable_note,
)
from memfit.monitor.run_log import CONFIG as CONFIG
from memfit.monitor.run_log import HEALTH, RunLog, load_run
from memfit.monitor.run_log import METRICS as METRICS
from memfit.monitor.run_log import PLAN as PLAN
from memfit.monitor.run_log import SUMMARY as SUMMARY
from memfit.monitor.run_log import as_number as _number
from memfit.monitor.sinks import check_log_dir
from memfit.units import format_bytes

# RunLog and load_run live in memfit.monitor.run_log; importable from here too.
__all__ = ["RunLog", "load_run", "make_report"]

REPORT = "report.html"

# ---------------------------------------------------------------------- figures

_BLUE, _ORANGE, _RED, _GREEN, _GREY = "#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#7f7f7f"


def _figure(plt_figure: Any, height: float = 3.4) -> Any:
    return plt_figure(figsize=(9.0, height), dpi=100, layout="constrained")


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _finite(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


FigureResult = Any  # a matplotlib Figure, or a str note saying why there is none


def _loss_figure(run: RunLog, Figure: Any) -> FigureResult:
    steps, loss = run.series("loss")
    vsteps, vloss = run.series("val/loss")
    if not _finite(steps, loss)[0] and not _finite(vsteps, vloss)[0]:
        return "No loss values were logged."
    fig = _figure(Figure)
    ax = fig.add_subplot()
    if steps:
        ax.plot(steps, loss, color=_BLUE, lw=1.5, label="train")
    if vsteps:
        ax.plot(vsteps, vloss, color=_ORANGE, lw=1.5, marker="o", ms=4, label="validation")
    _style(ax, "Loss", "step", "loss")
    ax.legend()
    return fig


def _overflow_steps(run: RunLog) -> list[float]:
    """Steps at which the cumulative ``amp/skipped`` counter went up."""
    steps, skipped = run.series("amp/skipped")
    events, previous = [], 0.0
    for step, value in zip(steps, skipped):
        if math.isfinite(value) and value > previous:
            events.append(step)
        if math.isfinite(value):
            previous = value
    return events


def _scale_figure(run: RunLog, Figure: Any) -> FigureResult:
    steps, scale = _finite(*run.series("amp/scale"))
    events = _overflow_steps(run)
    if not steps:
        return "No loss scale was logged."
    precision = run.precision or "this run's precision"
    if not str(precision).startswith("fp16") and all(s == 1.0 for s in scale):
        note = f"The loss scale stays at 1: {precision} does not scale the loss."
        if events:
            note += f" Steps were skipped for non-finite gradients at {len(events)} logged step(s)."
        return note
    fig = _figure(Figure)
    ax = fig.add_subplot()
    ax.plot(steps, scale, color=_BLUE, lw=1.5, drawstyle="steps-post", label="loss scale")
    if all(s > 0 for s in scale):
        ax.set_yscale("log", base=2)
    for step in events:
        ax.axvline(step, color=_RED, alpha=0.6, lw=1.2, ls="--")
    if events:
        # Triangles along the top edge stay visible however the scale line runs.
        ax.plot(
            events,
            [1.0] * len(events),
            "v",
            color=_RED,
            ms=9,
            ls="none",
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label="overflow (skipped step)",
        )
    _style(ax, f"Loss scale ({len(events)} logged step(s) with overflows)", "step", "scale")
    ax.legend()
    return fig


def _grad_figure(run: RunLog, Figure: Any) -> FigureResult:
    lines = [
        (key, label)
        for key, label in (
            ("grad/norm", "total norm"),
            ("grad/norm_total", "total norm"),
            ("grad/norm_max", "largest parameter"),
            ("grad/norm_median", "median parameter"),
        )
        if key in run.keys()
    ]
    if ("grad/norm", "total norm") in lines:
        lines = [kv for kv in lines if kv[0] != "grad/norm_total"]
    if not lines:
        return "No gradient norm was logged (the engine logs grad/norm when clip_grad_norm is set)."
    fig = _figure(Figure)
    ax = fig.add_subplot()
    positive = True
    for (key, label), color in zip(lines, (_BLUE, _ORANGE, _GREEN, _GREY)):
        xs, ys = _finite(*run.series(key))
        positive = positive and all(y > 0 for y in ys)
        ax.plot(xs, ys, color=color, lw=1.5, label=label)
    if positive:
        ax.set_yscale("log")
    _style(ax, "Gradient norm (unscaled, before clipping)", "step", "L2 norm")
    ax.legend()
    return fig


def _memory_figure(run: RunLog, Figure: Any) -> FigureResult:
    record: dict[str, float] | None = None
    for r in reversed(run.records):
        if any(k.startswith(("memory/kind/", "memory/dtype/")) for k in r):
            record = r
            break
    if record is None:
        peak = run.latest().get("memory/peak_bytes") or run.summary.get("peak_memory_bytes")
        if peak:
            return (
                f"Only the peak was recorded: {format_bytes(float(peak))}. Log "
                "memory_metrics(memfit.measure(...)) for a breakdown by kind and dtype."
            )
        return "No memory measurement was logged."
    kinds = {
        k.removeprefix("memory/kind/"): v for k, v in record.items() if k.startswith("memory/kind/")
    }
    dtypes = {
        k.removeprefix("memory/dtype/"): v
        for k, v in record.items()
        if k.startswith("memory/dtype/")
    }
    fig = _figure(Figure, height=3.2)
    panels = [(p, t) for p, t in ((kinds, "by kind"), (dtypes, "by dtype")) if p]
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    total = max(sum(kinds.values()), sum(dtypes.values()), 1.0)
    for ax, (values, title) in zip(axes, panels):
        names = list(values)
        numbers = [values[n] for n in names]
        bars = ax.barh(names, numbers, color=_BLUE if title == "by kind" else _ORANGE)
        ax.invert_yaxis()
        ax.bar_label(bars, labels=[format_bytes(n) for n in numbers], padding=3, fontsize=8)
        ax.set_xlim(0, max(numbers + [1.0]) * 1.35)
        ax.set_xticks([])
        ax.set_title(f"Memory at the peak, {title}", fontsize=11, loc="left")
    peak = record.get("memory/peak_bytes", total)
    share = record.get("memory/low_precision_share")
    suptitle = f"peak {format_bytes(peak)}"
    if share is not None and math.isfinite(share):
        suptitle += f" · {100 * share:.0f}% in 16-bit tensors"
    fig.suptitle(suptitle, fontsize=10, x=0.99, ha="right")
    return fig


def _throughput_figure(run: RunLog, Figure: Any) -> FigureResult:
    # tokens/s is samples/s times a constant: show one of them, the more telling one.
    xs, ys = _finite(*run.series("throughput/tokens_per_second"))
    label = "tokens / s"
    if not xs:
        xs, ys = _finite(*run.series("throughput/samples_per_second"))
        label = "samples / s"
    if not xs:
        return "No throughput was logged."
    fig = _figure(Figure)
    ax = fig.add_subplot()
    ax.plot(xs, ys, color=_BLUE, lw=1.5)
    ax.set_ylim(bottom=0, top=max(ys) * 1.15 if max(ys) > 0 else 1.0)
    mfu = [v for v in run.series("throughput/mfu")[1] if math.isfinite(v)]
    title = "Throughput" + (f" (last MFU {100 * mfu[-1]:.1f}%)" if mfu else "")
    _style(ax, title, "step", label)
    return fig


def _plan_figure(run: RunLog, Figure: Any) -> FigureResult:
    plan = run.plan
    if not plan:
        return "No checkpoint plan: every activation was kept (or plan.json was not written)."
    frontier = [
        p
        for p in plan.get("frontier") or []
        if isinstance(p, Mapping) and _number(p.get("peak_bytes")) is not None
    ]
    chosen_peak = _number(plan.get("predicted_peak_bytes"))
    chosen_seconds = _number(plan.get("recompute_seconds"))
    if not frontier:
        if chosen_peak is None:
            return "The checkpoint plan holds no frontier and no predicted peak."
        return (
            f"The checkpoint plan holds no frontier. Chosen point: predicted peak "
            f"{format_bytes(chosen_peak)}, recompute {1000 * (chosen_seconds or 0.0):.2f} ms per step."
        )
    points = sorted(
        (float(_number(p["peak_bytes"]) or 0.0), float(_number(p.get("recompute_seconds")) or 0.0))
        for p in frontier
    )
    peaks = [p[0] for p in points] + ([chosen_peak] if chosen_peak is not None else [])
    scale, unit = next(
        ((2.0**e, u) for e, u in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if max(peaks) >= 2.0**e),
        (1.0, "B"),
    )
    fig = _figure(Figure)
    ax = fig.add_subplot()
    ax.plot(
        [p[0] / scale for p in points],
        [1000 * p[1] for p in points],
        color=_BLUE,
        marker="o",
        ms=4,
        lw=1.2,
        drawstyle="steps-post",
        label="Pareto frontier",
    )
    if chosen_peak is not None:
        ax.plot(
            [chosen_peak / scale],
            [1000 * (chosen_seconds or 0.0)],
            marker="*",
            ms=16,
            color=_RED,
            ls="none",
            label="chosen plan",
        )
    budget = _number(plan.get("budget_bytes"))
    if budget is not None and math.isfinite(budget):
        ax.axvline(budget / scale, color=_GREY, ls="--", lw=1, label="budget")
    _style(
        ax,
        "Checkpoint plan: peak memory vs recompute time",
        f"predicted peak memory ({unit})",
        "recompute time per step (ms)",
    )
    ax.legend()
    return fig


_FIGURES: list[tuple[str, str, Callable[[RunLog, Any], FigureResult]]] = [
    ("loss", "Loss", _loss_figure),
    ("loss_scale", "Loss scale and overflows", _scale_figure),
    ("grad_norm", "Gradient norm", _grad_figure),
    ("memory", "Memory", _memory_figure),
    ("throughput", "Throughput", _throughput_figure),
    ("plan", "Checkpoint plan", _plan_figure),
]


# ---------------------------------------------------------------------- HTML

_CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif;
       color: #1b1f24; background: #ffffff; margin: 0; }
main { max-width: 960px; margin: 0 auto; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 19px; margin: 32px 0 10px; border-bottom: 1px solid #d8dee4; padding-bottom: 4px; }
p.sub { color: #57606a; margin: 0 0 16px; }
table { border-collapse: collapse; font-size: 14px; }
th, td { border: 1px solid #d8dee4; padding: 5px 10px; text-align: left; vertical-align: top; }
th { background: #f3f5f7; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; height: auto; display: block; }
p.note { background: #f6f8fa; border-left: 4px solid #8c959f; padding: 10px 14px; color: #3b434b; }
.pass { color: #1a7f37; font-weight: 600; }
.warn { color: #9a6700; font-weight: 700; }
.na { color: #8c959f; }
tr.warn-row td { background: #fff8e5; }
footer { margin-top: 32px; color: #8c959f; font-size: 12px; }
"""


def _fmt_summary(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        if "bytes" in key:
            return format_bytes(float(value))
        if isinstance(value, float):
            if not math.isfinite(value):
                return str(value)
            if "per_second" in key:
                return f"{value:,.1f}"
            return f"{value:.5g}"
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _summary_table(run: RunLog) -> str:
    rows = dict(run.summary)
    if not rows:
        last = run.latest()
        rows = {
            k: last[k]
            for k in ("step", "loss", "val/loss", "amp/scale", "amp/skipped")
            if k in last
        }
        caption = "<p class='note'>No summary.json (the run may not have finished); the last logged values:</p>"
    else:
        caption = ""
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td class='num'>{html.escape(_fmt_summary(k, v))}</td></tr>"
        for k, v in rows.items()
    )
    return f"{caption}<table>{body}</table>"


def _health_checks(run: RunLog) -> tuple[list[HealthCheck], str]:
    if run.health is not None:
        try:
            return health_from_dict(run.health), "From health.json."
        except (ConfigError, TypeError, ValueError) as exc:
            warnings.warn(f"{run.run_dir / HEALTH}: unreadable ({exc}); recomputed", stacklevel=3)
    if run.precision is None:
        return [], "No health.json and no precision in config.json or summary.json: not checked."
    try:
        checks = check_health(run.latest(), run.precision, extra={"has_plan": run.plan is not None})
    except ConfigError as exc:
        return [], f"Health not checked: {exc}"
    return checks, f"Computed from the last logged metrics under {run.precision}."


def _health_table(checks: list[HealthCheck]) -> str:
    head = (
        "<tr><th>check</th><th>status</th><th>value</th><th>healthy</th><th>remedy / note</th></tr>"
    )
    rows = []
    for c in checks:
        if not c.applies:  # named in the note below the table
            continue
        cls = {"pass": "pass", "warn": "warn"}.get(c.status, "na")
        note = c.remedy or c.detail
        if c.remedy and c.detail:
            note = f"{c.detail}; {c.remedy}"
        rows.append(
            f"<tr class='{'warn-row' if c.status == 'warn' else ''}'>"
            f"<td>{html.escape(c.name)}</td><td class='{cls}'>{html.escape(c.status)}</td>"
            f"<td class='num'>{html.escape(c.format_value())}</td>"
            f"<td class='num'>{html.escape(c.format_threshold())}</td>"
            f"<td>{html.escape(note)}</td></tr>"
        )
    note = not_applicable_note(checks)
    after = f"<p class='note'>{html.escape(note)}</p>" if note else ""
    return f"<table>{head}{''.join(rows)}</table>{after}"


def _advice_section(run: RunLog) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(a.topic)}</th><td>{html.escape(a.text)}</td></tr>"
        for a in advise_run(run)
    )
    return (
        "<section id='advice'><h2>Advice</h2><p class='sub'>From the logged metrics "
        "(memfit.tuning.run_advice); memfit tune measures the choice.</p>"
        f"<table>{rows}</table></section>"
    )


def make_report(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Write the run's figures (PNG) and a self-contained ``report.html``; return its path.

    Figures: loss (train and validation), loss scale with overflow events (logged steps
    where ``amp/skipped`` went up), gradient norm, memory by kind and by dtype, throughput,
    the checkpoint plan's frontier with the chosen point, the health table (from
    ``health.json``, else computed from the last logged metrics) and the run's advice
    (:func:`memfit.monitor.advice.advise_run`). A figure whose data is absent is replaced
    by a short note. ``out_dir`` defaults to ``<run_dir>/report``.

    Raises :class:`memfit.errors.ConfigError` for a missing run directory, one without
    metrics, an unwritable ``out_dir``, or when matplotlib is not installed.

    Example::

        html_path = make_report("runs/exp1")   # runs/exp1/report/report.html
    """
    run = load_run(run_dir)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "the report's figures need matplotlib: pip install memfit[plot]"
        ) from None
    out = check_log_dir(Path(out_dir) if out_dir is not None else run.run_dir / "report")

    sections = []
    for name, title, make in _FIGURES:
        result = make(run, Figure)
        png = out / f"{name}.png"
        if isinstance(result, str):
            png.unlink(missing_ok=True)  # a stale figure from an earlier report would mislead
            body = f"<p class='note'>{html.escape(result)}</p>"
        else:
            buf = io.BytesIO()
            result.savefig(buf, format="png", facecolor="white")
            data = buf.getvalue()
            png.write_bytes(data)
            encoded = base64.b64encode(data).decode("ascii")
            body = f"<img alt='{html.escape(title)}' src='data:image/png;base64,{encoded}'>"
        sections.append(f"<section id='{name}'><h2>{html.escape(title)}</h2>{body}</section>")

    checks, source = _health_checks(run)
    health_html = _health_table(checks) if checks else ""
    health_section = (
        f"<section id='health'><h2>Health</h2><p class='sub'>{html.escape(source)}</p>"
        f"{health_html}</section>"
    )
    advice_section = _advice_section(run)
    from memfit.version import __version__

    title = f"memfit run report: {run.run_dir.resolve().name}"
    model = run.config.get("model")
    subtitle = " · ".join(
        str(x)
        for x in (
            f"model {model}" if model else None,
            run.precision,
            f"{len(run.records)} logged records",
            f"{run.skipped_lines} malformed line(s) skipped" if run.skipped_lines else None,
        )
        if x
    )
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<main>
<h1>{html.escape(title)}</h1>
<p class="sub">{html.escape(subtitle)}</p>
<section id="summary"><h2>Summary</h2>{_summary_table(run)}</section>
{health_section}
{advice_section}
{"".join(sections)}
<footer>{html.escape(str(run.run_dir))} · memfit {html.escape(__version__)} · {time.strftime("%Y-%m-%d %H:%M:%S")}</footer>
</main>
</body>
</html>
"""
    path = out / REPORT
    tmp = out / f".{REPORT}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a page
    return path
