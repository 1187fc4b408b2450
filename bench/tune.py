"""The tuner against the two ways people fit a step into memory, measured side by side.

On the built-in GPT, the budget is half the peak of the plain configuration (fp32, no
checkpointing, the whole global batch as one micro-batch; measured by the allocator). Then,
each in fp32 and in bf16-mixed:

(a) halve the micro-batch and double the accumulation until the measured peak fits
    (what ``find_executable_batch_size`` does, but keeping the global batch);
(b) checkpoint every block (``checkpoint="full"``), the whole batch as one micro-batch;

and ``memfit.tune`` with that budget and global batch. Every configuration's peak is the
allocator's (a step after a warm-up); its step time is the median and the fastest over interleaved rounds
(each round times every configuration once, so a slower moment of a shared machine hits
all of them alike; the fastest is what a quiet moment gives). Ratios are tuned time over
each peer's.

Run: ``python bench/tune.py [--n-layer 4 --n-embd 256 --block-size 128 --batch-size 16]``;
the numbers are in docs/tune.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments, build_gpt


@dataclass
class Config:
    name: str
    kwargs: dict[str, Any]
    engine: Any = None
    batch: Any = None
    peak: int = 0
    times: list[float] | None = None


def build(args: argparse.Namespace, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    model, loss_fn, batch_fn = build_gpt(args)
    optimizer = torch.optim.AdamW(model.parameters())
    engine = memfit.Engine(model, optimizer, monitor=False, log_every=10**9, **kwargs)
    return engine, loss_fn, batch_fn(args.batch_size, generator=0)


def measured_peak(engine: Any, batch: Any, loss_fn: Any) -> int:
    engine.train_step(batch, loss_fn)  # warm-up: planning, the optimizer's state
    live = [
        *engine.model.parameters(),
        *engine.model.buffers(),
        *optimizer_tensors(engine.optimizer),
        batch,
    ]
    return allocator_peak(lambda: engine.train_step(batch, loss_fn), live).peak_bytes


def halving(args: argparse.Namespace, precision: str, budget: int, loss_fn: Any) -> Config:
    """Peer (a): micro-batch halved, accumulation doubled, until the measured peak fits."""
    accumulation = 1
    while True:
        kwargs = {"precision": precision, "accumulation_steps": accumulation}
        engine, _, batch = build(args, kwargs)
        peak = measured_peak(engine, batch, loss_fn)
        micro = args.batch_size // accumulation
        if peak <= budget or micro == 1:
            name = f"(a) halve: {precision}, micro {micro} x {accumulation}"
            return Config(name, kwargs, engine, batch, peak)
        accumulation *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_gpt_arguments(parser, n_layer=4, n_embd=256, n_head=4, block_size=128, batch_size=16)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--measure-top", type=int, default=3)
    args = parser.parse_args()

    plain, loss_fn, batch = build(args, {"precision": "fp32"})
    plain_peak = measured_peak(plain, batch, loss_fn)
    budget = plain_peak // 2
    del plain
    print(
        f"GPT {args.n_layer}x{args.n_embd}, block {args.block_size}, global batch "
        f"{args.batch_size}; plain fp32 peak {format_bytes(plain_peak)}, budget "
        f"{format_bytes(budget)}; torch threads {torch.get_num_threads()}"
    )

    started = time.perf_counter()
    _, _, batch_fn = build_gpt(args)
    res = memfit.tune(
        lambda: build_gpt(args)[0],
        lambda n: batch_fn(n, generator=0),
        loss_fn,
        budget=budget,
        global_batch=args.batch_size,
        measure_top=args.measure_top,
    )
    tune_seconds = time.perf_counter() - started
    print(res.summary(max_rows=10))
    print(f"tuning took {tune_seconds:.1f} s")

    configs: list[Config] = []
    tuned_engine, _, tuned_batch = build(args, res.engine_kwargs())
    b = res.best
    configs.append(
        Config(
            f"tuned: {b.precision}, {b.checkpoint}, micro {b.micro_batch} x {b.accumulation_steps}",
            res.engine_kwargs(),
            tuned_engine,
            tuned_batch,
            measured_peak(tuned_engine, tuned_batch, loss_fn),
        )
    )
    for precision in ("fp32", "bf16-mixed"):
        configs.append(halving(args, precision, budget, loss_fn))
        kwargs = {"precision": precision, "checkpoint": "full"}
        engine, _, batch = build(args, kwargs)
        peak = measured_peak(engine, batch, loss_fn)
        configs.append(
            Config(
                f"(b) full: {precision}, micro {args.batch_size} x 1", kwargs, engine, batch, peak
            )
        )

    for c in configs:
        c.times = []
    for r in range(args.rounds):  # the order rotated each round, as the tuner times trials
        for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
            start = time.perf_counter()
            c.engine.train_step(c.batch, loss_fn)
            c.times.append(time.perf_counter() - start)

    tuned_median = statistics.median(configs[0].times)
    tuned_fastest = min(configs[0].times)
    print()
    print(
        "| configuration | peak (allocator) | fits | step, median | step, fastest "
        "| tuned / this, median | tuned / this, fastest |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        median, fastest = statistics.median(c.times), min(c.times)
        fits = "yes" if c.peak <= budget else "**no**"
        print(
            f"| {c.name} | {format_bytes(c.peak)} | {fits} | {median * 1e3:,.0f} ms | "
            f"{fastest * 1e3:,.0f} ms | {tuned_median / median:.2f} | "
            f"{tuned_fastest / fastest:.2f} |"
        )


if __name__ == "__main__":
    main()
