"""Which settings are timed on real steps: the best predicted splits of the global batch
and the **peers**, the usual fixes a user reaches without memfit.

A *row* is anything with a candidate's fields (:class:`memfit.candidates.Candidate`, the
tuner's :class:`~memfit.tuning.result.TuneRow`): ``precision``, ``checkpoint``,
``micro_batch``, ``accumulation_steps``, ``predicted_peak_bytes``,
``predicted_step_seconds`` and ``fits``. A :class:`Slot` is one thing to time: a queue
of rows tried in order until one starts (a setting that fails or measures over the
budget gives way to the next), and the trial that started.

- **Splits** (:func:`split_queues`): the fitting rows grouped by micro-batch, each group
  in the order of prediction; the groups predicted within :data:`SLACK` of the fastest
  come first, the largest micro-batch first (the count leaves out each micro-batch's
  fixed cost and small matmuls' lower efficiency, so a larger micro-batch is faster than
  counted), then the rest by prediction.
- **Peers** (:func:`peer_queues`), in each precision whose fastest prediction is within
  :data:`PEER_MODE_SLACK` of the fastest of all: ``halving`` (no checkpointing, the
  micro-batch halved until it fits) and ``per-block`` (every block checkpointed, the
  whole batch as one micro-batch).

Example::

    splits = split_queues(rows)
    peers = peer_queues(rows, ["fp32", "bf16-mixed"], per_rank=32, limit=budget)
    [s.peer for s in peers]   # ["halving", "per-block", ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Splits whose best predicted time is within this factor of the fastest are timed first,
#: the largest micro-batch first (a full recompute costs at most a third more, well
#: inside the factor).
SLACK = 1.5
#: Rows of one slot tried in turn when the one before failed or went over the budget.
ATTEMPTS_PER_SPLIT = 3
#: A peer is timed from the first setting predicted within this factor of the budget: a
#: prediction a little over the budget must not hide a usual fix that fits (the tuner
#: measures each trial's peak; the Engine times only settings predicted to fit).
PEER_SLACK = 1.1
#: Peers are timed in the precisions whose fastest fitting prediction is within this
#: factor of the fastest of all: a mode the matmul probe measured far slower (bf16
#: emulated on a CPU without it, 0.013x fp32 on one) would only cost time.
PEER_MODE_SLACK = 3.0
#: Rounds beyond the minimum are timed until the verdict settles, up to this many in all
#: (times the minimum).
MAX_ROUNDS_FACTOR = 4


@dataclass
class Slot:
    """One thing to time: its rows, tried in order until one starts, and the trial that
    did (anything with an ``error`` attribute: None while it runs well)."""

    queue: list[Any]
    peer: str | None = None
    """``"halving"`` or ``"per-block"`` for a peer; None for a split."""
    trial: Any = None
    tried: list[Any] = field(default_factory=list)
    """The rows taken from the queue so far."""

    @property
    def filled(self) -> bool:
        return self.trial is not None and self.trial.error is None


def split_queues(rows: Sequence[Any]) -> list[Slot]:
    """One slot per micro-batch with a fitting row, in the order to time them (see the
    module's docstring), each with up to :data:`ATTEMPTS_PER_SPLIT` rows.

    Example::

        [s.queue[0].micro_batch for s in split_queues(rows)]   # [16, 8, 4, ...]
    """
    groups: dict[int, list[Any]] = {}
    for r in rows:
        if r.fits:
            groups.setdefault(r.micro_batch, []).append(r)
    if not groups:
        return []
    position = {id(r): i for i, r in enumerate(rows)}  # rows come in the order of prediction
    fastest = min(g[0].predicted_step_seconds or 0.0 for g in groups.values())
    near = [m for m, g in groups.items() if (g[0].predicted_step_seconds or 0.0) <= SLACK * fastest]
    rest = [m for m in groups if m not in near]
    order = sorted(near, reverse=True) + sorted(rest, key=lambda m: position[id(groups[m][0])])
    return [Slot(list(groups[m][:ATTEMPTS_PER_SPLIT])) for m in order]


def halvings(per_rank: int) -> list[int]:
    """The micro-batches halving the batch passes through, keeping the global batch: from
    ``per_rank`` down, each the largest divisor of ``per_rank`` at most half the one before.

    Example::

        halvings(12)   # [12, 6, 3, 1]
    """
    out = [per_rank]
    while out[-1] > 1:
        out.append(max(d for d in range(1, out[-1] // 2 + 1) if per_rank % d == 0))
    return out


def peer_queues(
    rows: Sequence[Any],
    modes: Sequence[str],
    per_rank: int,
    limit: int,
    slack: float = PEER_SLACK,
    mode_slack: float = PEER_MODE_SLACK,
) -> list[Slot]:
    """In each precision (within :data:`PEER_MODE_SLACK` of the fastest prediction), the
    two usual fixes as slots of ``rows``:

    - ``halving``: no checkpointing, the micro-batch halved (accumulation doubled) until
      it fits, from the first halving predicted within ``slack`` x ``limit``; a setting
      over the budget gives way to the next halving;
    - ``per-block``: every block checkpointed, the whole batch as one micro-batch (none
      where its prediction is over ``slack`` x ``limit``).

    ``slack=1.0`` keeps only settings predicted to fit (for a caller that cannot measure
    a peak before timing); ``mode_slack=math.inf`` times the peers of every mode.

    Example::

        [s.peer for s in peer_queues(rows, ["fp32"], 16, budget)]   # ["halving", "per-block"]
    """
    by_setting = {(r.precision, r.checkpoint, r.micro_batch): r for r in rows}

    def near(row: Any) -> bool:
        peak = row.predicted_peak_bytes if row is not None else None
        return peak is not None and peak <= slack * limit

    fitting = [r.predicted_step_seconds for r in rows if r.fits and r.predicted_step_seconds]
    slots = []
    for mode in modes:
        own = [
            r.predicted_step_seconds
            for r in rows
            if r.precision == mode and r.fits and r.predicted_step_seconds
        ]
        if not own or min(own) > mode_slack * min(fitting):
            continue  # a precision the prediction rules out (bf16 emulated on a CPU)
        steps = [by_setting.get((mode, "none", m)) for m in halvings(per_rank)]
        queue = [r for r in steps if r is not None]
        first = next((i for i, r in enumerate(queue) if near(r)), None)
        if first is not None:
            slots.append(Slot(queue[first : first + ATTEMPTS_PER_SPLIT], "halving"))
        whole = by_setting.get((mode, "full", per_rank))
        if near(whole):
            slots.append(Slot([whole], "per-block"))
    return slots
