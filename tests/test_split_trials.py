"""``micro_batch="auto"``'s timed trials on the Engine's own model
(memfit.engine.split_trials): which settings are timed, how the rounds choose, and that
training sees none of it.

Every choice asserted here is made from injected step times (the timing function is
replaced), never from this machine's clock; the test with real timing asserts only what
holds whichever setting wins.
"""

from __future__ import annotations

import statistics
import sys

import pytest
import torch

import memfit
from memfit.engine.split_trials import SplitTrial, choose_timed
from memfit.models import build_model
from memfit.precision.policy import PrecisionPolicy
from tests.engine_cases import assert_bitwise

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(n_layer=4, n_embd=32, n_head=2, block_size=64)
GLOBAL = 8


def _split_trials():
    return sys.modules["memfit.engine.split_trials"]


def _budget(fraction: float) -> int:
    """``fraction`` of the plain fp32 step's predicted peak, the whole batch at once."""
    from memfit.candidates import rank_candidates

    _, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    ranked = rank_candidates(
        lambda: build_model("gpt", data="synthetic", **CFG).model,
        lambda n: batch_fn(n, generator=0),
        loss_fn,
        budget=2**40,
        global_batch=GLOBAL,
        precisions=["fp32"],
        strategies=["none"],
    )
    whole = next(c for c in ranked if c.accumulation_steps == 1)
    return int(fraction * whole.predicted_peak_bytes)


def _engine(budget: int, precision: str = "fp32", **kwargs):
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision=precision,
        micro_batch="auto",
        memory_budget=budget,
        monitor=False,
        **kwargs,
    )
    return engine, loss_fn, batch_fn(GLOBAL, generator=0)


def _inject(monkeypatch, seconds_of) -> list[SplitTrial]:
    """Replace the timing: each run of a trial appends ``seconds_of(trial, run)``."""
    runs: dict[int, int] = {}
    seen: list[SplitTrial] = []

    def fake_time(trial, model, batch, loss_fn, device, restart) -> None:
        n = runs.get(id(trial), 0)
        runs[id(trial)] = n + 1
        if all(t is not trial for t in seen):
            seen.append(trial)
        value = seconds_of(trial, n)
        if isinstance(value, str):
            trial.error = value
        else:
            trial.seconds.append(value)

    monkeypatch.setattr(_split_trials(), "_time", fake_time)
    return seen


def test_the_peers_are_timed_beside_the_best_splits_and_a_faster_peer_wins(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.6))
    seen = _inject(monkeypatch, lambda t, n: 0.9 if t.peer == "halving" else 1.0 + 0.01 * n)
    engine.train_step(batch, loss_fn)
    timed = engine.auto.split_timed
    peers = {t.peer for t in seen}
    assert "halving" in peers and None in peers  # a usual fix beside the Engine's own splits
    assert timed.best.peer == "halving"
    assert engine.settings.accumulation_steps == timed.best.accumulation_steps
    assert timed.best.candidate.checkpoint == "none"
    assert "separated" in timed.verdict
    # Every setting timed after one warm-up run, in as many rounds as the verdict needed.
    for t in seen:
        assert len(t.seconds) == timed.rounds


def test_a_faster_split_trains_with_the_plan_it_was_timed_with(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.4))
    _inject(monkeypatch, lambda t, n: 0.5 if t.recomputes and t.peer is None else 1.0)
    made = []
    real = _split_trials().plan_from_profile

    def counted(*args, **kwargs):
        made.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(_split_trials(), "plan_from_profile", counted)
    engine.train_step(batch, loss_fn)
    best = engine.auto.split_timed.best
    assert best.peer is None and best.recomputes
    # The Engine trains under the plan the trial ran, not one made again.
    assert engine.plan is best.plan.result.plan
    assert made.count("optimal") >= 1


def test_a_tie_goes_to_the_simplest_never_to_one_slower_than_a_peer(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.6))

    def seconds(t, n):  # all within 1%: a recomputing split 0.5% faster than the rest
        if t.recomputes and t.peer is None:
            return 0.995
        return 1.0 + 0.001 * (t.accumulation_steps % 3)

    seen = _inject(monkeypatch, seconds)
    engine.train_step(batch, loss_fn)
    timed = engine.auto.split_timed
    assert "tied" in timed.verdict or "not separated" in timed.verdict
    best = timed.best
    assert not best.recomputes  # less recompute wins the tie
    peers = [statistics.median(t.seconds) for t in seen if t.peer is not None]
    assert statistics.median(best.seconds) <= min(peers)


