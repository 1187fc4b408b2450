"""Keras 3 on TensorFlow (CPU): fp32 against mixed_bfloat16 step time, and the checkpoint
frontier of a small Transformer, predicted and measured.

The model is a Functional chain of a token embedding, ``--layers`` pre-norm Transformer
blocks (each a Keras layer: causal multi-head attention and an MLP, with residuals), a
final LayerNorm and the vocabulary head. Step times are ``train_on_batch`` with Adam,
interleaved round by round between the variants (so drift in the machine's speed hits them
alike), the median over the rounds. Peaks are one eager step read from TensorFlow's CPU
allocator (``memfit.keras.measure_step``), eager (what the profile measures and the plan
predicts) and as a ``tf.function`` (as ``model.fit`` runs it).

    python bench/keras.py               # the tables in docs/keras.md
    python bench/keras.py --rounds 3    # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# This file is bench/keras.py: its folder, first on the path, would shadow the keras package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import memfit.keras as mk  # noqa: E402  (sets TensorFlow's CPU allocator first)
from memfit.units import format_bytes  # noqa: E402

mk.precision  # noqa: B018  (imports Keras and TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402


@keras.saving.register_keras_serializable("memfit_bench")
class Block(keras.layers.Layer):
    """Pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.ln1 = keras.layers.LayerNormalization()
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads)
        self.ln2 = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def call(self, x: object) -> object:
        h = self.ln1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        return x + self.down(self.up(self.ln2(x)))


def transformer(args: argparse.Namespace) -> keras.Model:
    tokens = keras.Input((args.seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(args.vocab, args.width, name="embed")(tokens)
    for i in range(args.layers):
        x = Block(args.width, args.heads, name=f"block_{i}")(x)
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    return keras.Model(tokens, keras.layers.Dense(args.vocab, name="head")(x), name="gpt")


def batch(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype("int32")
    return data[:, :-1], data[:, 1:]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def step_times(models: dict[str, keras.Model], x: np.ndarray, y: np.ndarray, args) -> dict:
    for model in models.values():
        model.compile(keras.optimizers.Adam(1e-4), LOSS)
        for _ in range(args.warmup):
            model.train_on_batch(x, y)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    x, y = batch(args)
    print(
        f"Transformer: {args.layers} blocks, width {args.width}, {args.heads} heads, "
        f"sequence {args.seq}, vocabulary {args.vocab}, batch {args.batch}; "
        f"keras {keras.__version__}, {os.cpu_count()} CPUs"
    )

    print("\n## Precision (train_on_batch, Adam; median of", args.rounds, "rounds)\n")
    keras.utils.set_random_seed(0)
    models = {}
    for mode in ("fp32", "bf16-mixed"):
        with mk.precision(mode):
            models[mode] = transformer(args)
    times = step_times(models, x, y, args)
    print("| precision | Keras policy | step time | vs fp32 |")
    print("|---|---|---|---|")
    for mode, seconds in times.items():
        print(
            f"| {mode} | {mk.keras_policy(mode)} | {seconds * 1e3:.1f} ms "
            f"| {times['fp32'] / seconds:.2f}x |"
        )

    print("\n## Checkpoint plans (fp32, Adam): predicted and measured peak of one step\n")
    keras.utils.set_random_seed(0)
    model = transformer(args)
    optimizer = keras.optimizers.Adam(1e-4)
    prof = mk.profile(model, x, y, LOSS, optimizer)
    none = mk.plan(model, x, y, LOSS, optimizer=optimizer, profiled=prof)
    rows = [("none", none)]
    for strategy in ("sqrt", "full"):
        rows.append(
            (
                strategy,
                mk.plan(model, x, y, LOSS, None, strategy, optimizer=optimizer, profiled=prof),
            )
        )
    for share in (0.7, 0.5):
        budget = int(share * none.predicted_peak_bytes)
        label = f"optimal, budget {share:.0%} of none"
        rows.append((label, mk.plan(model, x, y, LOSS, budget, optimizer=optimizer, profiled=prof)))
    planned = {label: mk.apply_plan(model, p) for label, p in rows}
    # Each measured step applies Adam (a fresh one), as the prediction counts its state.
    measured = {
        label: mk.measure_step(m, x, y, LOSS, keras.optimizers.Adam(1e-4)).peak_bytes
        for label, m in planned.items()
    }
    graph = {
        label: mk.measure_step(m, x, y, LOSS, keras.optimizers.Adam(1e-4), compiled=True).peak_bytes
        for label, m in planned.items()
    }
    copies = {}
    for label, p in rows:  # a model of its own per plan, so each compiles its own step
        keras.utils.set_random_seed(0)
        copies[label] = mk.apply_plan(transformer(args), p)
    seconds = step_times(copies, x, y, args)
    print(
        "| plan | recomputed | predicted peak | measured peak (eager) | error "
        "| measured peak (tf.function) | step time | vs none |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, p in rows:
        pieces = sum(d == "recompute" for d in p.decisions.values())
        pieces += sum(len(r) for r in p.segments.values())
        what = f"{pieces} piece" + ("" if pieces == 1 else "s")
        error = p.predicted_peak_bytes / measured[label] - 1
        print(
            f"| {label} | {what} | {format_bytes(p.predicted_peak_bytes)} "
            f"| {format_bytes(measured[label])} | {error:+.1%} | {format_bytes(graph[label])} "
            f"| {seconds[label] * 1e3:.1f} ms "
            f"| {seconds[label] / seconds['none']:.2f}x |"
        )
    print("\nfrontier (optimal, predicted; every other point):")
    for point in none.frontier[::2]:
        print(f"  {format_bytes(point.peak_bytes):>10}  +{point.recompute_seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
