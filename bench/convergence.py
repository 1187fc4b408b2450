"""Do the mixed-precision modes converge like fp32? Final validation losses, same seed.

Trains the built-in GPT on the standard-library corpus with ``memfit train`` for each mode
(same seed, same data order), then a tiny model in fp32 and fp16-mixed (fp16 matmul is very
slow on CPUs), and prints each final validation loss and its difference from fp32.

    python bench/convergence.py                # the numbers in docs/benchmarks.md
    python bench/convergence.py --steps 100    # quicker
    python bench/convergence.py --steps 2 --fp16-steps 2 --n-layer 2 --n-embd 32 \\
        --n-head 2 --block-size 16 --batch-size 4 --eval-batches 1   # a smoke run

Flags (defaults: the numbers in docs/benchmarks.md):

* ``--steps N`` (300): training steps of the three modes' runs; ``--fp16-steps N`` (150):
  of the tiny model's fp32 and fp16-mixed runs;
* ``--n-layer``, ``--n-embd``, ``--n-head``, ``--block-size``, ``--batch-size`` (4, 256, 4,
  128, 16: ``memfit train``'s defaults): the shape and batch of the three modes' GPT (the
  tiny model's stay 2 x 32, block 32, batch 8);
* ``--eval-batches N`` (32): validation batches behind each final loss;
* ``--optimizer-state``: instead of the precision modes, AdamW's state kept in fp32, bf16
  and 8 bits (``memfit train --optimizer-state``), on the GPT and on the built-in LSTM,
  both in fp32: the numbers in docs/tiers.md.
* ``--rounded-weights``: instead, bf16 weights without fp32 masters (``bf16-sr``, with
  fp32 and 8-bit state) against ``bf16-master`` and fp32, on the GPT and on the LSTM: the
  numbers in docs/tiers.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from memfit.cli.main import main as memfit_main
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments

#: Each table's runs: (its name in the table, --precision, --optimizer-state); the first
#: is the reference the others are compared with.
OPTIMIZER_STATES = [("fp32", "fp32", "fp32"), ("bf16", "fp32", "bf16"), ("8bit", "fp32", "8bit")]
ROUNDED_WEIGHTS = [
    ("fp32", "fp32", "fp32"),
    ("bf16-master", "bf16-master", "fp32"),
    ("bf16-sr", "bf16-sr", "fp32"),
    ("bf16-sr, 8-bit state", "bf16-sr", "8bit"),
]


def against_reference(
    args: argparse.Namespace, shape: list[str], runs: list[tuple[str, str, str]], what: str
) -> None:
    """Final validation losses of ``runs`` on the GPT and the LSTM from the same seed,
    each against the first run's (limit: 2%)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, extra in (("gpt", shape), ("lstm", ["--model", "lstm"])):
            results = {
                name: train(
                    Path(tmp) / f"{model}-{i}",
                    precision,
                    args.steps,
                    args.eval_batches,
                    [*extra, "--optimizer-state", bits],
                )
                for i, (name, precision, bits) in enumerate(runs)
            }
            ref = results[runs[0][0]]["final_val_loss"]
            for name, summary in results.items():
                loss = summary["final_val_loss"]
                diff = (loss - ref) / ref
                ok = "yes" if abs(diff) <= 0.02 else "NO"
                rows.append(
                    f"| {model}, {args.steps} steps | {name} | {loss:.4f} | {diff * 100:+.2f}% "
                    f"| {ok} (limit 2%) | {format_bytes(summary['peak_memory_bytes'])} |"
                )
    print(f"| run | {what} | final val loss | vs {runs[0][0]} | within limit | peak memory |")
    print("|---|---|---:|---:|---|---:|")
    print("\n".join(rows))


def train(out: Path, precision: str, steps: int, eval_batches: int, extra: list[str]) -> dict:
    code = memfit_main(
        [
            "train",
            "--precision",
            precision,
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--eval-every",
            str(steps),
            "--save-every",
            str(steps),
            "--eval-batches",
            str(eval_batches),
            *extra,
        ]
    )
    if code != 0:
        raise SystemExit(f"memfit train {precision} failed with exit code {code}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="(default: 300)")
    parser.add_argument(
        "--fp16-steps", type=int, default=150, help="the tiny model's steps (default: 150)"
    )
    # memfit train's own defaults, so that the default run is memfit train's model.
    add_gpt_arguments(parser, n_layer=4, n_embd=256, n_head=4, block_size=128, batch_size=16)
    parser.add_argument("--eval-batches", type=int, default=32, help="(default: 32)")
    parser.add_argument(
        "--optimizer-state",
        action="store_true",
        help="compare AdamW's state in fp32, bf16 and 8 bits instead of the precisions",
    )
    parser.add_argument(
        "--rounded-weights",
        action="store_true",
        help="compare bf16-sr (bf16 weights, no masters) with bf16-master and fp32 instead",
    )
    args = parser.parse_args()
    shape = [
        "--set",
        f"n_layer={args.n_layer}",
        "--set",
        f"n_embd={args.n_embd}",
        "--set",
        f"n_head={args.n_head}",
        "--set",
        f"block_size={args.block_size}",
        "--batch-size",
        str(args.batch_size),
    ]
    if args.optimizer_state:
        against_reference(args, shape, OPTIMIZER_STATES, "optimizer state")
        return
    if args.rounded_weights:
        against_reference(args, shape, ROUNDED_WEIGHTS, "weights")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        results = {
            mode: train(base / mode, mode, args.steps, args.eval_batches, shape)
            for mode in ("fp32", "bf16-mixed", "bf16-master")
        }
        tiny = [
            "--set",
            "n_layer=2",
            "--set",
            "n_embd=32",
            "--set",
            "n_head=2",
            "--set",
            "block_size=32",
            "--batch-size",
            "8",
        ]
        tiny_results = {
            mode: train(base / f"tiny-{mode}", mode, args.fp16_steps, args.eval_batches, tiny)
            for mode in ("fp32", "fp16-mixed")
        }
    shaped = (args.n_layer, args.n_embd, args.n_head, args.block_size, args.batch_size)
    default = shaped == (4, 256, 4, 128, 16)
    name = "GPT default" if default else f"GPT {args.n_layer} x {args.n_embd}"
    for label, group, limit in (
        (f"{name}, {args.steps} steps", results, 0.02),
        (f"tiny GPT, {args.fp16_steps} steps", tiny_results, 0.03),
    ):
        ref = group["fp32"]["final_val_loss"]
        for mode, summary in group.items():
            loss = summary["final_val_loss"]
            diff = (loss - ref) / ref
            ok = "yes" if abs(diff) <= limit else "NO"
            rows.append(
                f"| {label} | {mode} | {loss:.4f} | {diff * 100:+.2f}% | {ok} (limit {limit:.0%}) | {summary['skipped_steps']} |"
            )
    print("| run | precision | final val loss | vs fp32 | within limit | skipped steps |")
    print("|---|---|---:|---:|---|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
