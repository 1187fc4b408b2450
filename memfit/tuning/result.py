"""What the tuner found: every candidate as a row (predicted and measured) and the choice."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit.candidates import Candidate, tier_words
from memfit.errors import ConfigError
from memfit.trials.decide import rank_correlation
from memfit.tuning.calibrate import StepTimeModel
from memfit.units import format_bytes


def _of_candidate(name: str, doc: str) -> Any:
    """A read-only attribute of the row taken from its candidate."""
    return property(lambda row: getattr(row.candidate, name), doc=doc)


@dataclass
class TuneRow:
    """One setting the tuner considered: the candidate with the estimator's predictions
    and, for those measured on real steps, what the allocator and the clock saw."""

    candidate: Candidate
    rank: int
    """Its place by prediction (0: predicted best)."""
    measured_peak_bytes: int | None = None
    """The allocator's peak of a real step (None: not measured). Tuned for FSDP2 ranks,
    the trial's one process holds the whole model, not a rank's shard: the peak is
    recorded (and :attr:`note` says so) but ``fits`` is the prediction's."""
    measured_step_seconds: float | None = None
    """The median of the timed steps, timed in rounds beside the other trials."""
    error: str | None = None
    """Why a measured trial failed (out of memory, an exception), or why it does not count
    (over the budget as measured)."""
    peer: str | None = None
    """``"halving"`` or ``"per-block"`` where this setting is the usual fix the tuner
    measured beside its own candidates (halving the micro-batch until it fits;
    checkpointing every block with the whole batch)."""
    note: str | None = None
    """What a measured number means where it is not what ``fits`` judged: tuned for FSDP2
    ranks, "measured in one process with the whole model: X; the per-rank peak is
    predicted: Y"."""

    precision = _of_candidate("precision", "The precision mode.")
    checkpoint = _of_candidate(
        "checkpoint", "``none``, ``full``, ``sqrt`` or ``optimal`` (planned at the budget)."
    )
    micro_batch = _of_candidate("micro_batch", "Samples per micro-batch.")
    accumulation_steps = _of_candidate("accumulation_steps", "Micro-batches per step.")
    optimizer_state = _of_candidate(
        "optimizer_state", "How the optimizer keeps its state (``Engine(optimizer_state=)``)."
    )
    release_gradients = _of_candidate(
        "release_gradients",
        "Each update applied as its gradient is made (``Engine(release_gradients=True)``).",
    )
    activation_storage = _of_candidate(
        "activation_storage",
        "What an ``optimal`` plan may do with a block's saved tensors "
        "(``Engine(activation_storage=)``).",
    )
    predicted_peak_bytes = _of_candidate(
        "predicted_peak_bytes", "The estimator's peak (None: no plan under the budget)."
    )
    predicted_step_seconds = _of_candidate(
        "predicted_step_seconds", "Counted FLOPs over the probe's FLOP rate of the precision."
    )
    recompute_fraction = _of_candidate("recompute_fraction", "Recomputed share of a forward.")
    fits = _of_candidate(
        "fits",
        "Whether the predicted peak (one rank's, tuned for ranks) fits the budget; a "
        "measured peak over it is the row's ``error`` (or, under FSDP2, its ``note``).",
    )
    plan = _of_candidate(
        "plan", "The estimator's plan (``optimal``; the Engine plans the real model)."
    )

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
    "optimizer_state",
    "release_gradients",
    "activation_storage",
    "predicted_peak_bytes",
    "predicted_step_seconds",
    "recompute_fraction",
    "fits",
    "rank",
    "measured_peak_bytes",
    "measured_step_seconds",
    "error",
    "peer",
    "note",
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
    data_parallel: str | None = None
    """How the ranks share the model (``"ddp"``, ``"fsdp"``; None: one process)."""
    advice: list[str] = field(default_factory=list)
    """Tuning advice: loss scale, checkpoint interval, micro-batch and accumulation."""
    speedups: dict[str, float] = field(default_factory=dict)
    """Each precision's matmul speed relative to fp32 that the ranking used."""
    speed_measured: bool = True
    rounds: int = 0
    """How many interleaved rounds the trials were timed in."""
    verdict: str = ""
    """Why ``best`` was chosen among the measured trials (separated, or a tie)."""
    tuning_seconds: float = 0.0
    """The wall-clock time the tuner took, search and trials."""
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    """The measured terms of the predicted step times (:mod:`memfit.tuning.calibrate`)."""

    @property
    def rank_correlation(self) -> float | None:
        """Spearman's rank correlation of predicted and measured step times over the
        trials measured (None for fewer than three): how well the count ranks settings.

        Example::

            res.rank_correlation   # 0.9: the prediction orders the trials nearly as measured
        """
        timed = [r for r in self.rows if r.measured_step_seconds is not None]
        return rank_correlation(
            [r.predicted_step_seconds or 0.0 for r in timed],
            [r.measured_step_seconds or 0.0 for r in timed],
        )

    @property
    def memory_budget(self) -> int | None:
        """The budget the Engine plans the ``optimal`` checkpoint at (None otherwise)."""
        return self.budget if self.best.checkpoint == "optimal" else None

    def engine_kwargs(self) -> dict[str, Any]:
        """The Engine arguments of the choice: precision, checkpoint, budget, accumulation
        (over ranks, precision and accumulation: :meth:`parallelize` applies the plan)."""
        state: dict[str, Any] = {}  # the Engine's defaults: fp32 state, gradients kept
        if self.best.optimizer_state != "fp32":
            state["optimizer_state"] = self.best.optimizer_state
        if self.best.release_gradients:
            state["release_gradients"] = True
        if self.best.checkpoint == "optimal" and len(self.best.activation_storage) > 2:
            # The Engine plans the real model: where it needs coded storage it measures
            # each storage's gradient error, which the estimate could not.
            state["activation_storage"] = self.best.activation_storage
        if self.world_size > 1:
            return {
                "precision": self.best.precision,
                "accumulation_steps": self.best.accumulation_steps,
                **state,
            }
        return {
            "precision": self.best.precision,
            "checkpoint": self.best.checkpoint,
            "memory_budget": self.memory_budget,
            "accumulation_steps": self.best.accumulation_steps,
            **state,
        }

    def parallelize_kwargs(self) -> dict[str, Any]:
        """``memfit.parallelize`` arguments of a choice tuned for ranks: the kind, the
        precision, and the estimator's plan for one rank (None for ``none``)."""
        if self.world_size == 1:
            raise ConfigError(
                "this choice was tuned for one process; tune with world_size=N (and "
                "data_parallel='ddp' or 'fsdp') to make a data-parallel one"
            )
        plan = self.best.plan if self.best.checkpoint != "none" else None
        return {
            "data_parallel": self.data_parallel,
            "precision": self.best.precision,
            "checkpoint": plan,
        }

    def parallelize(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """``memfit.parallelize(model, ...)`` with the choice, inside an initialized
        process group; then build the optimizer on the returned model and call
        :meth:`engine`. ``kwargs``: ``mesh``, ``units``, ``device_ids``.

        Example::

            model = res.parallelize(model)
            engine = res.engine(model, torch.optim.AdamW(model.parameters()))
        """
        from memfit.distributed import parallelize

        return parallelize(model, **{**self.parallelize_kwargs(), **kwargs})

    def engine(self, model: nn.Module, optimizer: Any, **kwargs: Any) -> Any:
        """The Engine with the choice; ``train_step`` then takes batches of
        ``global_batch // world_size`` samples and splits them into the chosen micro-batches.
        ``kwargs``: any other Engine argument (clipping, scheduler, logging). Tuned for
        ranks: ``model`` is the one :meth:`parallelize` returned.

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
            "data_parallel": self.data_parallel,
            "best": self.best.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "advice": list(self.advice),
            "speedups": dict(self.speedups),
            "speed_measured": self.speed_measured,
            "rounds": self.rounds,
            "verdict": self.verdict,
            "tuning_seconds": self.tuning_seconds,
            "rank_correlation": self.rank_correlation,
            "step_time": dataclasses.asdict(self.step_time),
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
        head += ["pred fits", "meas peak", "meas step", "note"]
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
                    "; ".join(
                        x
                        for x in (
                            "* best" if r is self.best else "",
                            r.peer or "",
                            r.error or "",
                            r.note or "",
                        )
                        if x
                    ),
                ]
            )
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = [
            f"tuned for budget {format_bytes(self.budget)}, global batch {self.global_batch}"
            f"{f' over {self.world_size} ranks ({self.data_parallel})' if self.world_size > 1 else ''}"
            ": "
            f"{len(self.rows)} candidates, {sum(r.measured for r in self.rows)} measured"
            f" in {self.rounds} rounds; {self.tuning_seconds:.1f} s"
        ]
        if self.data_parallel == "fsdp" and self.world_size > 1:
            lines.append(
                "pred fits: each rank's predicted peak against the budget; a trial in one "
                "process holds the whole model, not an FSDP2 shard, so its measured peak "
                "does not judge the fit"
            )
        lines += [
            "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]
        ]
        b = self.best
        lines.append(
            f"best: {b.precision}, checkpoint {b.checkpoint}, micro-batch {b.micro_batch} x "
            f"{b.accumulation_steps} accumulation"
            + tier_words(b.optimizer_state, b.release_gradients, b.candidate.stored)
            + (f" ({self.verdict})" if self.verdict else "")
        )
        lines += [f"advice: {a}" for a in self.advice]
        return "\n".join(lines)


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"
