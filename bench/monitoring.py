"""What monitoring costs: step time of the built-in GPT with the default monitor on and off.

Both engines train the same model (bf16-mixed, log_every=10); the monitor's default settings
sample activation ranges every 10th forward and read gradient statistics at each log step,
so the cost is counted over whole windows of ``log_every`` steps, not single steps. Windows
of the two engines alternate; the result is the median window time of each.

    python bench/monitoring.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import memfit
from memfit.models import build_model
from memfit.monitor import MonitorConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    base, loss_fn, batch_fn = build_model("gpt", data="synthetic")
    batch = batch_fn(args.batch_size, generator=0)
    engines = {}
    for name, monitor in (
        ("monitor off", False),
        ("monitor on (defaults)", MonitorConfig(measure_memory_step=None)),
    ):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        engines[name] = memfit.Engine(
            model, opt, precision="bf16-mixed", log_every=args.log_every, monitor=monitor
        )
    for engine in engines.values():
        for _ in range(args.log_every):
            engine.train_step(batch, loss_fn)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.windows):
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(args.log_every):
                engine.train_step(batch, loss_fn)
            times[name].append((time.perf_counter() - start) / args.log_every)
    off = statistics.median(times["monitor off"])
    print(
        f"GPT defaults, batch {args.batch_size}, bf16-mixed, log_every={args.log_every}, "
        f"median of {args.windows} alternating windows\n"
    )
    print("| engine | step time (median window) | vs off |")
    print("|---|---:|---:|")
    for name, values in times.items():
        t = statistics.median(values)
        print(f"| {name} | {t * 1000:.1f} ms | {(t / off - 1) * 100:+.1f}% |")


if __name__ == "__main__":
    main()
