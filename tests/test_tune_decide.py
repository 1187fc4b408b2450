"""The tuner's decision among measured trials (memfit.trials.decide), its peers' settings and
its step-time terms (memfit.tuning.calibrate): exact, on given step times, no clock involved."""

from __future__ import annotations

import math

import pytest

from memfit.candidates import Candidate, retime
from memfit.trials.decide import TIE_MARGIN, Timed, decide, gap, rank_correlation
from memfit.trials.slots import halvings
from memfit.tuning.calibrate import StepTimeModel, TimedPoints, fit_step_time


def _t(key, seconds, recompute=0.0, accumulation=1, peer=None) -> Timed:
    return Timed(key, seconds, recompute, accumulation, peer)


def test_a_leader_faster_every_round_is_separated_and_chosen() -> None:
    peer = _t("halving", [1.00, 1.30, 1.02, 1.01, 1.25], accumulation=4, peer="halving")
    # 10% faster in every round, while the machine's load moved both by 30%.
    mine = _t("optimal", [x / 1.10 for x in peer.seconds], recompute=0.2, accumulation=2)
    v = decide([peer, mine])
    assert v.best is mine and v.leader is mine and v.settled
    g = v.gaps["halving"]
    assert g.ratio == pytest.approx(1.10) and g.noise == pytest.approx(0.0, abs=1e-12)
    assert g.separated and "separated" in v.describe()


def test_a_tie_goes_to_the_simplest_and_never_to_one_slower_than_a_peer() -> None:
    # The tuner's own setting leads by 1% with 5% noise: not separated from the peer.
    noisy = [1.00, 1.06, 0.95, 1.04, 0.97]
    peer = _t("halving", [1.0] * 5, accumulation=4, peer="halving")
    mine = _t("optimal", [x * 0.99 for x in noisy], recompute=0.3, accumulation=1)
    v = decide([peer, mine])
    assert v.leader is mine and not v.gaps["halving"].separated
    assert v.best is peer  # less recompute wins the tie
    assert v.describe().endswith(
        "the simplest of them chosen (less recompute, fewer micro-batches)"
    )
    # A simpler setting of the tuner's, tied but measured slower than the peer, is not chosen.
    slower = _t("bf16", [x * 1.01 for x in peer.seconds[:3]] + [1.0, 1.0], accumulation=1)
    v = decide([peer, slower])
    assert v.leader is peer and v.best is peer and slower in v.tied and v.settled
    assert v.describe().endswith("with the fastest; the fastest chosen")


def test_fewer_micro_batches_break_a_tie_in_recompute() -> None:
    a = _t("a", [1.00, 1.01, 0.99], accumulation=4)
    b = _t("b", [1.01, 1.00, 1.00], accumulation=2)
    v = decide([a, b])
    assert v.best is b


def test_one_round_is_never_separated_and_a_close_tie_settles() -> None:
    g = gap([2.0], [1.0])
    assert g.ratio == 2.0 and math.isinf(g.noise) and not g.separated and not g.settled
    close = gap([1.005, 1.004, 1.006, 1.005], [1.0, 1.0, 1.0, 1.0])
    assert not close.separated and close.settled  # within the margin even at its noise's end
    wide = gap([1.05, 0.95, 1.04, 0.96], [1.0] * 4)
    assert not wide.separated and not wide.settled  # more rounds could still separate
    assert TIE_MARGIN == 0.02


def test_rounds_pair_by_their_last_common_rounds() -> None:
    # A trial that joined late (it stood in for one that broke) is paired with the
    # leader's last rounds.
    g = gap([1.2, 1.2], [5.0, 5.0, 1.0, 1.0])
    assert g.rounds == 2 and g.ratio == pytest.approx(1.2)


def test_decide_needs_a_trial() -> None:
    with pytest.raises(ValueError, match="at least one"):
        decide([])


