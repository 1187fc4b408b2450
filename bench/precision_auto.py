"""What ``precision="auto"`` chooses for the built-in models, and whether training agrees.

For each model: a fresh ``Engine(precision="auto")`` takes its first step (the timing of
the model's first micro-batch in fp32 and bf16-mixed, then the step); a fresh Engine given
the chosen mode by hand takes its first step too, so the difference is what the timing
adds to the first step. Then both modes train a few steps, alternating step by step, and
the median step of each says which mode really trains faster. Everything is repeated
``--repeats`` times and reported as medians (the timing's choice on each repeat is shown).

    python bench/precision_auto.py                     # the numbers in docs/tune.md
    python bench/precision_auto.py --models gpt --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memfit
from memfit.models import build_model


def engine_for(name: str, precision: str, batch_size: int):
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(name, data="synthetic")
    engine = memfit.Engine(
        model, torch.optim.AdamW(model.parameters()), precision=precision, log_every=10**9
    )
    return engine, loss_fn, batch_fn(batch_size, generator=0)


def first_step(name: str, precision: str, batch_size: int) -> tuple[float, memfit.Engine]:
    engine, loss_fn, batch = engine_for(name, precision, batch_size)
    start = time.perf_counter()
    engine.train_step(batch, loss_fn)
    return time.perf_counter() - start, engine


def steady_steps(name: str, batch_size: int, steps: int) -> dict[str, float]:
    """Median step seconds of fp32 and bf16-mixed, their steps interleaved."""
    runs = {mode: engine_for(name, mode, batch_size) for mode in ("fp32", "bf16-mixed")}
    for engine, loss_fn, batch in runs.values():  # the first step: plans, makes state
        engine.train_step(batch, loss_fn)
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(steps):
        for mode, (engine, loss_fn, batch) in runs.items():
            start = time.perf_counter()
            engine.train_step(batch, loss_fn)
            times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet", "lstm"])
    parser.add_argument("--batch-size", type=int, default=16)  # memfit train's default
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        seconds: dict[str, list[float]] = {"fp32": [], "bf16-mixed": []}
        added, timing, chosen = [], [], []
        for _ in range(args.repeats):
            auto_first, engine = first_step(name, "auto", args.batch_size)
            choice = engine.auto.precision_choice
            hand_first, _ = first_step(name, choice.mode, args.batch_size)
            chosen.append(choice.mode)
            for mode, s in choice.model_seconds.items():
                seconds[mode].append(s)
            added.append(auto_first - hand_first)
            timing.append(choice.timing_seconds)
            print(f"  {name}: {choice.describe()}")
        steady = steady_steps(name, args.batch_size, args.steps)
        model_s = {m: statistics.median(s) for m, s in seconds.items() if s}
        ratio = model_s["fp32"] / model_s["bf16-mixed"] if len(model_s) == 2 else float("nan")
        print(
            f"{name}: chose {chosen}; fwd+bwd median fp32 {model_s.get('fp32', 0):.3f} s, "
            f"bf16-mixed {model_s.get('bf16-mixed', 0):.3f} s ({ratio:.2f}x); timing "
            f"{statistics.median(timing):.2f} s, first step +{statistics.median(added):.2f} s; "
            f"training steps fp32 {steady['fp32']:.3f} s, bf16-mixed {steady['bf16-mixed']:.3f} s "
            f"({steady['fp32'] / steady['bf16-mixed']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
