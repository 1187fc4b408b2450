"""memfit against selective activation checkpointing, in time: the recompute counted in FLOPs
leaves out what selective checkpointing rebuilds for free in FLOPs (elementwise ops, norms,
softmax), so this measures the steps.

For each model of ``bench/peer_models.py`` and each precision: the step without checkpointing,
the selective peer (every block checkpointed with ``torch.utils.checkpoint`` and a policy that
saves matmul and attention outputs, recomputing the rest: ``bench/peers.py``'s
``selective (matmuls saved)``), and ``memfit.plan`` at the peer's measured peak x 1.02 (as
``bench/peers.py`` plans it), applied. Each is measured on its own copy of the model and
optimizer: the allocator's peak of one whole step, then ``--rounds`` rounds of timed steps,
the three variants interleaved within each round (so that a slower moment of a shared machine
falls on all three), after a warm-up step each. Printed: the median step time of each, the
recompute overhead of the peer and of memfit over the unplanned step's median, and memfit's
median over the peer's (below 1: memfit's step is faster at the peer's memory).

    python bench/selective_time.py                          # every model, fp32
    python bench/selective_time.py --models gpt,llama --precision fp32,bf16-mixed --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peer_models import PEER_MODELS, make_subject  # bench/peer_models.py
from peers import PEER_MARGIN, _per_block, fresh_copy, make_step, measure  # bench/peers.py
from zoo import error_text  # bench/zoo.py

import memfit
from memfit.errors import BudgetError


@dataclass
class Variant:
    """One way to run the step, its measured peak and its step times."""

    name: str
    step: Callable[[], None] | None = None
    peak_bytes: int | None = None
    seconds: list[float] | None = None
    note: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


def variants(name: str, precision: str) -> list[Variant]:
    """The unplanned step, the selective peer and memfit at its peak, each ready to run."""
    subject = make_subject(name)
    plain, selective, planned = Variant("none"), Variant("selective"), Variant("memfit")
    model, optimizer = fresh_copy(subject, precision)
    plain.peak_bytes = measure(
        model, optimizer, subject.batch, subject.loss_fn, precision
    ).peak_bytes
    plain.step = make_step(model, optimizer, subject.batch, subject.loss_fn, precision)
    model, optimizer = fresh_copy(subject, precision)
    loss_fn = _per_block(selective=True)(model, subject)
    selective.peak_bytes = measure(model, optimizer, subject.batch, loss_fn, precision).peak_bytes
    selective.step = make_step(model, optimizer, subject.batch, loss_fn, precision)
    budget = int(selective.peak_bytes * PEER_MARGIN)
    model, optimizer = fresh_copy(subject, precision)
    try:
        plan = memfit.plan(
            model,
            subject.batch,
            subject.loss_fn,
            budget=budget,
            precision=precision,
            optimizer=optimizer,
        )
    except BudgetError as exc:
        planned.note = f"refused: {exc}"
        return [plain, selective, planned]
    memfit.apply_plan(model, plan)
    planned.peak_bytes = measure(
        model, optimizer, subject.batch, subject.loss_fn, precision
    ).peak_bytes
    planned.step = make_step(model, optimizer, subject.batch, subject.loss_fn, precision)
    planned.note = (
        f"{plan.recompute_flops / 1e6:.1f} MFLOP planned, budget {budget / 2**20:.2f} MiB"
    )
    return [plain, selective, planned]


def timed(runs: list[Variant], rounds: int) -> None:
    """``rounds`` rounds, each variant's step timed once per round, in turn."""
    for v in runs:
        v.seconds = [] if v.step is not None else None
    for _ in range(rounds):
        for v in runs:
            if v.step is None or v.seconds is None:
                continue
            start = time.perf_counter()
            v.step()
            v.seconds.append(time.perf_counter() - start)


def report(name: str, precision: str, runs: list[Variant]) -> str:
    plain, selective, planned = runs
    lines = [f"{name} {precision}"]
    for v in runs:
        median = v.median
        cells = [
            f"  {v.name:<10}",
            f"peak {v.peak_bytes / 2**20:8.2f} MiB" if v.peak_bytes else f"{'':17}",
            f"median {median * 1e3:8.1f} ms" if median else f"{'':18}",
        ]
        if median and plain.median and v is not plain:
            cells.append(f"overhead {100 * (median / plain.median - 1):+6.1f}%")
        lines.append(" ".join(cells) + (f"  ({v.note})" if v.note else ""))
    if planned.median and selective.median:
        lines.append(f"  memfit / selective: {planned.median / selective.median:.3f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PEER_MODELS))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds, interleaved")
    for name in args.models.split(","):
        for precision in args.precision.split(","):
            try:
                runs = variants(name, precision)
                timed(runs, args.rounds)
                print(report(name, precision, runs), flush=True)
            except Exception as exc:  # a crash is a finding: print it, go on
                print(f"{name} {precision}: {error_text(exc)}", flush=True)


if __name__ == "__main__":
    main()