def test_rank_correlation_is_spearmans() -> None:
    assert rank_correlation([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert rank_correlation([1, 2], [1, 2]) is None
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None


@pytest.mark.parametrize(
    "per_rank, expected",
    [(16, [16, 8, 4, 2, 1]), (12, [12, 6, 3, 1]), (7, [7, 1]), (1, [1]), (18, [18, 9, 3, 1])],
)
def test_halving_keeps_the_global_batch(per_rank: int, expected: list[int]) -> None:
    got = halvings(per_rank)
    assert got == expected and all(per_rank % m == 0 for m in got)


def test_the_step_time_terms_solve_the_three_points_exactly() -> None:
    # per_micro 8 ms, scale 3, per_step 9 ms: t1 = 8 + 3 + 9, t2 = 8 + 12 + 9, t3 = 16 + 6 + 9.
    m = fit_step_time(TimedPoints(c1=1e-3, c2=4e-3, t1=0.020, t2=0.029, t3=0.031))
    assert m.measured
    assert m.scale == pytest.approx(3.0)
    assert m.per_micro_seconds == pytest.approx(0.008)
    assert m.per_step_seconds == pytest.approx(0.009)
    assert m.seconds(2e-3, 0.0, 4) == pytest.approx(4 * (0.008 + 0.006) + 0.009)
    assert m.recompute_scale == m.scale  # no checkpointed point: recompute as the rest
    # No second size: the count's scale stays; noise never makes a term negative.
    m = fit_step_time(TimedPoints(c1=1e-3, c2=None, t1=0.020, t2=None, t3=0.019))
    assert (
        m.scale == 1.0 and m.per_micro_seconds == 0.0 and m.per_step_seconds == pytest.approx(0.019)
    )
    m = fit_step_time(TimedPoints(c1=1e-3, c2=4e-3, t1=0.020, t2=0.018, t3=0.031))
    assert m.scale == 1.0  # a slope below zero is noise: the count's own scale
    assert StepTimeModel().seconds(0.5, 0.25, 2) == 1.5  # the default is the count alone
    # Every block checkpointed at m2 took 12 ms more for 2 ms of counted recompute: 6x.
    m = fit_step_time(TimedPoints(1e-3, 4e-3, 0.020, 0.029, 0.031, r2=2e-3, t4=0.041))
    assert m.recompute_scale == pytest.approx(6.0) and m.scale == pytest.approx(3.0)
    assert m.seconds(2e-3, 1e-3, 1) == pytest.approx(0.008 + 0.006 + 0.006 + 0.009)


def test_retime_ranks_again_with_the_fixed_costs() -> None:
    def cand(micro: int, acc: int, seconds: float, recompute: float = 0.0) -> Candidate:
        checkpoint = "full" if recompute else "none"
        return Candidate(
            "fp32",
            checkpoint,
            micro,
            acc,
            1.0,
            seconds,
            0.0,
            True,
            recompute_step_seconds=recompute,
        )

    # By the count alone the split of 8 micro-batches ties the single one.
    counted = [cand(1, 8, 1.0), cand(8, 1, 1.0)]
    ranked = retime(counted, StepTimeModel(1.0, 0.05, 0.0).seconds)
    assert [c.accumulation_steps for c in ranked] == [1, 8]
    assert ranked[1].predicted_step_seconds == pytest.approx(8 * (0.05 + 1.0 / 8))
    # Recompute measured at 3x its count: the checkpointed single micro-batch loses.
    model = StepTimeModel(1.0, 0.0, 0.0, recompute_scale=3.0)
    ranked = retime([cand(8, 1, 1.0, recompute=0.3), cand(4, 2, 1.1)], model.seconds)
    assert [c.checkpoint for c in ranked] == ["none", "full"]
    assert ranked[1].predicted_step_seconds == pytest.approx(0.7 + 0.9)
    assert ranked[1].recompute_step_seconds == pytest.approx(0.9)
