"""What the tuner found: every candidate as a row (predicted and measured) and the choice."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit.checkpoint.plan import Plan
from memfit.units import format_bytes


@dataclass
class TuneRow:
    """One setting the tuner considered: what the estimator predicted and, for those
    measured on real steps, what the allocator and the clock saw."""

    precision: str
    checkpoint: str
    """``none``, ``full``, ``sqrt`` or ``optimal`` (planned at the budget by the Engine)."""
    micro_batch: int
    accumulation_steps: int
    predicted_peak_bytes: float | None
    """The estimator's peak (None when the strategy has no plan under the budget)."""
    predicted_step_seconds: float | None
    """Counted FLOPs over the probe's FLOP rate of the precision."""
    recompute_fraction: float | None
    fits: bool
    """Whether the predicted peak fits the budget."""
    rank: int
    """Its place by prediction (0: predicted best)."""
    measured_peak_bytes: int | None = None
    """The allocator's peak of a real step (None: not measured)."""
    measured_step_seconds: float | None = None
    """The fastest of the timed steps (a shared machine's bursts only slow steps down)."""
    error: str | None = None
    """Why a measured trial failed (out of memory, an exception), or why it does not count
    (over the budget as measured)."""
    plan: Plan | None = field(default=None, repr=False, compare=False)
    """The plan the estimator made for it (``optimal``; the Engine plans the real model)."""

    @property
    def measured(self) -> bool:
        return self.measured_step_seconds is not None or self.error is not None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _FIELDS}
        return out


_FIELDS = (
    "precision",
    "checkpoint",
    "micro_batch",
    "accumulation_steps",
    "predicted_peak_bytes",
    "predicted_step_seconds",
    "recompute_fraction",
    "fits",
    "rank",
    "measured_peak_bytes",
    "measured_step_seconds",
    "error",
)


@dataclass
class TuneResult:
    """The tuner's choice (``best``), every candidate (``rows``) and the advice.

    Example::

        res = memfit.tune(model_fn, batch_fn, loss_fn, budget="2GiB", global_batch=64)
        print(res.summary())
        engine = res.engine(model, optimizer)
        for step in range(steps):
            engine.train_step(batch_fn(64), loss_fn)
    """

    best: TuneRow
    """The setting chosen: the fastest measured one within the budget (the predicted
    best when nothing was measured)."""
    rows: list[TuneRow]
    """Every candidate, in the order of prediction."""
    budget: int
    global_batch: int
    world_size: int
    advice: list[str] = field(default_factory=list)
    """Tuning advice: loss scale, checkpoint interval, micro-batch and accumulation."""
    speedups: dict[str, float] = field(default_factory=dict)
    """Each precision's matmul speed relative to fp32 that the ranking used."""
    speed_measured: bool = True

    @property
    def memory_budget(self) -> int | None:
        """The budget the Engine plans the ``optimal`` checkpoint at (None otherwise)."""
        return self.budget if self.best.checkpoint == "optimal" else None

    def engine_kwargs(self) -> dict[str, Any]:
        """The Engine arguments of the choice: precision, checkpoint, budget, accumulation."""
        return {
            "precision": self.best.precision,
            "checkpoint": self.best.checkpoint,
            "memory_budget": self.memory_budget,
            "accumulation_steps": self.best.accumulation_steps,
        }

    def engine(self, model: nn.Module, optimizer: Any, **kwargs: Any) -> Any:
        """The Engine with the choice; ``train_step`` then takes batches of
        ``global_batch // world_size`` samples and splits them into the chosen micro-batches.
        ``kwargs``: any other Engine argument (clipping, scheduler, logging).

        Example::

            engine = res.engine(model, torch.optim.AdamW(model.parameters()), clip_grad_norm=1.0)
        """
        from memfit.engine import Engine

        return Engine(model, optimizer, **{**self.engine_kwargs(), **kwargs})

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "best": self.best.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "advice": list(self.advice),
            "speedups": dict(self.speedups),
            "speed_measured": self.speed_measured,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self, max_rows: int = 20) -> str:
        """The measured rows and the best predicted ones as a table, then the choice and
        the advice.

        Example::

            print(res.summary())
        """
        shown = [r for r in self.rows if r.measured]
        shown += [r for r in self.rows if not r.measured][: max(0, max_rows - len(shown))]
        shown.sort(key=lambda r: r.rank)
        head = ["#", "precision", "checkpoint", "micro x acc", "pred peak", "pred step"]
        head += ["fits", "meas peak", "meas step", "note"]
        body = []
        for r in shown:
            body.append(
                [
                    str(r.rank),
                    r.precision,
                    r.checkpoint,
                    f"{r.micro_batch} x {r.accumulation_steps}",
                    _bytes(r.predicted_peak_bytes),
                    _ms(r.predicted_step_seconds),
                    "yes" if r.fits else "no",
                    _bytes(r.measured_peak_bytes),
                    _ms(r.measured_step_seconds),
                    ("* best" if r is self.best else "") + (r.error or ""),
                ]
            )
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = [
            f"tuned for budget {format_bytes(self.budget)}, global batch {self.global_batch}"
            f"{f' over {self.world_size} ranks' if self.world_size > 1 else ''}: "
            f"{len(self.rows)} candidates, {sum(r.measured for r in self.rows)} measured"
        ]
        lines += [
            "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]
        ]
        b = self.best
        lines.append(
            f"best: {b.precision}, checkpoint {b.checkpoint}, micro-batch {b.micro_batch} x "
            f"{b.accumulation_steps} accumulation"
        )
        lines += [f"advice: {a}" for a in self.advice]
        return "\n".join(lines)


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"
