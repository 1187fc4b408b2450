"""``memfit plan``: profile a model, print the checkpoint plan for a budget and its frontier.

The model is a built-in one (``--model gpt``) or yours, given as ``module:factory``: a
function of no arguments returning ``(model, batch, loss_fn)`` with
``loss_fn(model, batch) -> scalar`` (the Engine's form), or ``(model, example_inputs)``
where ``model(example_inputs)``'s first floating-point output is summed as the loss. The
model and every tensor of the batch are moved to ``--device`` (default: cuda when it is
available), so a factory may build them on the CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memfit.cli.common import (
    UsageError,
    add_model_arguments,
    builtin_model,
    load_factory,
    model_config_cls,
    parse_overrides,
    pick_device,
    to_device,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="print the checkpoint plan for a memory budget, and the memory/time frontier",
        description="Profile a training step and plan activation checkpointing under a budget.",
    )
    add_model_arguments(p)
    p.add_argument(
        "--factory",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your model: FUNCTION() returns (model, batch, loss_fn) or (model, example_inputs)",
    )
    p.add_argument(
        "--budget", default=None, help="peak memory of a step, e.g. 2GiB (default: none)"
    )
    p.add_argument(
        "--strategy", default="optimal", help="none | full | uniform:K | sqrt | optimal (default)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, help="also write the plan's JSON to this file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import memfit
    from memfit.checkpoint.planner import plan_step, resolve_policy
    from memfit.checkpoint.profiler.runner import default_loss
    from memfit.nested import call_model

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    device = pick_device(args.device)
    if args.factory:
        made = load_factory(args.factory, "mypkg.models:build")()
        if not isinstance(made, tuple) or len(made) not in (2, 3):
            raise UsageError(
                f"--factory {args.factory}: must return (model, batch, loss_fn) or "
                f"(model, example_inputs), got {type(made).__name__}"
            )
        model = made[0].to(device)
        made = (model, to_device(made[1], device), *made[2:])
    else:
        overrides = parse_overrides(args.overrides, model_config_cls(args.model))
        model, loss_fn, batch_fn = builtin_model(
            args.model, overrides, data="synthetic", device=device, seed=0
        )
        made = (model, batch_fn(args.batch_size, generator=0), loss_fn)
    # "auto" is measured here, on the model and batch, as the Engine would measure it.
    if len(made) == 3:
        step_loss = made[2]
    else:
        step_loss = lambda m, b: default_loss(call_model(m, b))  # noqa: E731
    policy, chosen = resolve_policy(args.precision, model, made[1], step_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The Engine applies the precision (fp32 islands, low-precision weights and fp32
    # masters in the master modes), so the plan sees the step as training will run it.
    engine = memfit.Engine(model, optimizer, precision=policy, log_every=10**9)
    if len(made) == 3:
        plan = plan_step(
            model, made[1], made[2], args.budget, args.strategy, policy, engine.optimizer
        )
    else:
        plan = memfit.plan(
            model,
            made[1],
            budget=args.budget,
            strategy=args.strategy,
            precision=policy,
            optimizer=engine.optimizer,
        )
    plan.notes.extend(chosen)
    text = plan.to_json()
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.json else plan.summary())
    return 0
