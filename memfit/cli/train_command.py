"""``memfit train``: train a built-in model for a short run and report what it cost.

With no arguments: the built-in GPT on the standard-library byte corpus, in the fastest
precision for the machine (``--precision auto``: bf16-mixed where a bf16 matmul measures
faster than fp32, else fp32). ``--tune`` (with ``--budget``) lets :func:`memfit.tune`
choose the precision, the checkpoint plan and the split of ``--batch-size`` into
micro-batches; the choice is saved in ``config.json`` and kept on resume.
A run directory holds ``config.json`` (what was asked), ``checkpoint.pt`` (the latest state,
written atomically; the one before it is kept as ``checkpoint.prev.pt``), ``metrics.jsonl``
and ``summary.json``. ``--resume DIR`` continues a run exactly where it stopped.

A start that fails (a bad value, an unknown ``--set`` key, a budget or checkpoint spec
that does not parse, more micro-batches than samples, a device this machine lacks, a
checkpoint that does not fit) leaves the disk as it was: the model, the Engine and the
checkpoint plan are built in memory first, and the run directory and ``config.json`` are
made only after that (:mod:`memfit.cli.start`).

On ``--resume`` the saved settings are kept. ``--steps`` (train longer), ``--log-every``,
``--eval-every``, ``--eval-batches`` and ``--save-every`` may change: each change is
applied, said in one line and written to ``config.json``. ``--device`` is not a saved
setting: a resumed run runs where ``--device`` (or the default) says. Any other flag given
with a value that differs from the saved one is an error naming the flag, the saved and
the given value; the same value (or an alias of it, e.g. ``--precision bf16`` for
``bf16-mixed``) is accepted. Resuming a run that has reached its ``--steps`` is refused, so
its summary and report are kept.

``--nproc N`` (or ``torchrun --nproc-per-node N -m memfit train ...``) trains on N processes
with DDP (gloo on CPU, nccl on GPU): ``--batch-size`` is the global batch (a multiple of N;
each rank trains its slice of it), and rank 0 alone writes the run directory and prints.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.cli.common import (
    MODEL_DEFAULTS,
    UsageError,
    add_model_arguments,
    builtin_model,
    model_config_cls,
    parse_overrides,
    pick_device,
)
from memfit.cli.start import (
    CHECKPOINT,
    CONFIG,
    PREVIOUS,
    RESUMABLE,
    RunSinks,
    RunStart,
    flag,
    new_run,
    resume_settings,
    undone_on_failure,
    write_json,
)
from memfit.errors import StateFileError

# torch, memfit.distributed and rich are imported where they are used: building the
# parser (memfit --help, memfit train --help) needs none of them.
if TYPE_CHECKING:
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from memfit.engine import Engine
    from memfit.precision.scaler import ScalerStats

EVAL_SEED = 1_000_003


#: Every setting of a run (what ``config.json`` holds) and its default. The flags are parsed
#: without defaults, so a flag given on the command line can be told from one left out.
TRAIN_DEFAULTS: dict[str, Any] = {
    **MODEL_DEFAULTS,
    "precision": "auto",  # measured on the machine: bf16-mixed where it is faster
    "tune": False,
    "data": None,
    "steps": 300,
    "batch_size": 16,
    "accumulation": 1,
    "lr": 1e-3,
    "warmup": 20,
    "clip": 1.0,
    "checkpoint": None,  # none; auto when --budget is given
    "budget": None,
    "eval_every": 100,
    "eval_batches": 8,
    "save_every": 100,
    "log_every": 10,
    "seed": 0,
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in model (default: GPT on a byte corpus, the fastest precision)",
        description="Train a built-in model and report loss, memory, throughput and skipped steps.",
    )
    add_model_arguments(p, defaults=False)

    def setting(name: str, text: str, **kwargs: Any) -> None:
        default = TRAIN_DEFAULTS[name.removeprefix("--").replace("-", "_")]
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(name, default=argparse.SUPPRESS, help=text + shown, **kwargs)

    setting("--data", "corpus | synthetic (default: the model's first)")
    setting("--steps", "optimizer steps in all", type=_positive_int)
    setting("--batch-size", "samples per optimizer step", type=_positive_int)
    setting("--accumulation", "micro-batches per optimizer step", type=_positive_int)
    setting("--lr", "peak learning rate", type=_positive_float)
    setting("--warmup", "linear warmup steps", type=_nonneg_int)
    setting("--clip", "clip the gradient norm to this", type=_positive_float)
    setting(
        "--checkpoint",
        "activation checkpointing: none | auto | full | uniform:K | sqrt | optimal "
        "(default: none; auto with --budget)",
    )
    setting("--budget", "peak memory budget of a step for planning, e.g. 2GiB")
    p.add_argument(
        "--tune",
        action="store_true",
        default=argparse.SUPPRESS,
        help="choose precision, checkpointing and accumulation for --budget and "
        "--batch-size with memfit.tune (saved with the run)",
    )
    setting("--eval-every", "validation loss every N steps", type=_positive_int)
    setting("--eval-batches", "validation batches", type=_positive_int)
    setting("--save-every", "save the training state every N steps", type=_positive_int)
    setting("--log-every", "read metrics every N steps", type=_positive_int)
    setting("--seed", "random seed", type=int)
    p.add_argument(
        "--out", default=None, help="run directory (default: runs/<model>-<precision>-<time>)"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR with its saved settings; only "
        + ", ".join(flag(k) for k in RESUMABLE)
        + " and --device may change",
    )
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="train on N processes with DDP (torchrun; gloo on CPU, nccl on GPU)",
    )
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


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line (the flags left out are not in it)."""
    return {key: value for key, value in vars(args).items() if key in TRAIN_DEFAULTS}


