"""Step time and peak memory of the built-in GPT under each precision, against a hand loop.

The peer is the loop people write by hand with ``torch.autocast`` (bf16, fused AdamW, no
loss scaling, gradient clipping). Steps of all variants are interleaved round by round, so
drift in the machine's speed hits them alike; each time is the median over the rounds.
Peak memory is measured once per variant with ``memfit.measure``.

    python bench/precision.py                 # the table in docs/benchmarks.md
    python bench/precision.py --rounds 5 --n-embd 128   # quicker
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memfit
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments, build_gpt


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def engine_step(mode: str, args: argparse.Namespace):
    model, loss_fn, _ = build_gpt(args)
    optimizer = optimizer_for(model)
    engine = memfit.Engine(model, optimizer, precision=mode, clip_grad_norm=1.0, log_every=10**9)
    return model, optimizer, lambda batch: engine.train_step(batch, loss_fn)


def hand_loop_step(args: argparse.Namespace):
    model, loss_fn, _ = build_gpt(args)
    optimizer = optimizer_for(model)

    def step(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, optimizer, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_arguments(parser, n_layer=4, n_embd=384, n_head=6, block_size=256, batch_size=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    variants = {
        "fp32 (Engine)": engine_step("fp32", args),
        "bf16-mixed (Engine)": engine_step("bf16-mixed", args),
        "bf16-master (Engine)": engine_step("bf16-master", args),
        "bf16 autocast (hand loop)": hand_loop_step(args),
    }
    _, _, batch_fn = build_gpt(args)
    batch = batch_fn(args.batch_size, generator=0)
    peaks = {}
    for name, (model, optimizer, step) in variants.items():
        for _ in range(args.warmup):
            step(batch)
        peaks[name] = memfit.measure(
            lambda s=step: s(batch), model=model, optimizer=optimizer
        ).peak_bytes
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (_, _, step) in variants.items():
            start = time.perf_counter()
            step(batch)
            times[name].append(time.perf_counter() - start)

    fp32 = statistics.median(times["fp32 (Engine)"])
    peer = statistics.median(times["bf16 autocast (hand loop)"])
    tokens = args.batch_size * args.block_size
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} "
        f"block_size={args.block_size}, batch {args.batch_size}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} interleaved rounds after {args.warmup} warm-up steps\n"
    )
    print(
        "| variant | step time (median) | tokens/s | speed-up vs fp32 | vs hand loop | peak memory |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in variants:
        t = statistics.median(times[name])
        print(
            f"| {name} | {t * 1000:.1f} ms | {tokens / t:,.0f} | {fp32 / t:.2f}x | "
            f"{(t / peer - 1) * 100:+.1f}% | {format_bytes(peaks[name])} |"
        )


if __name__ == "__main__":
    main()
