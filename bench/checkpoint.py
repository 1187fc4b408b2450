"""Memory/time frontier of activation checkpointing on the built-in GPT, every point measured.

memfit's ``optimal`` plan at several budgets against ``none``, ``full``, ``uniform:k``,
``sqrt`` and, as the peer, ``torch.utils.checkpoint.checkpoint_sequential`` over the GPT's
blocks with several segment counts. Each point: the peak memory of a whole training step
(``memfit.measure``) and the median step time over interleaved rounds. A configuration
where activations dominate memory (long context, narrow model, many layers).

    python bench/checkpoint.py                  # the table in docs/benchmarks.md
    python bench/checkpoint.py --plot docs/checkpoint_frontier.png
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint_sequential

import memfit
from memfit.checkpoint.api import RESERVE, plan_step
from memfit.checkpoint.profile import flop_counter
from memfit.errors import BudgetError
from memfit.models import build_model
from memfit.models.gpt import gpt_loss
from memfit.units import format_bytes


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
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--budgets", type=int, default=5, help="optimal plans between full and none"
    )
    parser.add_argument("--plot", default=None, help="write the frontier plot to this PNG")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    def sync() -> None:
        # Kernels run asynchronously on CUDA: a step has ended when the device is idle.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(0)
    base, _, batch_fn = build_model(
        "gpt",
        data="synthetic",
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        block_size=args.block_size,
    )
    base = base.to(device)
    batch = batch_fn(args.batch_size, generator=0).to(device)
    n = args.n_layer

    def engine_for(checkpoint, loss_fn=gpt_loss, budget=None):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        engine = memfit.Engine(
            model,
            optimizer,
            precision=args.precision,
            checkpoint=checkpoint,
            memory_budget=budget,
            log_every=10**9,
            monitor=False,
        )
        return engine, loss_fn

    # The planner's view, for the optimal budgets and the predicted column.
    probe, _ = engine_for("none")
    opt = plan_step(probe.model, batch, gpt_loss, None, "optimal", args.precision, probe.optimizer)
    hi = plan_step(probe.model, batch, gpt_loss, None, "none", args.precision, probe.optimizer)
    # The least budget the planner can meet: its frontier's least peak plus the reserve.
    lowest = min(p.peak_bytes for p in opt.frontier) / (1 - RESERVE) * 1.001
    variants: dict[str, tuple] = {
        "none": engine_for("none"),
        "full (every block)": engine_for("full"),
    }
    for k in (2, 4):
        variants[f"uniform:{k}"] = engine_for(f"uniform:{k}")
    variants["sqrt"] = engine_for("sqrt")
    for s in sorted({2, round(math.sqrt(n)), n}):
        variants[f"checkpoint_sequential({s})"] = engine_for("none", peer_loss(s))
    for i in range(args.budgets):
        budget = int(lowest + i / max(1, args.budgets - 1) * (hi.predicted_peak_bytes - lowest))
        variants[f"optimal @ {format_bytes(budget)}"] = engine_for("optimal", gpt_loss, budget)

    peaks, predicted, recompute, flops = {}, {}, {}, {}
    unmet: dict[str, str] = {}  # variants whose budget no plan meets, and why

    def measure_all() -> None:
        for name, (engine, loss_fn) in list(variants.items()):
            if name in peaks:
                continue
            try:
                engine.train_step(batch, loss_fn)  # plans (if asked), creates optimizer state
            except BudgetError as exc:
                unmet[name] = str(exc)
                del variants[name]
                continue
            report = memfit.measure(
                lambda e=engine, f=loss_fn: e.train_step(batch, f),
                model=engine.model,
                optimizer=engine.optimizer,
            )
            peaks[name] = report.peak_bytes
            # The work of a step, counted (not timed): its recompute is what exceeds none's.
            with flop_counter() as counter:
                engine.train_step(batch, loss_fn)
            flops[name] = counter.get_total_flops()
            plan = engine.plan
            predicted[name] = plan.predicted_peak_bytes if plan is not None else None
            recompute[name] = plan.recompute_flops if plan is not None else None

    measure_all()
    # The head-to-head at equal memory: memfit's optimal plan planned to peak where each
    # peer peaks (the planner keeps RESERVE of a budget free, so the budget is raised by
    # it; the measured peaks below show where each plan really landed).
    matched = {}
    for name in [v for v in variants if v.startswith("checkpoint_sequential")]:
        budget = int(peaks[name] / (1 - RESERVE))
        label = f"optimal @ {format_bytes(budget)} (planned peak = {name}'s)"
        variants[label] = engine_for("optimal", gpt_loss, budget)
        matched[name] = label
    measure_all()
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        # Each round starts at another variant, so no variant always runs in one position.
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            engine, loss_fn = variants[name]
            sync()
            start = time.perf_counter()
            engine.train_step(batch, loss_fn)
            sync()
            times[name].append(time.perf_counter() - start)

    none_time = statistics.median(times["none"])
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
        rows.append((name, peaks[name], t))
        print(
            f"| {name} | {format_bytes(peaks[name])} | {pred} | {gflop(name)} | {planned} | "
            f"{t * 1000:.0f} ms | {(t / none_time - 1) * 100:+.1f}% |"
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
        # The median of the per-round ratios: both ran in the same round, so slow phases of
        # the machine cancel out.
        ratio = statistics.median(a / b for a, b in zip(times[label], times[peer]))
        print(
            f"| {peer} | {format_bytes(peaks[peer])} | {gflop(peer)} GFLOP | {tp * 1000:.0f} ms "
            f"| {format_bytes(peaks[label])} | {gflop(label)} GFLOP | {to * 1000:.0f} ms "
            f"| {(ratio - 1) * 100:+.1f}% |"
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
