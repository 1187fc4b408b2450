"""Memory/time frontier of activation checkpointing on the built-in GPT, every point measured.

memfit's ``optimal`` plan at several budgets against ``none``, ``full``, ``uniform:k``,
``sqrt`` and, as the peer, ``torch.utils.checkpoint.checkpoint_sequential`` over the GPT's
blocks with several segment counts. Each point: the peak memory of a whole training step
(``memfit.measure``) and the median step time over interleaved rounds. A configuration
where activations dominate memory (long context, narrow model, many layers).

    python bench/checkpoint.py                  # the table in docs/benchmarks.md
    python bench/checkpoint.py --plot docs/checkpoint_frontier.png
    python bench/checkpoint.py --pairs-only --rounds 101   # the head-to-head alone, finer
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint_sequential

import memfit
from memfit.checkpoint.api import plan
from memfit.checkpoint.apply import apply_plan, remove_plan
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import RESERVE
from memfit.checkpoint.profiler import flop_counter
from memfit.errors import BudgetError
from memfit.models.gpt import gpt_loss
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments, build_gpt


def peer_loss(segments: int):
    """The GPT's loss with its blocks run by checkpoint_sequential (the hand-written peer)."""

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        pos = torch.arange(idx.size(1), device=idx.device)
        x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
        x = checkpoint_sequential(list(model.blocks), segments, x, use_reentrant=False)
        logits = model.lm_head(model.ln_f(x))
        return model.loss(logits, targets)

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_arguments(parser, n_layer=16, n_embd=128, n_head=4, block_size=256, batch_size=16)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--budgets", type=int, default=5, help="optimal plans between full and none"
    )
    parser.add_argument("--plot", default=None, help="write the frontier plot to this PNG")
    parser.add_argument(
        "--pairs-only",
        action="store_true",
        help="only none, the peers and optimal at their peaks (more rounds in the same time)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    def sync() -> None:
        # Kernels run asynchronously on CUDA: a step has ended when the device is idle.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model, _, batch_fn = build_gpt(args)
    model = model.to(device)
    batch = batch_fn(args.batch_size, generator=0).to(device)
    n = args.n_layer
    # One model and optimizer for every variant: each plan is applied in turn before its
    # step, so variants differ only in their plan (separate copies of the model differ in
    # step time by about 1% with the same plan: where their memory lies).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    engine = memfit.Engine(
        model, optimizer, precision=args.precision, log_every=10**9, monitor=False
    )
    engine.train_step(batch, gpt_loss)  # creates the optimizer state every variant sees

    def plan_for(strategy: str, budget: int | None = None) -> Plan:
        remove_plan(model)
        return plan(
            model,
            batch,
            gpt_loss,
            budget=budget,
            strategy=strategy,
            precision=engine.policy,
            optimizer=optimizer,
            frontier=False,
        )

    hi = plan_for("none")  # the planner's view of the step without checkpointing
    # name -> (plan or None, loss_fn)
    variants: dict[str, tuple[Plan | None, Callable]] = {"none": (None, gpt_loss)}
    if not args.pairs_only:
        variants["full (every block)"] = (plan_for("full"), gpt_loss)
        for k in (2, 4):
            variants[f"uniform:{k}"] = (plan_for(f"uniform:{k}"), gpt_loss)
        variants["sqrt"] = (plan_for("sqrt"), gpt_loss)
    root_n = round(math.sqrt(n))
    sqrt_peer = f"checkpoint_sequential({root_n})"
    segment_counts = sorted({2, root_n, n})
    for s in segment_counts:
        variants[f"checkpoint_sequential({s})"] = (None, peer_loss(s))
    # The √n peer once more: how far two runs of one thing land apart (the noise floor).
    control = f"{sqrt_peer}, again"
    variants[control] = (None, peer_loss(root_n))
    unmet: dict[str, str] = {}  # variants whose budget no plan meets, and why

    def add_optimal(label: str, budget: int) -> None:
        try:
            variants[label] = (plan_for("optimal", budget), gpt_loss)
        except BudgetError as exc:
            unmet[label] = str(exc)

    if not args.pairs_only:
        # Budgets from the least the planner can meet (its frontier's least peak plus the
        # reserve) to the unplanned peak.
        opt = plan(model, batch, gpt_loss, precision=engine.policy, optimizer=optimizer)
        lowest = min(p.peak_bytes for p in opt.frontier) / (1 - RESERVE) * 1.001
        for i in range(args.budgets):
            share = i / max(1, args.budgets - 1)
            budget = int(lowest + share * (hi.predicted_peak_bytes - lowest))
            add_optimal(f"optimal @ {format_bytes(budget)}", budget)

    def use(name: str) -> Callable:
        """Put the variant's plan (or none) on the model; return its loss function."""
        plan, loss_fn = variants[name]
        remove_plan(model)
        if plan is not None:
            apply_plan(model, plan)
        return loss_fn

    peaks: dict[str, int] = {}
    flops: dict[str, float] = {}

    def measure_all() -> None:
        for name in variants:
            if name in peaks:
                continue
            loss_fn = use(name)
            engine.train_step(batch, loss_fn)  # warm-up under this plan
            report = memfit.measure(
                lambda f=loss_fn: engine.train_step(batch, f), model=model, optimizer=optimizer
            )
            peaks[name] = report.peak_bytes
            # The work of a step, counted (not timed): its recompute is what exceeds none's.
            with flop_counter() as counter:
                engine.train_step(batch, loss_fn)
            flops[name] = counter.get_total_flops()

    measure_all()
    # The head-to-head at equal memory: memfit's optimal plan planned to peak where each
    # peer peaks (the planner keeps RESERVE of a budget free, so the budget is raised by
    # it; the measured peaks below show where each plan really landed).
    matched = {}
    for s in segment_counts:
        name = f"checkpoint_sequential({s})"
        budget = int(peaks[name] / (1 - RESERVE))
        matched[name] = f"optimal @ {format_bytes(budget)} (planned peak = {name}'s)"
        add_optimal(matched[name], budget)
    measure_all()
    predicted = {
        name: plan.predicted_peak_bytes if plan is not None else None
        for name, (plan, _) in variants.items()
    }
    recompute = {
        name: plan.recompute_flops if plan is not None else None
        for name, (plan, _) in variants.items()
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        # Each round starts at another variant, so no variant always runs in one position.
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            loss_fn = use(name)
            sync()
            start = time.perf_counter()
            engine.train_step(batch, loss_fn)
            sync()
            times[name].append(time.perf_counter() - start)
    remove_plan(model)

    def paired(a: str, b: str) -> float:
        """The median of the per-round ratios a/b: both ran in the same round, so slow
        phases of the machine cancel out."""
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    none_act = peaks["none"]
    print(
        f"GPT n_layer={n} n_embd={args.n_embd} block_size={args.block_size} batch {args.batch_size}, "
        f"{args.precision}, {device.type}"
        f"{'' if device.type == 'cuda' else f' ({torch.get_num_threads()} threads)'}, "
        f"median of {args.rounds} interleaved rounds\n"
    )

    def gflop(name: str) -> str:
        return f"{(flops[name] - flops['none']) / 1e9:.2f}"

    print(
        "| variant | measured peak | predicted peak | recompute GFLOP (counted) "
        "| recompute GFLOP (planned) | step time | vs none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in variants:
        t = statistics.median(times[name])
        pred = format_bytes(predicted[name]) if predicted[name] else "–"
        planned = "–" if recompute[name] is None else f"{recompute[name] / 1e9:.2f}"
        if name != control:
            rows.append((name, peaks[name], t))
        print(
            f"| {name} | {format_bytes(peaks[name])} | {pred} | {gflop(name)} | {planned} | "
            f"{t * 1000:.0f} ms | {(paired(name, 'none') - 1) * 100:+.1f}% |"
        )
    for name, why in unmet.items():
        print(f"| {name} | no plan: {why} |")
    print("\nmemfit optimal planned to peak where the peer peaks:\n")
    print(
        "| peer | peer peak | peer recompute | peer time | optimal peak | optimal recompute "
        "| optimal time | time vs peer (paired) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for peer, label in matched.items():
        if label in unmet:
            print(
                f"| {peer} | {format_bytes(peaks[peer])} | {gflop(peer)} GFLOP | – | no plan fits |"
            )
            continue
        tp, to = statistics.median(times[peer]), statistics.median(times[label])
        ratio = paired(label, peer)
        print(
            f"| {peer} | {format_bytes(peaks[peer])} | {gflop(peer)} GFLOP | {tp * 1000:.0f} ms "
            f"| {format_bytes(peaks[label])} | {gflop(label)} GFLOP | {to * 1000:.0f} ms "
            f"| {(ratio - 1) * 100:+.1f}% |"
        )
    for label in matched.values():
        plan_ = variants[label][0] if label in variants else None
        for note in plan_.notes if plan_ is not None else []:
            print(f"- {label}: {note}")  # e.g. a cheaper plan measured over the budget
    print(
        f"\nnoise floor: {control} against {sqrt_peer}, "
        f"the same thing twice: {(paired(control, sqrt_peer) - 1) * 100:+.1f}% (paired)"
    )
    static = hi.static_bytes
    print(
        f"\nstatic part (parameters, optimizer state, inputs): about {format_bytes(static)}; "
        f"activation memory of 'none' about {format_bytes(none_act - static)}"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for group, marker in (
            ("optimal", "o-"),
            ("checkpoint_sequential", "s--"),
            ("uniform", "^"),
            ("sqrt", "D"),
            ("full", "v"),
            ("none", "x"),
        ):
            pts = sorted((p / 2**20, t * 1000) for name, p, t in rows if name.startswith(group))
            if pts:
                ax.plot(*zip(*pts), marker, label=group)
        ax.set_xlabel("measured peak memory of a step (MiB)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title("Activation checkpointing: memory vs time (lower-left is better)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
