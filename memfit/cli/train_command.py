"""``memfit train``: train a built-in model (or yours: ``--factory MODULE:FUNCTION`` or
``--factory path/to/file.py:FUNCTION`` returning a :class:`~memfit.workload.Workload`,
the form every subcommand's ``--factory`` takes; :func:`memfit.cli.common.factory_model`)
for a short run and report what it cost.

With no arguments: the built-in GPT on the standard-library byte corpus, in the fastest
precision for the machine (``--precision auto``: bf16-mixed where a bf16 matmul measures
faster than fp32, else fp32). ``--tune`` (with ``--budget``) lets :func:`memfit.tune`
choose the precision, the checkpoint plan and the split of ``--batch-size`` into
micro-batches; the choice is saved in ``config.json`` and kept on resume.
A run directory holds ``config.json`` (what was asked), ``checkpoint-<step>.pt`` (the saved
state, each written atomically; the ``--keep`` newest are kept), ``metrics.jsonl`` and
``summary.json`` (:mod:`memfit.cli.run_dir`).

**Start and restart are one command.** Run the same ``memfit train --out DIR ...`` (or
``--resume DIR``) again after a kill, and the run continues exactly (bitwise) from its last
good state file, whatever the kill left: no state file yet (it starts at step 0 with the
saved settings), a save cut short (its temp file is removed; the state before it is used),
or a finished run (exit 0, and what was missing, such as ``summary.json``, is written).
The built-in data is a function of the step, so the batches after a resume are the ones
the uninterrupted run trained on. SIGTERM or SIGINT saves at the end of the current step
and exits with code 75 (:data:`memfit.engine.preemption.PREEMPTED_EXIT_CODE`; a second
signal exits at once). ``--save-every N`` steps and ``--save-every-minutes M`` save on
schedule, whichever comes first.

A start that fails (a bad value, an unknown ``--set`` key, a budget or checkpoint spec
that does not parse, more micro-batches than samples, a device this machine lacks, a
checkpoint that does not fit) leaves the disk as it was: the model, the Engine and the
checkpoint plan are built in memory first, and the run directory and ``config.json`` are
made only after that (:mod:`memfit.cli.start`).

On resume the saved settings are kept. ``--steps`` (train longer), ``--log-every``,
``--eval-every``, ``--eval-batches``, ``--save-every``, ``--save-every-minutes`` and
``--keep`` may change: each change is applied, said in one line and written to
``config.json``. ``--device`` is not a saved setting: a resumed run runs where ``--device``
(or the default) says. Any other flag given with a value that differs from the saved one is
an error naming the flag, the saved and the given value; the same value (or an alias of it,
e.g. ``--precision bf16`` for ``bf16-mixed``) is accepted. ``--steps`` below the step a run
has reached is refused (a run cannot go back).

``--nproc N`` (or ``torchrun --nproc-per-node N -m memfit train ...``) trains on N processes
with DDP (gloo on CPU, nccl on GPU): ``--batch-size`` is the global batch (a multiple of N;
each rank trains its slice of it), and rank 0 alone writes the run directory and prints.
Every rank stops at the same step on a signal (the launcher forwards it to each).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.cli.common import (
    MODEL_DEFAULTS,
    UsageError,
    add_activation_storage_argument,
    add_factory_argument,
    add_model_arguments,
    builtin_model,
    factory_model,
    model_config_cls,
    parse_overrides,
    pick_device,
    positive_size,
    without_profiler_note,
)
from memfit.cli.run_dir import (
    CONFIG,
    remove_partial_files,
    trim_metrics,
    write_json,
)
from memfit.cli.start import (
    RESUMABLE,
    RunSinks,
    RunStart,
    flag,
    start_run,
    undone_on_failure,
)
from memfit.cli.train_loop import (
    Job,
    Outcome,
    batch_at,
    finish,
    step_seed,
    train_loop,
    validation_loss,
)
from memfit.errors import StateFileError

# torch, memfit.distributed and rich are imported where they are used: building the
# parser (memfit --help, memfit train --help) needs none of them.
if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from memfit.engine import Engine

#: Every setting of a run (what ``config.json`` holds) and its default. The flags are parsed
#: without defaults, so a flag given on the command line can be told from one left out.
TRAIN_DEFAULTS: dict[str, Any] = {
    **MODEL_DEFAULTS,
    "factory": None,  # MODULE:FUNCTION or file.py:FUNCTION returning a memfit.Workload
    "precision": "auto",  # measured on the machine: bf16-mixed where it is faster
    "optimizer_state": "fp32",  # AdamW's moments as torch keeps them
    "activation_storage": None,  # keep or recompute only
    "chunked_loss": False,  # the GPT's loss over the whole batch's logits at once
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
    "save_every_minutes": None,  # no time-based saving
    "keep": 2,
    "log_every": 10,
    "seed": 0,
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in model (default: GPT on a byte corpus, the fastest precision) "
        "or yours (--factory)",
        description="Train a built-in model (or yours, --factory) and report loss, memory, "
        "throughput and skipped steps.",
    )
    add_model_arguments(p, defaults=False)
    add_factory_argument(p, default=argparse.SUPPRESS)

    def setting(name: str, text: str, **kwargs: Any) -> None:
        default = TRAIN_DEFAULTS[name.removeprefix("--").replace("-", "_")]
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(name, default=argparse.SUPPRESS, help=text + shown, **kwargs)

    setting(
        "--optimizer-state",
        "how AdamW keeps its moments: fp32 (8 bytes a parameter) | bf16 (4) | 8bit (about 2)",
        choices=["fp32", "bf16", "8bit"],
    )
    add_activation_storage_argument(p, default=argparse.SUPPRESS)
    p.add_argument(
        "--chunked-loss",
        action="store_true",
        default=argparse.SUPPRESS,
        help="gpt: the final LayerNorm, head and loss a piece of the tokens at a time, each "
        "recomputed in backward (memfit.models.chunked_gpt_loss): never the whole batch's "
        "logits held, at one more forward of the head",
    )
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
    setting("--budget", "peak memory budget of a step for planning, e.g. 2GiB", type=positive_size)
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
    setting(
        "--save-every-minutes",
        "also save when M minutes passed since the last save",
        type=_positive_float,
        metavar="M",
    )
    setting("--keep", "keep the N newest state files", type=_positive_int, metavar="N")
    setting("--log-every", "read metrics every N steps", type=_positive_int)
    setting("--seed", "random seed", type=int)
    p.add_argument(
        "--out",
        default=None,
        help="run directory (default: runs/<model>-<precision>-<time>); a directory that "
        "holds a run continues it, so the same command restarts a killed run",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR from its last good state with its saved settings; only "
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


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """``memfit train``'s learning-rate factor at a step: linear warm-up over ``warmup``
    steps, then a cosine down to 10% at ``total`` (for ``LambdaLR``).

    Example::

        torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(20, 300))
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


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
    from memfit.engine.preemption import PREEMPTED_EXIT_CODE, Preempted

    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args.nproc, args.argv)
    world = init_from_env()
    console = Console(stderr=False, quiet=world.rank > 0)
    try:
        job = _build(args, console)
        if job.finished:
            finish(job, None, console)  # what a kill after the last step kept from being written
            return 0
        try:
            outcome = train_loop(job, console)
        except Preempted as stop:
            job.engine.close()
            rank = f"rank {world.rank}: " if world.distributed else ""
            print(f"memfit train: {rank}{stop}", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        finish(job, outcome, console)
    finally:
        if world.distributed:
            torch.distributed.destroy_process_group()
    return 0


def _launch(nproc: int, given: list[str]) -> int:
    """Run this same command (``given``: its arguments) on ``nproc`` processes under
    torchrun's launcher."""
    from torch.distributed import run as torchrun

    from memfit.engine.preemption import PREEMPTED_EXIT_CODE, signal_name

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
        signum = getattr(exc, "sigval", None)
        if signum is not None:  # SignalException: torchrun forwarded the signal to each rank
            print(
                f"memfit train --nproc {nproc}: {signal_name(signum)}; each rank was asked to "
                "save at the end of its step and stop; run the same command again to continue"
            )
            return PREEMPTED_EXIT_CODE
        codes = [f.exitcode for f in getattr(exc, "failures", {}).values()]
        # A rank that stopped saved with every rank (the save is collective); torchrun then
        # ends the others, which are exiting too, with a signal (a negative code).
        if PREEMPTED_EXIT_CODE in codes and all(c == PREEMPTED_EXIT_CODE or c < 0 for c in codes):
            print(
                f"memfit train --nproc {nproc}: the ranks saved and stopped on a signal; run "
                "the same command again to continue"
            )
            return PREEMPTED_EXIT_CODE
        print(f"memfit train --nproc {nproc}: a rank failed (exit codes {codes})")
        return max((c for c in codes if c > 0), default=1)  # a usage error stays 2
    return 0


def _build(args: argparse.Namespace, console: Console) -> Job:
    """Settings, model, Engine (new or resumed) and checkpoint plan, all in memory; then
    the run directory and its files. A failure before the directory is made leaves
    nothing; one while making it removes what it made. Prints the run's header."""
    import torch
    from rich.markup import escape

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
    start = start_run(given, TRAIN_DEFAULTS, args.out, args.resume, device)
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
    if s["factory"] is not None:
        clash = [flag(k) for k in ("model", "overrides", "data") if k in given]
        if clash:
            raise UsageError(
                f"{' and '.join(clash)} choose a built-in model; --factory builds its own"
            )
        overrides = {}
    else:
        overrides = parse_overrides(s["overrides"], model_config_cls(s["model"]))
    if s["chunked_loss"] and (s["factory"] is not None or s["model"] != "gpt"):
        what = "--factory's workload" if s["factory"] is not None else f"--model {s['model']}"
        raise UsageError(
            f"--chunked-loss is the built-in gpt's loss taken in pieces, not {what}'s; drop "
            "it (a factory's workload brings its own loss_fn, which may be "
            "memfit.models.chunked_gpt_loss for a memfit GPT)"
        )
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

    if s["factory"] is not None:
        model, loss_fn, batch_fn = factory_model(s["factory"], device=device, seed=s["seed"])
        name = s["factory"]
        tokens_per_sample = flops_per_sample = None
    else:
        model, loss_fn, batch_fn = builtin_model(
            s["model"], overrides, data=s["data"], device=device, seed=s["seed"]
        )
        if s["chunked_loss"]:
            from memfit.models.gpt import chunked_gpt_loss

            loss_fn = chunked_gpt_loss
        name = s["model"]
        seq_len = getattr(model.config, "block_size", getattr(model.config, "seq_len", None))
        tokens_per_sample = seq_len if s["model"] in ("gpt", "lstm") else None
        flops_per_sample = float(model.flops_per_token() * seq_len) if s["model"] == "gpt" else None
    tuned = None
    if s["tune"] and not start.resuming:
        tuned = _tune(s, given, overrides, loss_fn, batch_fn, device)
    sinks = RunSinks(run_dir)
    monitoring = dict(
        sinks=[sinks] if world.rank == 0 else [],
        tokens_per_sample=tokens_per_sample,
        flops_per_sample=flops_per_sample,
    )
    if world.distributed:  # the islands, then DDP; the optimizer is built after it
        model = memfit.parallelize(model, data_parallel="ddp", precision=s["precision"])
    engine, resumed_from, unreadable = _engine(start, model, monitoring)
    job = Job(s, run_dir, engine, loss_fn, batch_fn, tokens_per_sample)
    job.unreadable = [path for path, _ in unreadable]
    if resumed_from is not None:
        job.before = Outcome.from_saved(engine.extra)
    if engine.steps > s["steps"]:
        raise UsageError(
            f"the run in {run_dir} is already at step {engine.steps}, past --steps "
            f"{s['steps']}: a run cannot go back. Pass --steps N with N > {engine.steps} to "
            "train longer, or no --steps for the run as it is"
        )
    if resumed_from is not None and engine.steps == s["steps"]:
        job.finished = True  # nothing to train; finish() writes what is missing
        return job
    # Planned now, on the first step's first micro-batch (what train_step would plan on),
    # so a budget no plan meets fails before the run directory exists; precision "auto"
    # is chosen here too.
    first = batch_at(batch_fn, s["batch_size"], step_seed(s["seed"], engine.steps))
    engine.prepare(split_batch(shard_batch(first), s["accumulation"])[0], loss_fn)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]memfit train[/] {escape(name)} ({n_params / 1e6:.2f}M params) · {engine.policy.mode} · "
        f"batch {s['batch_size']} x {s['accumulation']} micro · {s['steps']} steps · {device} · {run_dir}"
    )
    if engine.auto.precision_choice is not None:
        console.print(engine.auto.precision_choice.describe(), markup=False, soft_wrap=True)
    if tuned is not None:
        console.print(tuned.summary(max_rows=8), markup=False, soft_wrap=True)
    if world.rank > 0:  # rank 0 alone writes the run directory
        return job

    with undone_on_failure(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        partial = remove_partial_files(run_dir)
        if start.resuming:  # rows a killed attempt logged past the step resumed from
            trim_metrics(run_dir, engine.steps)
        sinks.open()
        if start.config_changed:
            write_json(run_dir / CONFIG, s)
        if tuned is not None:
            (run_dir / "tune.json").write_text(tuned.to_json())
    for path in partial:
        console.print(f"removed {path.name}: a save cut short by a kill (never read)")
    for path, why in unreadable:
        console.print(f"passed over {path.name}: it does not load ({why})", markup=False)
    if resumed_from is not None:
        console.print(f"resumed {run_dir} at step {engine.steps} from {resumed_from.name}")
    elif start.resuming:
        console.print(
            f"restarted {run_dir} at step 0 with its saved settings (it stopped before its "
            "first save)"
        )
    if start.applied:
        console.print(f"applied on resume: {', '.join(start.applied)}")
    return job


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
    if s["chunked_loss"]:
        raise UsageError(
            "--chunked-loss with --nproc: the chunked loss runs the GPT's trunk and head "
            "apart, past DistributedDataParallel's forward, which would sync no gradient; "
            "train it on one process, or drop --chunked-loss"
        )
    if s["checkpoint"] not in (None, "none") or s["budget"] is not None:
        raise UsageError(
            "--checkpoint/--budget with --nproc: plan one rank's step with memfit.plan(..., "
            "world_size=N, data_parallel='ddp') and pass it to memfit.parallelize in a script "
            "(docs/distributed.md); the CLI trains data-parallel without a plan"
        )
    if s["precision"].endswith(("-master", "-sr")) or s["precision"] in (
        "16-true",
        "bf16-true",
        "O2",
    ):
        raise UsageError(
            f"--precision {s['precision']} keeps its weights in 16 bits (fp32 masters "
            "outside the model, or none), which the data-parallel CLI does not train; use "
            "bf16-mixed or fp16-mixed with --nproc"
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
    if s["factory"] is not None:
        from memfit.cli.common import load_workload

        model_fn = load_workload(s["factory"]).model_fn
    else:

        def model_fn() -> Any:
            return build_model(s["model"], data="synthetic", **overrides).model

    with without_profiler_note():  # torch's C++ note from memfit's measurements
        result = memfit.tune(
            model_fn,
            lambda n: batch_at(batch_fn, n, s["seed"]),
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


def _engine(
    start: RunStart, model: Any, monitoring: dict[str, Any]
) -> tuple[Engine, Path | None, list[tuple[Path, str]]]:
    """The optimizer, its schedule and the Engine: resumed from the run's newest state file
    that loads (with the run's ``log_every``, which may have changed on resume), or a new
    one. Returns it, the state file it resumed from (None: new) and those that did not
    load, each with why."""
    import torch

    import memfit

    s = start.settings
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], weight_decay=0.1, betas=(0.9, 0.95), fused=True
    )
    # The schedule keeps the length the run started with: a resume that trains longer
    # continues at the floor, exactly where the saved run's schedule was.
    horizon = s.setdefault("lr_schedule_steps", s["steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(s["warmup"], horizon))
    if start.state_files:
        monitoring = {**monitoring, "log_every": s["log_every"]}
        return _resume(start, model, optimizer, scheduler, monitoring)
    engine = memfit.Engine(
        model,
        optimizer,
        precision=s["precision"],
        checkpoint=s["checkpoint"],
        memory_budget=s["budget"],
        accumulation_steps=s["accumulation"],
        clip_grad_norm=s["clip"],
        lr_scheduler=scheduler,
        log_every=s["log_every"],
        optimizer_state=s.get("optimizer_state", "fp32"),
        **storage_of(s),
        **monitoring,
    )
    return engine, None, []


def storage_of(settings: dict[str, Any]) -> dict[str, Any]:
    """The Engine's ``activation_storage=`` of a run's settings (none when not given: the
    Engine's default, which a run without a planner needs)."""
    kinds = settings.get("activation_storage")
    return {} if kinds is None else {"activation_storage": tuple(kinds)}


def _resume(
    start: RunStart, model: Any, optimizer: Any, scheduler: Any, monitoring: dict[str, Any]
) -> tuple[Engine, Path, list[tuple[Path, str]]]:
    """The Engine saved in the newest of the run's state files that loads. A state file
    that does not (StateFileError: truncated, changed) is passed over before anything is
    built from it; when none loads, a StateFileError names each and what to do."""
    import memfit

    unreadable: list[tuple[Path, str]] = []
    for path in start.state_files:
        try:
            engine = memfit.Engine.resume(
                path, model, optimizer, lr_scheduler=scheduler, **monitoring
            )
        except StateFileError as exc:
            unreadable.append((path, str(exc)))
            continue
        return engine, path, unreadable
    raise StateFileError(
        f"no state file of the run in {start.run_dir} loads: "
        + "; ".join(f"{p.name}: {why}" for p, why in unreadable)
        + f". Move them out of {start.run_dir} to start the run again at step 0 with its "
        "saved settings, or restore a good one"
    )
