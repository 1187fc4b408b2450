"""What monitoring costs: step time of the built-in GPT with the default monitor on and off.

Both engines train the same model (bf16-mixed, log_every=10); the monitor's default settings
sample activation ranges every 10th forward and read gradient statistics at each log step,
so the cost is counted over whole windows of ``log_every`` steps, not single steps. Windows
of the two engines alternate; the result is the median window time of each.

    python bench/monitoring.py                 # the numbers in docs/benchmarks.md
    python bench/monitoring.py --n-layer 2 --n-embd 32 --n-head 2 --block-size 16 \\
        --batch-size 4 --windows 1 --log-every 2   # a smoke run

Flags (defaults: the numbers in docs/benchmarks.md):

* ``--n-layer``, ``--n-embd``, ``--n-head``, ``--block-size``, ``--batch-size`` (4, 256, 4,
  128, 16: the built-in GPT's defaults and ``memfit train``'s batch): the model and batch;
* ``--windows N`` (9): alternating windows timed per engine;
* ``--log-every N`` (10): the Engine's ``log_every``, and the steps in a window.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import memfit
from memfit.monitor import MonitorConfig

from gpt_setup import add_gpt_arguments, build_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The built-in GPT's defaults (GPTConfig) and memfit train's batch.
    add_gpt_arguments(parser, n_layer=4, n_embd=256, n_head=4, block_size=128, batch_size=16)
    parser.add_argument("--windows", type=int, default=9, help="(default: 9)")
    parser.add_argument("--log-every", type=int, default=10, help="(default: 10)")
    args = parser.parse_args()
    base, loss_fn, batch_fn = build_gpt(args)  # seeded
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
    shape = (args.n_layer, args.n_embd, args.n_head, args.block_size)
    name = "GPT defaults" if shape == (4, 256, 4, 128) else f"GPT {args.n_layer} x {args.n_embd}"
    print(
        f"{name}, batch {args.batch_size}, bf16-mixed, log_every={args.log_every}, "
        f"median of {args.windows} alternating windows\n"
    )
    print("| engine | step time (median window) | vs off |")
    print("|---|---:|---:|")
    for name, values in times.items():
        t = statistics.median(values)
        print(f"| {name} | {t * 1000:.1f} ms | {(t / off - 1) * 100:+.1f}% |")


if __name__ == "__main__":
    main()
