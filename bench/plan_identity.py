"""Plans of the zoo and the GPT benchmark under unit times made from FLOPs and bytes, as
JSON: run it on two versions of memfit and compare the files to see that a change kept
every plan and predicted peak.

The planner times each unit on the machine, and a plan picks the least recompute *time*
under the budget, so two runs of the same code can choose different plans between units
of nearly equal cost. Here every unit's times are a fixed function of its counted FLOPs and
bytes (the solver's input is otherwise the measured profile: saved bytes, inputs, outputs,
workspace), which makes the plans a function of the code alone.

Run (the memfit on PYTHONPATH is the one planned with)::

    PYTHONPATH=/path/to/old python bench/plan_identity.py --out old.json
    python bench/plan_identity.py --out new.json && cmp old.json new.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from typing import Any

import torch
import zoo  # bench/zoo.py: the models of bench/zoo_models.py, their batches and optimizers

import memfit
import memfit.checkpoint.planner as planner
from memfit.checkpoint.api import make_plan
from memfit.checkpoint.costs import UnitCost
from memfit.models import build_model

#: The GPT of bench/checkpoint.py and the budgets its --pairs-only table plans at.
GPT = {"n_layer": 16, "n_embd": 128, "n_head": 4, "block_size": 256}
GPT_BUDGETS = (None, "207.40MiB", "137.50MiB", "106.51MiB")


def fixed_times(unit: UnitCost) -> UnitCost:
    """``unit`` with every time a fixed function of its FLOPs and output bytes."""
    return dataclasses.replace(
        unit,
        children=[fixed_times(c) for c in unit.children],
        fwd_seconds=unit.fwd_flops * 1e-11 + unit.output_bytes * 1e-10,
        bwd_seconds=2 * unit.fwd_flops * 1e-11 + unit.output_bytes * 2e-10,
        non_matmul_fwd_seconds=unit.non_matmul_fwd_flops * 1e-10 + unit.output_bytes * 1e-10,
        tail_seconds=unit.tail_flops * 1e-11,
        piece_seconds=1e-5,
    )


def with_fixed_times() -> list[int]:
    """Make the planner's solver see :func:`fixed_times` (the planner's calls and the
    measured plans' at a budget's edge); returns a list counting its calls."""
    import memfit.checkpoint.measured_fit as measured_fit

    solve = planner.solve
    calls: list[int] = []

    def fixed(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        args = tuple(fixed_times(a) if isinstance(a, UnitCost) else a for a in args)
        return solve(*args, **kwargs)

    planner.solve = fixed
    measured_fit.solve = fixed
    return calls


def record(plan: memfit.Plan) -> dict[str, Any]:
    return {
        "predicted": plan.predicted_peak_bytes,
        "recompute_flops": plan.recompute_flops,
        "decisions": dict(sorted(plan.decisions.items())),
        "segments": [list(s) for s in plan.segments],
    }


def zoo_plans(budgets_per_model: int, names: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in names:
        spec = zoo.ZOO[name]
        for precision in zoo.PRECISIONS:
            torch.manual_seed(0)
            model = spec.build()
            inputs = spec.batch(torch.Generator().manual_seed(0))
            opt = zoo.make_optimizer(model, "adamw")
            zoo.make_step(model, opt, inputs, "fp32", spec.loss)()  # the optimizer state exists
            if precision != "fp32":
                memfit.precision.apply_precision(model, memfit.PrecisionPolicy(precision))
            whole = memfit.plan(model, inputs, spec.loss, precision=precision, optimizer=opt)
            rows[f"{name}/{precision}/none"] = record(whole)
            least = min(p.peak_bytes for p in whole.frontier)
            for k in range(budgets_per_model + 1):
                budget = int(least + (whole.predicted_peak_bytes - least) * k / budgets_per_model)
                key = f"{name}/{precision}/{budget}"
                try:
                    rows[key] = record(
                        memfit.plan(
                            model,
                            inputs,
                            spec.loss,
                            budget=budget,
                            precision=precision,
                            optimizer=opt,
                        )
                    )
                except memfit.MemfitError as exc:
                    rows[key] = {"error": f"{type(exc).__name__}: {exc}"}
            if precision != "fp32":
                memfit.precision.remove_precision(model)
            print(f"{name} {precision}: planned", flush=True)
    return rows


def gpt_plans() -> dict[str, Any]:
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", **GPT, data="synthetic")
    batch = batch_fn(16)
    opt = torch.optim.AdamW(model.parameters())
    rows = {}
    for budget in GPT_BUDGETS:
        result = make_plan(
            model, batch, loss_fn, optimizer=opt, precision="bf16-mixed", budget=budget
        )
        rows[f"gpt/bf16-mixed/{budget}"] = record(result.plan)
    print("gpt: planned", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the plans to this JSON file")
    parser.add_argument("--budgets", type=int, default=4, help="budgets per zoo model")
    parser.add_argument(
        "--models", default=",".join(zoo.ZOO), help=f"comma-separated, of: {', '.join(zoo.ZOO)}"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    torch.set_num_threads(1)
    calls = with_fixed_times()
    rows = {**gpt_plans(), **zoo_plans(args.budgets, [n for n in args.models.split(",") if n])}
    if not calls:
        raise SystemExit("the planner's solver was never called: the times were not fixed")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
    print(f"{len(rows)} plans ({len(calls)} solves) written to {args.out}")


if __name__ == "__main__":
    main()
