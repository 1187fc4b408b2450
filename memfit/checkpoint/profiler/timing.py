"""Timing a profiled step: the uninstrumented steps whose medians give each unit's times
(:func:`time_steps`), what selective checkpoint's machinery adds to a forward
(:func:`selective_overheads`) and what one checkpointed piece costs
(:func:`piece_overhead`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.profiler.recorder import Recorder
from memfit.checkpoint.profiler.runner import run_step
from memfit.checkpoint.profiler.stats import Stats, clock
from memfit.checkpoint.recompute import run_checkpointed
from memfit.checkpoint.tree import UnitTree
from memfit.nested import tensors
from memfit.precision.policy import PrecisionPolicy

__all__ = ["Timing", "piece_overhead", "selective_overheads", "time_steps"]


#: Pieces and rounds :func:`piece_overhead` times: enough that a piece's cost (about
#: 0.1 ms on a CPU) stands well above the timer's resolution, yet a few tens of ms in all.
_OVERHEAD_PIECES = 24
_OVERHEAD_ROUNDS = 5


def piece_overhead(policy: PrecisionPolicy, device: torch.device, sync: bool) -> float:
    """Seconds the executor's checkpoint adds per piece, forward and backward.

    A chain of tiny ops (each saves its input, so a rebuild runs) is timed with every op a
    piece of its own (:func:`~memfit.checkpoint.recompute.run_checkpointed`, as plans run
    them, under the training precision) and without; the median difference over a few
    interleaved rounds, per piece. What the rebuilt ops themselves take is in the difference too, but on eight
    numbers it is a few microseconds against the machinery's hundred or so."""
    x = torch.zeros(8, device=device, requires_grad=True)

    def step(pieces: bool) -> float:
        start = clock(sync)
        with policy.autocast(device.type):
            y = x
            for _ in range(_OVERHEAD_PIECES):
                if pieces:
                    y = run_checkpointed(torch.sin, (y,), {}, [], selective=False, early_stop=True)
                else:
                    y = torch.sin(y)
        y.sum().backward()
        return clock(sync) - start

    def difference(r: int) -> float:
        # Alternate which runs first, so that neither always follows the other.
        if r % 2:
            plain = step(False)
            return step(True) - plain
        return step(True) - step(False)

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        difference(0)  # warm-up
        diffs = [difference(r) for r in range(_OVERHEAD_ROUNDS)]
    return max(0.0, statistics.median(diffs) / _OVERHEAD_PIECES)


@dataclass
class Timing:
    """The step the timed passes of a profile run, and how they are timed."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], torch.Tensor]
    policy: PrecisionPolicy
    device_type: str
    tree: UnitTree
    settings: dict[str, Any]

    def run(self, **step: Any) -> tuple[dict[str, Stats], float]:
        """One uninstrumented pass (``step``: :func:`run_step`'s keywords): each unit's
        times in fresh stats, by name, and the backward seconds."""
        stats = {u.name: Stats() for u in self.tree}
        timer = Recorder(self.tree, stats, full=False, **self.settings)
        _, bwd = run_step(
            self.model, self.inputs, self.loss_fn, self.policy, self.device_type, timer,
            self.tree, **step,
        )  # fmt: skip
        return stats, bwd


def time_steps(steps: int, timing: Timing, stats: dict[str, Stats]) -> float:
    """Time ``steps`` uninstrumented steps; leave each unit's median forward, backward and
    tail time in ``stats`` and return the median backward time of the step. One step's
    times move with whatever else the machine does (30% between two runs on a busy 2-core
    CPU); the median of a few steps is what plans should not flip on."""
    timed = ("forward_seconds", "backward_own_seconds", "tail_measured_seconds")
    passes: list[dict[str, Stats]] = []
    bwd: list[float] = []
    for _ in range(steps):
        for p in timing.model.parameters():
            p.grad = None
        times, seconds = timing.run()
        passes.append(times)
        bwd.append(seconds)
    for name, st in stats.items():
        for attr in timed:
            setattr(st, attr, statistics.median(getattr(p[name], attr) for p in passes))
    return statistics.median(bwd)


def selective_overheads(rounds: int, timing: Timing, stats: dict[str, Stats]) -> None:
    """Leave in each unit's stats what selective checkpoint's machinery adds to its forward.

    Selective checkpoint runs a piece's forward, and again its rebuild, under a Python
    dispatch mode that asks a policy about every op and caches what it must save. On a CPU
    that costs more than the non-matmul ops it re-runs (a block of the benchmark GPT: its
    forward 2.8 ms longer, on 9 ms), and it grows with the tensors, so it is timed rather
    than assumed: the whole model's forward as one selective piece of memfit's executor
    against the same as a plain piece (neither saves activations), alternating, the median
    difference per unit. Every op pays it, so one forward prices every unit at once. The
    first selective forward of a process sets torch up (about a second on a CPU): it runs
    once untimed."""
    # The inputs go in as arguments only so that checkpoint finds their device.
    args = tuple(tensors(timing.inputs))
    model = timing.model

    def forward(selective: bool) -> dict[str, Stats]:
        def wrap(run: Callable[[], Any]) -> Any:
            return run_checkpointed(
                lambda *_: run(), args, {}, [model], selective=selective, early_stop=True
            )

        return timing.run(forward_only=True, wrap=wrap)[0]

    forward(True)  # warm-up
    passes: dict[bool, list[dict[str, Stats]]] = {False: [], True: []}
    for r in range(rounds):
        for selective in (False, True) if r % 2 == 0 else (True, False):
            passes[selective].append(forward(selective))
    for name, st in stats.items():
        plain, cached = (
            statistics.median(p[name].forward_seconds for p in passes[kind])
            for kind in (False, True)
        )
        st.selective_overhead_seconds = max(0.0, cached - plain)