def test_a_trial_that_fails_gives_way_and_training_goes_on(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.6))
    _inject(
        monkeypatch,
        lambda t, n: "OutOfMemoryError: simulated" if t.peer == "halving" else 1.0,
    )
    loss = engine.train_step(batch, loss_fn)
    assert torch.isfinite(loss)
    timed = engine.auto.split_timed
    assert timed.best.peer != "halving"
    assert any(t.error and "simulated" in t.error for t in timed.trials)
    assert "simulated" in timed.describe()


def _trial(mode: str, seconds: list[float]) -> SplitTrial:
    from types import SimpleNamespace

    row = SimpleNamespace(precision=mode, micro_batch=8, accumulation_steps=1)
    return SplitTrial(row, None, PrecisionPolicy(mode), None, 0.0, list(seconds))


@pytest.mark.parametrize(("bf16", "expected"), [(0.95, "fp32"), (0.8, "bf16-mixed")])
def test_a_16_bit_mode_only_when_clearly_faster(bf16: float, expected: str) -> None:
    trials = [_trial("fp32", [1.0, 1.0, 1.0]), _trial("bf16-mixed", [bf16] * 3)]
    assert choose_timed(trials, 3, 0.0).best.policy.mode == expected


def test_training_sees_none_of_the_trials() -> None:
    """Real timing: whichever setting wins, the first steps equal a run given that split
    and plan by hand, bitwise (random state, gradients and buffers put back)."""
    engine, loss_fn, batch = _engine(_budget(0.5))
    first = engine.train_step(batch, loss_fn)
    timed = engine.auto.split_timed
    assert timed is not None and len(timed.trials) >= 2
    torch.manual_seed(0)
    model, _, _ = build_model("gpt", data="synthetic", **CFG)
    by_hand = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="fp32",
        checkpoint=engine.plan if engine.plan is not None else "none",
        accumulation_steps=engine.settings.accumulation_steps,
        monitor=False,
    )
    assert_bitwise(by_hand.train_step(batch, loss_fn), first)
    for a, b in zip(engine.model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_strategy_given_is_the_only_one_timed(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.5), checkpoint="full")
    seen = _inject(monkeypatch, lambda t, n: 1.0)
    engine.train_step(batch, loss_fn)
    assert all(t.peer is None for t in seen)  # no peer overrides the user's strategy
    for t in seen:
        assert t.plan is None or t.plan.result.strategy == "full"


def test_one_setting_left_standing_is_chosen_from_its_warm_up(monkeypatch) -> None:
    engine, loss_fn, batch = _engine(_budget(0.6))
    first: list[int] = []

    def seconds(t, n):  # every setting but the first to run fails at once
        if not first:
            first.append(id(t))
        return 1.0 if id(t) == first[0] else "RuntimeError: simulated"

    _inject(monkeypatch, seconds)
    engine.train_step(batch, loss_fn)
    timed = engine.auto.split_timed
    assert id(timed.best) == first[0]
    assert timed.best.seconds == [1.0] and timed.rounds == 0


@pytest.mark.parametrize(("bf16", "expected"), [(0.97, "fp32"), (0.7, "bf16-mixed")])
def test_with_precision_auto_the_modes_are_timed_with_the_splits(
    monkeypatch, bf16: float, expected: str
) -> None:
    """Where the probe leaves the mode open (forced here: on this machine's CPU it may
    settle it), every mode's splits and peers are timed, and a 16-bit mode wins only when
    1.1x faster than fp32's best."""
    from memfit.precision import speed

    monkeypatch.setattr(speed, "probe_settles", lambda probe, device: "")
    monkeypatch.setattr(speed, "model_seconds_assumed", lambda device: None)
    budget = _budget(0.6)
    with speed.assumed_speed("cpu", {torch.bfloat16: 2.7}):
        engine, loss_fn, batch = _engine(budget, precision="auto")
        seen = _inject(monkeypatch, lambda t, n: bf16 if t.policy.mode != "fp32" else 1.0)
        engine.train_step(batch, loss_fn)
    assert {t.policy.mode for t in seen} == {"fp32", "bf16-mixed"}
    assert {t.peer for t in seen if t.policy.mode == "bf16-mixed"} >= {"halving"}
    assert engine.settings.precision == expected
    assert engine.auto.split_timed.best.policy.mode == expected
    choice = engine.auto.precision_choice
    assert choice.mode == expected and "timed split" in choice.describe()
