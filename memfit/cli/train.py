"""``memfit train``: train a built-in model for a short run and report what it cost.

With no arguments: the built-in GPT on the standard-library byte corpus, ``bf16-mixed``.
A run directory holds ``config.json`` (what was asked), ``checkpoint.pt`` (the latest state,
written atomically; the one before it is kept as ``checkpoint.prev.pt``), ``metrics.jsonl``
and ``summary.json``. ``--resume DIR`` continues a run exactly where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memfit.cli.common import (
    UsageError,
    add_model_arguments,
    builtin_model,
    model_config_cls,
    parse_overrides,
    pick_device,
)
from memfit.errors import CheckpointError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from memfit.engine import Engine
    from memfit.precision.scaler import ScalerStats

CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
EVAL_SEED = 1_000_003


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in model (default: GPT on a byte corpus, bf16-mixed)",
        description="Train a built-in model and report loss, memory, throughput and skipped steps.",
    )
    add_model_arguments(p)
    p.add_argument("--data", default=None, help="corpus | synthetic (default: the model's first)")
    p.add_argument(
        "--steps", type=_positive_int, default=300, help="optimizer steps in all (default: 300)"
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=16,
        help="samples per optimizer step (default: 16)",
    )
    p.add_argument(
        "--accumulation",
        type=_positive_int,
        default=1,
        help="micro-batches per optimizer step (default: 1)",
    )
    p.add_argument(
        "--lr", type=_positive_float, default=1e-3, help="peak learning rate (default: 1e-3)"
    )
    p.add_argument(
        "--warmup", type=_nonneg_int, default=20, help="linear warmup steps (default: 20)"
    )
    p.add_argument(
        "--clip",
        type=_positive_float,
        default=1.0,
        help="clip the gradient norm to this (default: 1.0)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="activation checkpointing: none | auto | full | uniform:K | sqrt | optimal "
        "(default: none; auto with --budget)",
    )
    p.add_argument(
        "--budget", default=None, help="peak memory budget of a step for planning, e.g. 2GiB"
    )
    p.add_argument(
        "--out", default=None, help="run directory (default: runs/<model>-<precision>-<time>)"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR (its settings are reused; --steps may extend it)",
    )
    p.add_argument(
        "--eval-every",
        type=_positive_int,
        default=100,
        help="validation loss every N steps (default: 100)",
    )
    p.add_argument(
        "--eval-batches", type=_positive_int, default=8, help="validation batches (default: 8)"
    )
    p.add_argument(
        "--save-every",
        type=_positive_int,
        default=100,
        help="checkpoint every N steps (default: 100)",
    )
    p.add_argument(
        "--log-every",
        type=_positive_int,
        default=10,
        help="read metrics every N steps (default: 10)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.set_defaults(run=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Written to a temp file and renamed, so a crash never leaves half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _prepare_run_dir(args: argparse.Namespace) -> tuple[Path, dict[str, Any], bool]:
    """The run directory and its settings; refuses to overwrite another run."""
    if args.resume:
        run_dir = Path(args.resume)
        if run_dir.is_file():
            run_dir = run_dir.parent
        config_path = run_dir / CONFIG
        if not config_path.is_file():
            raise UsageError(
                f"--resume {args.resume}: no {CONFIG} there; is it a memfit run directory?"
            )
        settings = json.loads(config_path.read_text())
        if args.steps != 300:
            settings["steps"] = args.steps
        return run_dir, settings, True
    settings = {
        key: getattr(args, key)
        for key in (
            "model",
            "data",
            "precision",
            "steps",
            "batch_size",
            "accumulation",
            "lr",
            "warmup",
            "clip",
            "overrides",
            "checkpoint",
            "budget",
            "eval_every",
            "eval_batches",
            "save_every",
            "log_every",
            "seed",
        )
    }
    name = args.out or f"runs/{args.model}-{args.precision}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(name)
    if (run_dir / CHECKPOINT).exists() or (run_dir / CONFIG).exists():
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
            "or --out to start a new one"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write to run directory {run_dir}: {exc}") from None
    return run_dir, settings, False


def _lr_lambda(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _batch(batch_fn: Any, size: int, seed: int, split: str = "train") -> Any:
    return batch_fn(size, generator=seed, split=split)


@torch.no_grad()
def evaluate(engine: Any, loss_fn: Any, batch_fn: Any, batch_size: int, batches: int) -> float:
    """Mean validation loss over fixed batches, under the training precision."""
    model = engine.model
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(batches):
            batch = _batch(batch_fn, batch_size, EVAL_SEED + i, split="val")
            with engine.policy.autocast(engine.device.type):
                total += float(loss_fn(model, batch).float())
    finally:
        model.train(was_training)
    return total / batches


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=False)
    job = _build(args, console)
    outcome = _train_loop(job, console)
    _finish(job, outcome, console)
    return 0


@dataclass
class _Job:
    """A run ready to train: its settings, directory, Engine and data."""

    settings: dict[str, Any]
    run_dir: Path
    engine: Engine
    loss_fn: Any
    batch_fn: Any
    tokens_per_sample: int | None


@dataclass
class _Outcome:
    """What the training loop leaves for the summary."""

    train_loss: float
    val_loss: float
    samples_done: int
    elapsed: float


def _build(args: argparse.Namespace, console: Console) -> _Job:
    """Settings, run directory, model and Engine (new or resumed); prints the run's header."""
    import memfit

    run_dir, s, resuming = _prepare_run_dir(args)
    config_cls = model_config_cls(s["model"])
    memfit.PrecisionPolicy(s["precision"])  # a bad name fails here, before any work
    overrides = parse_overrides(s["overrides"], config_cls)
    device = pick_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    if not resuming:
        _write_json(run_dir / CONFIG, s)

    model, loss_fn, batch_fn = builtin_model(
        s["model"], overrides, data=s["data"], device=device, seed=s["seed"]
    )
    seq_len = getattr(model.config, "block_size", getattr(model.config, "seq_len", None))
    tokens_per_sample = seq_len if s["model"] in ("gpt", "lstm") else None
    flops_per_sample = float(model.flops_per_token() * seq_len) if s["model"] == "gpt" else None
    monitoring = dict(
        log_dir=run_dir, tokens_per_sample=tokens_per_sample, flops_per_sample=flops_per_sample
    )
    engine = _engine(s, run_dir, resuming, model, monitoring)
    if resuming:
        console.print(f"resumed {run_dir} at step {engine.steps}")
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]memfit train[/] {s['model']} ({n_params / 1e6:.2f}M params) · {engine.policy.mode} · "
        f"batch {s['batch_size']} x {s['accumulation']} micro · {s['steps']} steps · {device} · {run_dir}"
    )
    return _Job(s, run_dir, engine, loss_fn, batch_fn, tokens_per_sample)