def _lr_lambda(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _batch(batch_fn: Any, size: int, seed: int, split: str = "train") -> Any:
    return batch_fn(size, generator=seed, split=split)


def validation_loss(
    engine: Any, loss_fn: Any, batch_fn: Any, batch_size: int, batches: int
) -> float:
    """:func:`memfit.evaluate` on the run's validation batches: ``batches`` of them drawn
    from the ``val`` split with fixed seeds, so every evaluation of a run (resumed or not)
    sees the same ones.

    Example::

        val = validation_loss(engine, loss_fn, batch_fn, batch_size=16, batches=8)
    """
    from memfit.engine import evaluate

    fixed = (_batch(batch_fn, batch_size, EVAL_SEED + i, split="val") for i in range(batches))
    return evaluate(engine, fixed, loss_fn)


def __getattr__(name: str) -> Any:
    # This module's evaluate() drew the validation batches: renamed for that difference
    # from memfit.evaluate, the old name works for one release.
    if name == "evaluate":
        from memfit.deprecations import warn_renamed

        warn_renamed(f"{__name__}.evaluate", f"{__name__}.validation_loss")
        return validation_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from memfit.distributed import init_from_env

    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args.nproc, args.argv)
    world = init_from_env()
    console = Console(stderr=False, quiet=world.rank > 0)
    try:
        job = _build(args, console)
        outcome = _train_loop(job, console)
        _finish(job, outcome, console)
    finally:
        if world.distributed:
            torch.distributed.destroy_process_group()
    return 0


