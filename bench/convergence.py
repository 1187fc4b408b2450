"""Do the mixed-precision modes converge like fp32? Final validation losses, same seed.

Trains the built-in GPT on the standard-library corpus with ``memfit train`` for each mode
(same seed, same data order), then a tiny model in fp32 and fp16-mixed (fp16 matmul is very
slow on CPUs), and prints each final validation loss and its difference from fp32.

    python bench/convergence.py                # the numbers in docs/benchmarks.md
    python bench/convergence.py --steps 100    # quicker
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from memfit.cli.main import main as memfit_main


def train(out: Path, precision: str, steps: int, extra: list[str]) -> dict:
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
            "32",
            *extra,
        ]
    )
    if code != 0:
        raise SystemExit(f"memfit train {precision} failed with exit code {code}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fp16-steps", type=int, default=150)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        results = {
            mode: train(base / mode, mode, args.steps, [])
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
            mode: train(base / f"tiny-{mode}", mode, args.fp16_steps, tiny)
            for mode in ("fp32", "fp16-mixed")
        }
    for label, group, limit in (
        (f"GPT default, {args.steps} steps", results, 0.02),
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