def _engine(
    s: dict[str, Any], run_dir: Path, resuming: bool, model: Any, monitoring: dict[str, Any]
) -> Engine:
    """The optimizer, its schedule and the Engine: a new one, or the one saved in ``run_dir``."""
    import memfit

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], weight_decay=0.1, betas=(0.9, 0.95), fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(s["warmup"], s["steps"]))
    if resuming:
        return _resume(run_dir, model, optimizer, scheduler, monitoring)
    return memfit.Engine(
        model,
        optimizer,
        precision=s["precision"],
        checkpoint=s["checkpoint"],
        memory_budget=s["budget"],
        accumulation_steps=s["accumulation"],
        clip_grad_norm=s["clip"],
        lr_scheduler=scheduler,
        log_every=s["log_every"],
        **monitoring,
    )


def _resume(
    run_dir: Path, model: Any, optimizer: Any, scheduler: Any, monitoring: dict[str, Any]
) -> Engine:
    """The Engine saved in ``run_dir``; a broken checkpoint's error names the previous one."""
    import memfit

    path = run_dir / CHECKPOINT
    try:
        return memfit.Engine.resume(path, model, optimizer, lr_scheduler=scheduler, **monitoring)
    except CheckpointError as exc:
        previous = run_dir / PREVIOUS
        hint = (
            f" The previous checkpoint {previous} may still load: copy it over {path} "
            "to resume from it."
            if previous.exists()
            else ""
        )
        raise CheckpointError(f"{exc}{hint}") from None


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("step {task.completed:>5}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("scale {task.fields[scale]}"),
        TextColumn("mem {task.fields[mem]}"),
        TimeElapsedColumn(),
        console=console,
    )


def _progress_fields(metrics: dict[str, float], tokens_per_sample: int | None) -> dict[str, str]:
    """The progress bar's loss, speed, scale and memory from a log step's metrics."""
    from memfit.units import format_bytes

    sps = metrics["throughput/samples_per_second"]
    speed = (
        f"{sps * tokens_per_sample:,.0f} tok/s" if tokens_per_sample else f"{sps:,.1f} samples/s"
    )
    peak = metrics.get("memory/peak_bytes")
    return {
        "loss": f"{metrics['loss']:.4f}",
        "speed": speed,
        "scale": f"{metrics['amp/scale']:g}",
        "mem": format_bytes(peak) if peak else "-",
    }