def _launch(nproc: int, given: list[str]) -> int:
    """Run this same command (``given``: its arguments) on ``nproc`` processes under
    torchrun's launcher."""
    from torch.distributed import run as torchrun

    argv, skip = [], False
    for arg in given:
        if skip or arg == "--nproc" or arg.startswith("--nproc="):
            skip = arg == "--nproc"
            continue
        argv.append(arg)
    command = ["--standalone", "--nproc-per-node", str(nproc), "-m", "memfit", *argv]
    try:
        torchrun.main(command)
    except Exception as exc:  # torchrun's ChildFailedError: the ranks printed their errors
        codes = [f.exitcode for f in getattr(exc, "failures", {}).values()]
        print(f"memfit train --nproc {nproc}: a rank failed (exit codes {codes})")
        return max((c for c in codes if c > 0), default=1)  # a usage error stays 2
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
    """Settings, model, Engine (new or resumed) and checkpoint plan, all in memory; then
    the run directory and its files. A failure before the directory is made leaves
    nothing; one while making it removes what it made. Prints the run's header."""
    import torch

    import memfit
    from memfit.checkpoint.solvers import parse_strategy
    from memfit.distributed import check_global_batch, current_world, from_rank0, shard_batch
    from memfit.engine import split_batch
    from memfit.units import parse_bytes

    world = current_world()
    device = pick_device(args.device)
    if world.distributed and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    given = given_settings(args)
    if args.resume:
        start = resume_settings(args.resume, given, TRAIN_DEFAULTS, args.out, device)
    else:
        start = new_run(given, TRAIN_DEFAULTS, args.out)
    s, run_dir = start.settings, start.run_dir
    if world.distributed:
        # A default name holds the time, and a measured speed may differ: rank 0's for all.
        run_dir = start.run_dir = Path(from_rank0(str(run_dir)))
        _check_distributed(s, world.world_size, check_global_batch)
        if s["precision"] == "auto":  # chosen once, before parallelize casts anything
            from memfit.precision.speed import choose_precision

            choice = choose_precision(device)
            s["precision"] = from_rank0(choice.mode)
            console.print(choice.describe(), markup=False, soft_wrap=True)
    overrides = parse_overrides(s["overrides"], model_config_cls(s["model"]))
    if s["precision"] != "auto":
        memfit.PrecisionPolicy(s["precision"]).check_device(device)
    if s["checkpoint"] is None:  # a budget plans (the Engine's rule), saved as resolved
        s["checkpoint"] = "auto" if s["budget"] is not None else "none"
    # The Engine checks these too, but only once the model is built: fail fast.
    if s["checkpoint"] not in ("none", "auto"):
        parse_strategy(s["checkpoint"])
    if s["budget"] is not None:
        parse_bytes(s["budget"], device)
    if s["accumulation"] > s["batch_size"]:
        raise UsageError(
            f"--accumulation {s['accumulation']} is more micro-batches than --batch-size "
            f"{s['batch_size']} has samples; use at most {s['batch_size']} micro-batches"
        )

    model, loss_fn, batch_fn = builtin_model(
        s["model"], overrides, data=s["data"], device=device, seed=s["seed"]
    )
    tuned = None
    if s["tune"] and not start.resuming:
        tuned = _tune(s, given, overrides, loss_fn, batch_fn, device)
    seq_len = getattr(model.config, "block_size", getattr(model.config, "seq_len", None))
    tokens_per_sample = seq_len if s["model"] in ("gpt", "lstm") else None
    flops_per_sample = float(model.flops_per_token() * seq_len) if s["model"] == "gpt" else None
    sinks = RunSinks(run_dir)
    monitoring = dict(
        sinks=[sinks] if world.rank == 0 else [],
        tokens_per_sample=tokens_per_sample,
        flops_per_sample=flops_per_sample,
    )
    if world.distributed:  # the islands, then DDP; the optimizer is built after it
        model = memfit.parallelize(model, data_parallel="ddp", precision=s["precision"])
    engine = _engine(start, model, monitoring)
    if start.resuming and engine.steps >= s["steps"]:
        # Nothing to train: the summary and report of the finished run are kept as they are.
        raise UsageError(
            f"the run in {run_dir} is already at step {engine.steps} of --steps {s['steps']}; "
            f"pass --steps N with N > {engine.steps} to train longer"
        )
    # Planned now, on the first step's first micro-batch (what train_step would plan on),
    # so a budget no plan meets fails before the run directory exists; precision "auto"
    # is chosen here too.
    first = _batch(batch_fn, s["batch_size"], s["seed"] * 1_000_003 + engine.steps)
    engine.prepare(split_batch(shard_batch(first), s["accumulation"])[0], loss_fn)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]memfit train[/] {s['model']} ({n_params / 1e6:.2f}M params) · {engine.policy.mode} · "
        f"batch {s['batch_size']} x {s['accumulation']} micro · {s['steps']} steps · {device} · {run_dir}"
    )
    if engine.auto.precision_choice is not None:
        console.print(engine.auto.precision_choice.describe(), markup=False, soft_wrap=True)
    if tuned is not None:
        console.print(tuned.summary(max_rows=8), markup=False, soft_wrap=True)
    if world.rank > 0:  # rank 0 alone writes the run directory
        return _Job(s, run_dir, engine, loss_fn, batch_fn, tokens_per_sample)

    with undone_on_failure(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        sinks.open()
        if start.config_changed:
            write_json(run_dir / CONFIG, s)
        if tuned is not None:
            (run_dir / "tune.json").write_text(tuned.to_json())
    if start.resuming:
        console.print(f"resumed {run_dir} at step {engine.steps}")
    if start.applied:
        console.print(f"applied on resume: {', '.join(start.applied)}")
    return _Job(s, run_dir, engine, loss_fn, batch_fn, tokens_per_sample)


def _check_distributed(s: dict[str, Any], world_size: int, check_global_batch: Any) -> None:
    """UsageError for settings a DDP run cannot take."""
    from memfit.errors import ConfigError

    try:
        per_rank = check_global_batch(s["batch_size"], world_size)
    except ConfigError as exc:
        raise UsageError(f"--batch-size: {exc}") from None
    if s["accumulation"] > per_rank:
        raise UsageError(
            f"--accumulation {s['accumulation']} is more micro-batches than a rank's "
            f"{per_rank} samples (--batch-size {s['batch_size']} over {world_size} ranks)"
        )
    if s["checkpoint"] not in (None, "none") or s["budget"] is not None:
        raise UsageError(
            "--checkpoint/--budget with --nproc: plan one rank's step with memfit.plan(..., "
            "world_size=N, data_parallel='ddp') and pass it to memfit.parallelize in a script "
            "(docs/distributed.md); the CLI trains data-parallel without a plan"
        )
    if s["precision"].endswith("-master") or s["precision"] in ("16-true", "bf16-true", "O2"):
        raise UsageError(
            f"--precision {s['precision']} keeps fp32 masters outside the model, which DDP "
            "does not reduce; use bf16-mixed or fp16-mixed with --nproc"
        )


def _tune(
    s: dict[str, Any],
    given: dict[str, Any],
    overrides: dict[str, Any],
    loss_fn: Any,
    batch_fn: Any,
    device: torch.device,
) -> Any:
    """Run the tuner for ``--tune`` and write its choice into the run's settings ``s``
    (precision, checkpoint, accumulation), so that they are saved and kept on resume."""
    import memfit
    from memfit.models import build_model

    clash = [flag(k) for k in ("accumulation", "checkpoint") if k in given]
    if clash:
        raise UsageError(f"--tune chooses {' and '.join(clash)} itself; drop them or --tune")
    if s["budget"] is None:
        raise UsageError("--tune needs --budget: the memory the step must fit, e.g. 2GiB")
    precisions = None if s["precision"] == "auto" else [s["precision"]]
    result = memfit.tune(
        lambda: build_model(s["model"], data="synthetic", **overrides).model,
        lambda n: _batch(batch_fn, n, s["seed"]),
        loss_fn,
        budget=s["budget"],
        global_batch=s["batch_size"],
        precisions=precisions,
        measure_top=3,
        steps=2,
        device=device,
    )
    best = result.best
    s["precision"] = best.precision
    s["accumulation"] = best.accumulation_steps
    # The real model is planned at the budget: where no checkpointing was predicted to be
    # needed, the planner finds it too (and the budget stays checked).
    s["checkpoint"] = "auto" if best.checkpoint in ("none", "optimal") else best.checkpoint
    return result


def _engine(start: RunStart, model: Any, monitoring: dict[str, Any]) -> Engine:
    """The optimizer, its schedule and the Engine: a new one, or the one saved in the run
    directory (with the run's ``log_every``, which may have changed on resume)."""
    import torch

    import memfit

    s = start.settings
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], weight_decay=0.1, betas=(0.9, 0.95), fused=True
    )
    # The schedule keeps the length the run started with: a resume that trains longer
    # continues at the floor, exactly where the saved run's schedule was.
    horizon = s.setdefault("lr_schedule_steps", s["steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(s["warmup"], horizon))
    if start.resuming:
        monitoring = {**monitoring, "log_every": s["log_every"]}
        return _resume(start.run_dir, model, optimizer, scheduler, monitoring)
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
    """The Engine saved in ``run_dir``; a broken state file's error names the previous one."""
    import memfit

    path = run_dir / CHECKPOINT
    try:
        return memfit.Engine.resume(path, model, optimizer, lr_scheduler=scheduler, **monitoring)
    except StateFileError as exc:
        previous = run_dir / PREVIOUS
        hint = (
            f" The previous state file {previous} may still load: copy it over {path} "
            "to resume from it."
            if previous.exists()
            else ""
        )
        raise StateFileError(f"{exc}{hint}") from None


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
    from memfit.distributed import shard_batch

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
            engine.train_step(shard_batch(batch), job.loss_fn)
            samples_done += s["batch_size"]
            step = engine.steps
            if step % s["log_every"] == 0:
                train_loss = engine.metrics["loss"]
                progress.update(task, **_progress_fields(engine.metrics, job.tokens_per_sample))
            if step % s["eval_every"] == 0 or step == s["steps"]:
                val_loss = validation_loss(
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
    from memfit.distributed import current_world
    from memfit.monitor import health_to_dict, make_report, render_health

    engine, run_dir = job.engine, job.run_dir
    stats = engine.scaler.stats
    if current_world().rank > 0:
        engine.close()
        return
    summary = _summary(job, outcome, stats)
    write_json(run_dir / "summary.json", summary)
    checks = engine.health()
    write_json(run_dir / "health.json", health_to_dict(checks))
    if engine.plan is not None and hasattr(engine.plan, "to_json"):
        (run_dir / "plan.json").write_text(engine.plan.to_json())
    engine.close()
    console.print(_summary_table(job, outcome, summary, stats))
    console.print(render_health(checks))
    try:
        _print_advice(run_dir, console)
    except Exception as exc:  # the run itself succeeded; advice is not worth failing it
        console.print(f"[yellow]no advice: {exc}[/]")
    try:
        report = make_report(run_dir)
        console.print(f"report: {report}")
    except Exception as exc:  # the run itself succeeded; a report problem is not fatal
        console.print(f"[yellow]report not written: {exc}[/]")


def _print_advice(run_dir: Path, console: Console) -> None:
    """The advice block: from the run directory's records, so that a resumed run's advice
    covers the whole run (``memfit report RUN_DIR`` prints the same)."""
    from memfit.monitor import render_advice
    from memfit.tuning import run_advice

    console.print("[bold]advice[/] (memfit tune measures the choice; these read the run)")
    console.print(render_advice(run_advice(run_dir)), markup=False, soft_wrap=True)


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
        # What the advice needs beyond the metrics (memfit.tuning.run_advice on the run directory).
        "budget_bytes": engine.settings.memory_budget,
        "accumulation_steps": engine.settings.accumulation_steps,
        "init_scale": engine.scaler.init_scale,
        "growth_interval": engine.scaler.growth_interval,
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
    from memfit.distributed import current_world

    # The new state file is complete on disk before the last good one is moved aside.
    path = run_dir / CHECKPOINT
    fresh = engine.save(run_dir / (CHECKPOINT + ".new"))  # every rank: rank 0 writes
    if current_world().rank > 0:
        return
    if path.exists():
        os.replace(path, run_dir / PREVIOUS)
    os.replace(fresh, path)
