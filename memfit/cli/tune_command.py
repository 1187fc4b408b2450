"""``memfit tune``: the precision, checkpoint plan, micro-batch and accumulation that fit a
budget and train fastest, searched on fake tensors and the best few measured on real steps.

The model is a built-in one (``--model gpt|resnet|lstm`` with ``--set KEY=VALUE``, on
synthetic data of its shape) or ``--factory MODULE:FUNCTION``, whose ``FUNCTION()`` returns
a :class:`~memfit.workload.Workload` (``model_fn``, ``batch_fn``, ``loss_fn``, the
arguments of :func:`memfit.tune`; the form every subcommand's ``--factory`` takes).

Computing (:func:`compute`) is kept apart from printing (:func:`run`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from memfit.cli.common import (
    UsageError,
    add_activation_storage_argument,
    add_factory_argument,
    add_model_choice,
    builtin_model,
    load_workload,
    model_config_cls,
    parse_overrides,
    pick_device,
    positive_size,
    without_profiler_note,
)

if TYPE_CHECKING:
    from memfit.tuning import TuneResult


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tune",
        help="choose precision, checkpointing, micro-batch and accumulation for a budget",
        description="Search precision x checkpoint plan x micro-batch x accumulation for a "
        "memory budget and a global batch on fake tensors, measure the best few on real "
        "steps, and print the choice with tuning advice.",
    )
    add_model_choice(p, "a built-in model's config field, e.g. --set n_layer=8 (repeatable)")
    add_factory_argument(p)
    p.add_argument(
        "--budget", required=True, type=positive_size, help="peak memory of a step, e.g. 2GiB"
    )
    p.add_argument(
        "--global-batch", type=int, default=16, help="samples per optimizer step (default: 16)"
    )
    p.add_argument(
        "--precisions",
        default=None,
        help="comma-separated modes to compare (default: fp32,bf16-mixed,bf16-master)",
    )
    p.add_argument(
        "--optimizer-state",
        default="fp32",
        choices=("fp32", "bf16", "8bit", "auto"),
        help="how AdamW keeps its moments in every setting; auto: 8bit only where nothing "
        "fits with fp32 (default: fp32)",
    )
    p.add_argument(
        "--release-gradients",
        default="off",
        choices=("off", "on", "auto"),
        help="apply each update as its gradient is made in backward, in every setting (on: "
        "one micro-batch a step, one process) or only where nothing fits without it (auto); "
        "default: off",
    )
    add_activation_storage_argument(p, default=("keep", "recompute"))
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default: 1)")
    p.add_argument(
        "--data-parallel",
        choices=("ddp", "fsdp"),
        default=None,
        help="how the ranks share the model (default with --world-size > 1: ddp)",
    )
    p.add_argument(
        "--measure-top",
        type=int,
        default=3,
        help="candidates measured on real steps (default: 3; 0: by prediction alone)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed rounds at least (default: 5); more follow until the fastest trial is "
        "separated from the rest beyond their noise, or tied",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="bound on the tuning time: past it no further trial starts and no extra round "
        "is timed (default: 300)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="measure only the tuner's own candidates, not the usual fixes (halving the "
        "micro-batch, checkpointing every block) beside them",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and data")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def compute(args: argparse.Namespace) -> TuneResult:
    """The tuner's result for the command line's model, budget and batch."""
    import memfit
    from memfit.models import build_model

    device = pick_device(args.device)
    precisions = None
    if args.precisions:
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if args.factory:
        if args.overrides:
            raise UsageError("--set changes a built-in model; --factory builds its own")
        workload = load_workload(args.factory)
        model_fn, batch_fn, loss_fn = workload.model_fn, workload.batch_fn, workload.loss_fn
    else:
        overrides = parse_overrides(args.overrides, model_config_cls(args.model))
        data = "synthetic"  # the shapes are the corpus's; tuning needs no real text
        _, loss_fn, real_batch = builtin_model(
            args.model, overrides, data=data, device=device, seed=args.seed
        )

        def model_fn() -> Any:
            return build_model(args.model, data=data, **overrides).model

        def batch_fn(n: int) -> Any:
            return real_batch(n, generator=args.seed)

    return memfit.tune(
        model_fn,
        batch_fn,
        loss_fn,
        budget=args.budget,
        global_batch=args.global_batch,
        precisions=precisions,
        world_size=args.world_size,
        data_parallel=args.data_parallel,
        measure_top=args.measure_top,
        steps=args.steps,
        peers=not args.no_peers,
        max_seconds=args.max_seconds,
        device=device,
        optimizer_state=args.optimizer_state,
        release_gradients={"off": False, "on": True}.get(args.release_gradients, "auto"),
        activation_storage=args.activation_storage,
    )


def run(args: argparse.Namespace) -> int:
    with without_profiler_note():  # torch's C++ note from memfit's measurements
        result = compute(args)
    print(result.to_json() if args.json else result.summary())
    return 0