def _train_loop(job: _Job, console: Console) -> _Outcome:
    """Train to ``steps`` with a progress bar, validating and saving on schedule."""
    s, engine = job.settings, job.engine
    val_loss = math.nan
    train_loss = math.nan
    started = time.perf_counter()
    samples_done = 0
    progress = _progress(console)
    with progress:
        task = progress.add_task(
            "train",
            total=s["steps"],
            completed=engine.steps,
            loss="-",
            speed="-",
            scale="-",
            mem="-",
        )
        while engine.steps < s["steps"]:
            batch = _batch(job.batch_fn, s["batch_size"], s["seed"] * 1_000_003 + engine.steps)
            engine.train_step(batch, job.loss_fn)
            samples_done += s["batch_size"]
            step = engine.steps
            if step % s["log_every"] == 0:
                train_loss = engine.metrics["loss"]
                progress.update(task, **_progress_fields(engine.metrics, job.tokens_per_sample))
            if step % s["eval_every"] == 0 or step == s["steps"]:
                val_loss = evaluate(
                    engine, job.loss_fn, job.batch_fn, s["batch_size"], s["eval_batches"]
                )
                engine.log_metrics({"val/loss": val_loss})
                progress.console.print(f"step {step}: validation loss {val_loss:.4f}")
            if step % s["save_every"] == 0 or step == s["steps"]:
                _save(engine, job.run_dir)
            progress.update(task, completed=step)
    elapsed = time.perf_counter() - started
    if engine.steps % s["log_every"] != 0 and samples_done:
        train_loss = engine.read_metrics()["loss"]
    return _Outcome(train_loss, val_loss, samples_done, elapsed)


def _finish(job: _Job, outcome: _Outcome, console: Console) -> None:
    """Write summary.json, health.json and plan.json, close the Engine, print the summary
    and health tables and write the report."""
    from memfit.monitor import health_to_dict, make_report, render_health

    engine, run_dir = job.engine, job.run_dir
    stats = engine.scaler.stats
    summary = _summary(job, outcome, stats)
    _write_json(run_dir / "summary.json", summary)
    checks = engine.health()
    _write_json(run_dir / "health.json", health_to_dict(checks))
    if engine.plan is not None and hasattr(engine.plan, "to_json"):
        (run_dir / "plan.json").write_text(engine.plan.to_json())
    engine.close()
    console.print(_summary_table(job, outcome, summary, stats))
    console.print(render_health(checks))
    try:
        report = make_report(run_dir)
        console.print(f"report: {report}")
    except Exception as exc:  # the run itself succeeded; a report problem is not fatal
        console.print(f"[yellow]report not written: {exc}[/]")


def _summary(job: _Job, outcome: _Outcome, stats: ScalerStats) -> dict[str, Any]:
    """What summary.json holds."""
    engine, elapsed, samples = job.engine, outcome.elapsed, outcome.samples_done
    return {
        "steps": engine.steps,
        "applied_steps": engine.applied_steps,
        "skipped_steps": stats.skipped,
        "final_train_loss": outcome.train_loss,
        "final_val_loss": outcome.val_loss,
        "peak_memory_bytes": engine.metrics.get("memory/peak_bytes"),
        "samples_per_second": samples / elapsed if elapsed > 0 else 0.0,
        "tokens_per_second": samples * job.tokens_per_sample / elapsed
        if job.tokens_per_sample and elapsed > 0
        else None,
        "wall_seconds": elapsed,
        "precision": engine.policy.mode,
        "loss_scale": stats.scale,
    }


def _summary_table(
    job: _Job, outcome: _Outcome, summary: dict[str, Any], stats: ScalerStats
) -> Table:
    from rich.table import Table

    from memfit.units import format_bytes

    engine = job.engine
    peak_bytes = summary["peak_memory_bytes"]
    table = Table(title="summary", show_header=False)
    table.add_row(
        "steps (applied / skipped)", f"{engine.steps} ({engine.applied_steps} / {stats.skipped})"
    )
    table.add_row("final train loss", f"{outcome.train_loss:.4f}")
    table.add_row("final validation loss", f"{outcome.val_loss:.4f}")
    table.add_row(
        "peak memory of a step", format_bytes(peak_bytes) if peak_bytes else "not measured"
    )
    if job.tokens_per_sample:
        table.add_row("throughput", f"{summary['tokens_per_second']:,.0f} tokens/s")
    else:
        table.add_row("throughput", f"{summary['samples_per_second']:,.1f} samples/s")
    table.add_row("precision / loss scale", f"{engine.policy.mode} / {stats.scale:g}")
    table.add_row("wall time", f"{outcome.elapsed:.1f} s")
    table.add_row("run directory", str(job.run_dir))
    return table


def _save(engine: Any, run_dir: Path) -> None:
    # The new checkpoint is complete on disk before the last good one is moved aside.
    path = run_dir / CHECKPOINT
    fresh = engine.save(run_dir / (CHECKPOINT + ".new"))
    if path.exists():
        os.replace(path, run_dir / PREVIOUS)
    os.replace(fresh, path)
