"""``memfit plan``: profile a model, print the checkpoint plan for a budget and its frontier.

The model is a built-in one (``--model gpt``) or yours: ``--factory MODULE:FUNCTION``,
whose ``FUNCTION()`` returns a :class:`~memfit.workload.Workload` (``model_fn``,
``batch_fn``, ``loss_fn``; the form every subcommand's ``--factory`` takes). The plan is
for ``model_fn()`` on ``batch_fn(--batch-size)`` with ``loss_fn(model, batch)`` (without
one, the sum of the output). The model and every tensor of the batch are moved to
``--device`` (default: cuda when it is available), so a factory may build them on the CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memfit.cli.common import (
    UsageError,
    add_activation_storage_argument,
    add_factory_argument,
    add_model_arguments,
    builtin_model,
    load_workload,
    model_config_cls,
    parse_overrides,
    pick_device,
    positive_size,
    to_device,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="print the checkpoint plan for a memory budget, and the memory/time frontier",
        description="Profile a training step and plan activation checkpointing under a budget.",
    )
    add_model_arguments(p)
    add_factory_argument(p)
    p.add_argument(
        "--budget",
        default=None,
        type=positive_size,
        help="peak memory of a step, e.g. 2GiB (default: none)",
    )
    p.add_argument(
        "--strategy", default="optimal", help="none | full | uniform:K | sqrt | optimal (default)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch size (default: 16)")
    add_activation_storage_argument(p, default=("keep", "recompute"))
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, help="also write the plan's JSON to this file")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="return the predicted plan without measuring its step on the example batch",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import memfit
    from memfit.checkpoint.api import default_step_loss
    from memfit.checkpoint.planner import resolve_policy

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    device = pick_device(args.device)
    if args.factory:
        workload = load_workload(args.factory)
        model = workload.model_fn().to(device)
        batch = to_device(workload.batch_fn(args.batch_size), device)
        loss_fn = workload.loss_fn
    else:
        overrides = parse_overrides(args.overrides, model_config_cls(args.model))
        model, loss_fn, batch_fn = builtin_model(
            args.model, overrides, data="synthetic", device=device, seed=0
        )
        batch = batch_fn(args.batch_size, generator=0)
    # "auto" is measured here, on the model and batch, as the Engine would measure it.
    policy, chosen = resolve_policy(args.precision, model, batch, loss_fn or default_step_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The Engine applies the precision (fp32 islands, low-precision weights and fp32
    # masters in the master modes), so the plan sees the step as training will run it.
    engine = memfit.Engine(model, optimizer, precision=policy, log_every=10**9)
    plan = memfit.plan(
        model,
        batch,
        loss_fn,
        budget=args.budget,
        strategy=args.strategy,
        precision=policy,
        optimizer=engine.optimizer,
        verify=args.verify,
        activation_storage=args.activation_storage,
    )
    plan.notes.extend(chosen)
    text = plan.to_json()
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.json else plan.summary())
    return 0
