"""``memfit.tune``, ``precision="auto"``, ``micro_batch="auto"``, the bf16 speed warning and
``memfit tune``.

Every choice that depends on speed is decided here from injected matmul ratios
(``assumed_speed``), never from this machine's timing or its CPU's name; tests of measured
trials assert what holds on any machine (fits, recorded, within the budget).
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch

import memfit
from memfit.candidates import Candidate, rank_candidates, split_choices
from memfit.cli.main import main
from memfit.errors import BudgetError, ConfigError
from memfit.models import build_model
from memfit.precision.speed import (
    assumed_speed,
    choose_precision,
    matmul_speed,
    measure_matmul_speed,
)
from memfit.tuning.calibrate import StepTimeModel
from memfit.tuning.hints import initial_loss_scale, loss_scale_advice
from memfit.tuning.result import TuneResult, TuneRow
from memfit.tuning.trials import GradStats, time_in_rounds
from memfit.units import format_bytes
from tests.engine_cases import assert_bitwise

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)
SLOW_BF16 = {torch.bfloat16: 0.21}  # a CPU without native bf16 (measured on one here)
FAST_BF16 = {torch.bfloat16: 2.7}  # one with AVX-512-BF16


def _parts():
    _, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)

    def model_fn():
        return build_model("gpt", data="synthetic", **CFG).model

    return model_fn, (lambda n: batch_fn(n, generator=0)), loss_fn


def _plain_peak(precision: str = "fp32", global_batch: int = 8) -> float:
    """The predicted peak of no checkpointing, the whole batch as one micro-batch."""
    model_fn, batch_fn, loss_fn = _parts()
    with assumed_speed("cpu", FAST_BF16):
        ranked = rank_candidates(
            model_fn,
            batch_fn,
            loss_fn,
            budget=2**40,
            global_batch=global_batch,
            precisions=[precision],
            strategies=["none"],
        )
    return next(c for c in ranked if c.micro_batch == global_batch).predicted_peak_bytes


# ---------------------------------------------------------------- speed probe


def test_the_probe_measures_each_dtype_and_injected_numbers_replace_it() -> None:
    measured = measure_matmul_speed("cpu", size=64, repeats=1)
    assert measured.measured and set(measured.seconds) == {torch.float32, torch.bfloat16}
    assert measured.speedup(torch.float32) == 1.0
    with assumed_speed("cpu", SLOW_BF16) as speed:
        assert matmul_speed("cpu") is speed
        assert matmul_speed("cpu").speedup(torch.bfloat16) == pytest.approx(0.21)
        assert not speed.measured
    assert matmul_speed("cpu") is not speed


@pytest.mark.parametrize(("speedups", "mode"), [(SLOW_BF16, "fp32"), (FAST_BF16, "bf16-mixed")])
def test_choose_precision_follows_the_matmul_ratio(speedups, mode) -> None:
    with assumed_speed("cpu", speedups):
        choice = choose_precision("cpu")
    assert choice.mode == mode
    assert choice.speedups["bf16-mixed"] == pytest.approx(speedups[torch.bfloat16])
    assert mode in choice.describe()


def test_bf16_on_a_cpu_where_it_is_slower_warns_with_the_ratio_and_the_advice() -> None:
    model, _, _ = build_model("gpt", data="synthetic", **CFG)
    with assumed_speed("cpu", SLOW_BF16), pytest.warns(UserWarning) as caught:
        memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision="bf16-mixed")
    text = " ".join(str(w.message) for w in caught)
    assert "0.21x" in text and "precision='fp32'" in text
    model, _, _ = build_model("gpt", data="synthetic", **CFG)
    with assumed_speed("cpu", FAST_BF16), warnings.catch_warnings():
        warnings.simplefilter("error")
        memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision="bf16-mixed")


# ---------------------------------------------------------------- precision="auto"


@pytest.mark.parametrize(("speedups", "mode"), [(SLOW_BF16, "fp32"), (FAST_BF16, "bf16-mixed")])
def test_precision_auto_trains_in_the_mode_the_ratio_makes_fastest(speedups, mode, tmp_path):
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    engine = memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision="auto")
    assert engine.settings.precision == "auto"
    with assumed_speed("cpu", speedups):
        engine.train_step(batch_fn(4, generator=0), loss_fn)
    assert engine.settings.precision == mode and engine.policy.mode == mode
    assert engine.auto.precision_choice.mode == mode
    engine.save(tmp_path / "ck.pt")
    # Resumed: the saved choice, without measuring again (the ratio now says otherwise).
    torch.manual_seed(0)
    model2, _, _ = build_model("gpt", data="synthetic", **CFG)
    other = FAST_BF16 if speedups is SLOW_BF16 else SLOW_BF16
    with assumed_speed("cpu", other), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = memfit.Engine.resume(
            tmp_path / "ck.pt", model2, torch.optim.AdamW(model2.parameters())
        )
        assert resumed.settings.precision == mode
        batch = batch_fn(4, generator=1)
        assert_bitwise(resumed.train_step(batch, loss_fn), engine.train_step(batch, loss_fn))


def test_precision_auto_in_fp32_trains_bitwise_as_fp32() -> None:
    losses = []
    for precision in ("fp32", "auto"):
        torch.manual_seed(0)
        model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
        engine = memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision=precision)
        with assumed_speed("cpu", SLOW_BF16):
            losses.append([engine.train_step(batch_fn(4, generator=i), loss_fn) for i in range(3)])
    for a, b in zip(*losses):
        assert_bitwise(a, b)


# ---------------------------------------------------------------- micro_batch="auto"


def test_micro_batch_auto_keeps_the_global_batch_and_fits_the_budget() -> None:
    budget = int(0.6 * _plain_peak("fp32", 8))
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="fp32",
        micro_batch="auto",
        memory_budget=budget,
    )
    batches = [batch_fn(8, generator=i) for i in range(2)]
    auto_losses = [engine.train_step(b, loss_fn) for b in batches]
    choice = engine.auto.split_choice
    assert choice.micro_batch * choice.accumulation_steps == 8
    assert engine.settings.accumulation_steps == choice.accumulation_steps
    assert choice.predicted_peak_bytes <= budget
    # Chosen among settings timed on the model (which one won depends on the clock).
    timed = engine.auto.split_timed
    assert timed is not None and timed.best.candidate is choice
    assert {t.peer for t in timed.trials} >= {"halving"}
    # The same training as the split and plan given by hand, bitwise (fp32 on CPU): the
    # trials left nothing behind.
    torch.manual_seed(0)
    model2, _, _ = build_model("gpt", data="synthetic", **CFG)
    by_hand = memfit.Engine(
        model2,
        torch.optim.AdamW(model2.parameters()),
        precision="fp32",
        checkpoint=engine.plan if engine.plan is not None else "none",
        accumulation_steps=choice.accumulation_steps,
    )
    for b, loss in zip(batches, auto_losses):
        assert_bitwise(by_hand.train_step(b, loss_fn), loss)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_micro_batch_auto_refuses_what_it_cannot_use() -> None:
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="chooses accumulation_steps itself"):
        memfit.Engine(model, opt, micro_batch="auto", accumulation_steps=2, precision="bf16-mixed")
    with pytest.raises(ConfigError, match="takes 'auto' or None"):
        memfit.Engine(model, opt, micro_batch=4, precision="bf16-mixed")
    engine = memfit.Engine(model, opt, precision="fp32", micro_batch="auto", memory_budget=2**30)
    with pytest.raises(ConfigError, match="split already"):
        engine.backward(batch_fn(2, generator=0), loss_fn)


def test_micro_batch_auto_with_a_budget_nothing_meets_says_the_least() -> None:
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CFG)
    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="fp32",
        micro_batch="auto",
        memory_budget=1024,
    )
    with pytest.raises(BudgetError, match="smallest budget that would fit"):
        engine.train_step(batch_fn(8, generator=0), loss_fn)


# ---------------------------------------------------------------- the search


def test_split_choices_make_the_global_batch_and_bad_ones_list_valid_choices() -> None:
    assert split_choices(12) == [(12, 1), (6, 2), (4, 3), (3, 4), (2, 6), (1, 12)]
    assert split_choices(16, world_size=4) == [(4, 1), (2, 2), (1, 4)]
    with pytest.raises(ConfigError, match="valid choices near it: .*15.*18"):
        split_choices(16, world_size=3)
    with pytest.raises(ConfigError, match="positive multiple"):
        split_choices(0)
    model_fn, batch_fn, loss_fn = _parts()
    with pytest.raises(ConfigError, match="world_size=3"):
        memfit.tune(model_fn, batch_fn, loss_fn, budget="1GiB", global_batch=16, world_size=3)


@pytest.mark.parametrize(
    ("speedups", "expected"), [(SLOW_BF16, {"fp32"}), (FAST_BF16, {"bf16-mixed", "bf16-master"})]
)
def test_the_tuner_chooses_fp32_where_bf16_is_slow_and_bf16_where_it_is_fast(
    speedups, expected
) -> None:
    model_fn, batch_fn, loss_fn = _parts()
    # Every precision fits without checkpointing: the ratio alone decides.
    budget = int(_plain_peak("fp32", 8))
    with assumed_speed("cpu", speedups):
        res = memfit.tune(model_fn, batch_fn, loss_fn, budget=budget, global_batch=8, measure_top=0)
    assert res.best.precision in expected
    assert res.best.fits and res.best.predicted_peak_bytes <= budget
    assert res.best.micro_batch * res.best.accumulation_steps == 8
    assert res.speedups["bf16-mixed"] == pytest.approx(speedups[torch.bfloat16])
    assert not res.speed_measured
    # Every precision, strategy and split was considered, ranked by prediction.
    assert {r.precision for r in res.rows} == {"fp32", "bf16-mixed", "bf16-master"}
    assert {r.checkpoint for r in res.rows} >= {"none", "full", "sqrt"}
    assert [r.rank for r in res.rows] == list(range(len(res.rows)))
    fitting = [r.predicted_step_seconds for r in res.rows if r.fits]
    assert fitting[0] == min(fitting) or fitting[0] <= 1.05 * min(fitting)


def test_nothing_fits_gives_the_smallest_budget_that_would_and_that_budget_fits() -> None:
    model_fn, batch_fn, loss_fn = _parts()
    with assumed_speed("cpu", FAST_BF16):
        with pytest.raises(BudgetError, match="smallest budget that would fit") as info:
            memfit.tune(model_fn, batch_fn, loss_fn, budget=1024, global_batch=8, measure_top=0)
        ranked = rank_candidates(model_fn, batch_fn, loss_fn, budget=1024, global_batch=8)
        least = min(c.predicted_peak_bytes for c in ranked if c.predicted_peak_bytes)
        assert memfit.units.format_bytes(least) in str(info.value)
        res = memfit.tune(
            model_fn, batch_fn, loss_fn, budget=int(least), global_batch=8, measure_top=0
        )
    assert res.best.predicted_peak_bytes <= int(least)


def _count_alone(monkeypatch) -> None:
    """Predicted times from the count alone: the model is not timed before the trials, so
    a test's injected failure reaches the trial it is meant for."""
    module = sys.modules["memfit.tuning.tune"]  # the package's `tune` is the function
    monkeypatch.setattr(module, "calibrate", lambda *a, **k: StepTimeModel())


def test_measured_trials_fit_and_a_trial_that_raises_is_a_row_not_the_end(monkeypatch) -> None:
    _count_alone(monkeypatch)
    model_fn, batch_fn, real_loss = _parts()
    budget = int(0.7 * _plain_peak("fp32", 8))
    calls = {"oom": 0}

    def loss_fn(model, batch):
        # The first trial measured runs out of memory on its first real step.
        if not _is_fake(batch) and calls["oom"] == 0:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("out of memory (injected)")
        return real_loss(model, batch)

    with assumed_speed("cpu", FAST_BF16):
        res = memfit.tune(
            model_fn, batch_fn, loss_fn, budget=budget, global_batch=8, measure_top=2, steps=1
        )
    failed = [r for r in res.rows if r.error and "OutOfMemoryError" in r.error]
    assert len(failed) == 1 and calls["oom"] == 1
    assert failed[0].measured_step_seconds is None  # recorded as a row, and the search went on
    measured = [r for r in res.rows if r.measured_step_seconds is not None]
    assert len(measured) >= 2 and res.best in measured
    assert res.best.measured_peak_bytes <= budget
    for r in measured:  # predicted vs measured, both recorded
        assert r.predicted_peak_bytes and r.measured_peak_bytes > 0
    assert "out of memory (injected)" in res.summary()
    assert all(r.note is None for r in res.rows)  # one process: the measured peak judges
    assert len(res.advice) == 3 and res.advice[0].startswith("loss scale")
    json.loads(res.to_json())
    # .engine builds the choice and trains the global batch in its micro-batches.
    torch.manual_seed(0)
    model = model_fn()
    engine = res.engine(model, torch.optim.AdamW(model.parameters()))
    assert engine.settings.accumulation_steps == res.best.accumulation_steps
    assert engine.settings.precision == res.best.precision
    engine.train_step(batch_fn(8), real_loss)


def test_the_usual_fixes_are_measured_in_each_precision_and_never_beat_the_choice() -> None:
    model_fn, batch_fn, loss_fn = _parts()
    budget = int(0.7 * _plain_peak("fp32", 8))
    with assumed_speed("cpu", FAST_BF16):
        res = memfit.tune(
            model_fn,
            batch_fn,
            loss_fn,
            budget=budget,
            global_batch=8,
            precisions=["fp32", "bf16-mixed"],
            measure_top=1,
            steps=2,
        )
    peers = [r for r in res.rows if r.peer is not None]
    for mode in ("fp32", "bf16-mixed"):
        halving = [r for r in peers if r.precision == mode and r.peer == "halving"]
        per_block = [r for r in peers if r.precision == mode and r.peer == "per-block"]
        assert len(halving) >= 1 and len(per_block) == 1
        assert all(r.checkpoint == "none" for r in halving)
        assert per_block[0].checkpoint == "full" and per_block[0].micro_batch == 8
        # A halving that went over the budget moved on to the next halving.
        over = [r for r in halving if r.error == "over the budget as measured"]
        fit = [r for r in halving if r.measured_step_seconds is not None]
        assert len(fit) == 1 and all(r.micro_batch > fit[0].micro_batch for r in over)
    fitting = [r.measured_step_seconds for r in peers if r.measured_step_seconds is not None]
    assert res.best.measured_step_seconds <= min(fitting)
    assert res.best.measured_peak_bytes <= budget
    assert res.rounds >= 2 and res.verdict and res.tuning_seconds > 0
    # The model was timed for the step-time terms; the trials give the rank correlation.
    assert res.step_time.measured and res.step_time.scale > 0
    assert res.step_time.per_micro_seconds >= 0 and res.step_time.per_step_seconds >= 0
    assert res.rank_correlation is not None and -1.0 <= res.rank_correlation <= 1.0
    text = res.summary()
    assert "halving" in text and "per-block" in text and f"{res.rounds} rounds" in text
    assert json.loads(res.to_json())["verdict"] == res.verdict


def test_max_seconds_bounds_what_is_optional_and_bad_values_are_refused(monkeypatch) -> None:
    _count_alone(monkeypatch)  # the ranking from the count, not from this machine's timing
    model_fn, batch_fn, loss_fn = _parts()
    budget = int(0.6 * _plain_peak("fp32", 8))
    with assumed_speed("cpu", FAST_BF16):
        res = memfit.tune(
            model_fn, batch_fn, loss_fn, budget=budget, global_batch=8, steps=2, max_seconds=1e-9
        )
        # The deadline passed before the first trial: settings are tried until one
        # starts (one measured over the budget gives way to the next), that one is timed
        # for its `steps` rounds, and nothing else starts.
        timed = [r for r in res.rows if r.measured_step_seconds is not None]
        assert len(timed) == 1 and res.rounds == 2 and res.best is timed[0]
        assert all(r.error for r in res.rows if r.measured and r is not timed[0])
        for bad in (0, -1.0):
            with pytest.raises(ConfigError, match="max_seconds"):
                memfit.tune(
                    model_fn, batch_fn, loss_fn, budget=budget, global_batch=8, max_seconds=bad
                )


def _is_fake(t: torch.Tensor) -> bool:
    from memfit.checkpoint.profiler.runner import is_fake

    return is_fake(t)


def test_every_trial_failing_is_an_error_that_lists_them() -> None:
    model_fn, batch_fn, real_loss = _parts()

    def loss_fn(model, batch):
        if not _is_fake(batch):
            raise RuntimeError("broken on real data")
        return real_loss(model, batch)

    with assumed_speed("cpu", FAST_BF16), pytest.raises(BudgetError, match="broken on real data"):
        memfit.tune(model_fn, batch_fn, loss_fn, budget="1GiB", global_batch=4, measure_top=1)


class _Timed:
    """Stands in for a Trial in the round-robin: records when it was timed."""

    def __init__(self, name: str, log: list[str], fail_at: int | None = None) -> None:
        self.name, self.log, self.fail_at = name, log, fail_at
        self.error: str | None = None
        self.calls = 0

    def time_step(self) -> float:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("step broke\nsecond line")
        self.log.append(self.name)
        return 0.0


def test_trials_are_timed_in_rotated_rounds_and_a_failing_one_drops_out() -> None:
    log: list[str] = []
    a, b, c = _Timed("a", log), _Timed("b", log, fail_at=2), _Timed("c", log)
    time_in_rounds([a, b, c], rounds=3)
    # a b c, then b c a (b fails on its second step), then c a (b timed no more)
    assert log == ["a", "b", "c", "c", "a", "c", "a"]
    assert b.error == "RuntimeError: step broke" and b.calls == 2
    assert a.error is None and c.error is None


def test_rounds_timed_one_at_a_time_still_rotate() -> None:
    log: list[str] = []
    trials = [_Timed("a", log), _Timed("b", log), _Timed("c", log)]
    for r in range(3):
        time_in_rounds(trials, 1, first_round=r)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


@pytest.mark.parametrize("measure_top", [1, 2])
def test_a_trial_whose_timed_step_raises_gives_way_and_the_rng_is_left_alone(
    measure_top: int, monkeypatch
) -> None:
    _count_alone(monkeypatch)
    _, real_loss, batch_fn = build_model("gpt", data="synthetic", dropout=0.1, **CFG)

    def model_fn():
        return build_model("gpt", data="synthetic", dropout=0.1, **CFG).model

    budget = int(0.7 * _plain_peak("fp32", 8))
    calls: dict[int, int] = {}  # real loss calls per model, in the order models were built

    def loss_fn(model, batch):
        if not _is_fake(batch):
            calls[id(model)] = calls.get(id(model), 0) + 1
            # The first model's warm-up and measured steps take two steps of 8 // rows
            # micro-batches each; its next call is its first timed step.
            if id(model) == next(iter(calls)) and calls[id(model)] == 2 * (8 // len(batch)) + 1:
                raise RuntimeError("broke while timed")
        return real_loss(model, batch)

    torch.manual_seed(123)
    before = torch.get_rng_state()
    with assumed_speed("cpu", FAST_BF16):
        res = memfit.tune(
            model_fn,
            lambda n: batch_fn(n, generator=0),
            loss_fn,
            budget=budget,
            global_batch=8,
            measure_top=measure_top,
            steps=2,
            peers=False,  # only the tuner's own splits: each stands in for another
        )
    assert torch.equal(torch.get_rng_state(), before)  # dropout drew from a fork
    broken = [r for r in res.rows if r.error and "broke while timed" in r.error]
    assert len(broken) == 1
    assert broken[0].measured_peak_bytes is not None and broken[0].measured_step_seconds is None
    # Its split's next setting (or another split) was measured in its place.
    measured = [r for r in res.rows if r.measured_step_seconds is not None]
    assert len(measured) == measure_top and res.best in measured and len(calls) > measure_top


@pytest.mark.parametrize(
    "world_size, data_parallel", [(1, None), (4, None), (4, "ddp"), (4, "fsdp")]
)
def test_tune_and_estimate_count_the_same_rank_for_the_same_arguments(
    world_size: int, data_parallel: str | None
) -> None:
    model_fn, batch_fn, loss_fn = _parts()
    micro = 8 // world_size
    with assumed_speed("cpu", FAST_BF16):
        ranked = rank_candidates(
            model_fn,
            batch_fn,
            loss_fn,
            budget=2**40,
            global_batch=8,
            world_size=world_size,
            data_parallel=data_parallel,
            precisions=["fp32"],
            strategies=["none"],
        )
    tuned = next(c for c in ranked if (c.micro_batch, c.accumulation_steps) == (micro, 1))
    (row,) = memfit.estimate(
        model_fn,
        batch_fn,
        batch_size=micro,
        loss_fn=loss_fn,
        precisions=["fp32"],
        strategies=["none"],
        world_size=world_size,
        data_parallel=data_parallel,
    ).rows
    assert tuned.plan.static_bytes == row.plan.static_bytes
    assert tuned.predicted_peak_bytes == row.peak_bytes


def test_tuning_for_fsdp_ranks_predicts_one_ranks_share_and_trials_do_not_judge_it() -> None:
    model_fn, batch_fn, loss_fn = _parts()
    with assumed_speed("cpu", FAST_BF16):
        one = rank_candidates(
            model_fn, batch_fn, loss_fn, budget=2**40, global_batch=8, strategies=["none"]
        )
        ddp, fsdp = (
            rank_candidates(
                model_fn,
                batch_fn,
                loss_fn,
                budget=2**40,
                global_batch=8,
                world_size=4,
                data_parallel=kind,
                strategies=["none"],
            )
            for kind in (None, "fsdp")
        )
    by_cell = {
        k: {(c.precision, c.micro_batch): c for c in r}
        for k, r in (("one", one), ("ddp", ddp), ("fsdp", fsdp))
    }
    for key, c in by_cell["fsdp"].items():
        # A rank of 4 trains a quarter of the batch; FSDP2 also holds a quarter of the state.
        assert key[1] * c.accumulation_steps == 2
        assert c.predicted_peak_bytes < by_cell["ddp"][key].predicted_peak_bytes
    assert (
        by_cell["ddp"][("fp32", 2)].predicted_peak_bytes
        < by_cell["one"][("fp32", 8)].predicted_peak_bytes
    )
    # A budget only an FSDP2 rank fits: below every DDP rank's peak, checkpointed or not.
    with assumed_speed("cpu", FAST_BF16):
        every_ddp = rank_candidates(
            model_fn, batch_fn, loss_fn, budget=2**40, global_batch=8, world_size=4
        )
    budget = int(0.97 * min(c.predicted_peak_bytes for c in every_ddp))
    assert min(c.predicted_peak_bytes for c in fsdp) < budget
    with assumed_speed("cpu", FAST_BF16):
        res = memfit.tune(
            model_fn,
            batch_fn,
            loss_fn,
            budget=budget,
            global_batch=8,
            world_size=4,
            data_parallel="fsdp",
            measure_top=1,
            steps=1,
        )
        with pytest.raises(BudgetError, match="nothing fits"):
            memfit.tune(
                model_fn,
                batch_fn,
                loss_fn,
                budget=budget,
                global_batch=8,
                world_size=4,
                measure_top=0,
            )
    assert res.data_parallel == "fsdp" and res.best.fits
    # The trial held the whole model in one process: over the rank's budget, yet chosen,
    # and its row says on what the fit was judged.
    assert res.best.measured_peak_bytes > budget and res.best.error is None
    for r in (r for r in res.rows if r.measured_peak_bytes is not None):
        assert r.note == (
            "measured in one process with the whole model: "
            f"{format_bytes(r.measured_peak_bytes)}; the per-rank peak is predicted: "
            f"{format_bytes(r.predicted_peak_bytes)}"
        )
    assert "over 4 ranks (fsdp)" in res.summary()
    assert res.best.note in res.summary() and "pred fits: each rank's predicted" in res.summary()
    assert json.loads(res.to_json())["best"]["note"] == res.best.note
    assert json.loads(res.to_json())["data_parallel"] == "fsdp"
    # The choice is applied by parallelize (the plan, one rank's), then the Engine.
    kwargs = res.parallelize_kwargs()
    assert kwargs["data_parallel"] == "fsdp" and kwargs["precision"] == res.best.precision
    assert (kwargs["checkpoint"] is None) == (res.best.checkpoint == "none")
    assert res.engine_kwargs() == {
        "precision": res.best.precision,
        "accumulation_steps": res.best.accumulation_steps,
    }
    with pytest.raises(ConfigError, match="init_process_group"):
        res.parallelize(model_fn())  # no process group here
    with assumed_speed("cpu", FAST_BF16):
        alone = memfit.tune(
            model_fn, batch_fn, loss_fn, budget="1GiB", global_batch=8, measure_top=0
        )
    with pytest.raises(ConfigError, match="tuned for one process"):
        alone.parallelize_kwargs()
    with pytest.raises(ConfigError, match="needs world_size > 1"):
        memfit.tune(
            model_fn,
            batch_fn,
            loss_fn,
            budget=budget,
            global_batch=8,
            data_parallel="fsdp",
            measure_top=0,
        )


def test_an_fsdp_trial_over_the_budget_is_noted_not_silently_fitting(monkeypatch) -> None:
    # A trial's peak is injected (85.53 MiB in one process with the whole model), so the
    # verdict on each row is the rule's alone, never this machine's allocator.
    module = sys.modules["memfit.tuning.tune"]
    released: list[object] = []

    class Held:
        peak_bytes = int(85.53 * 2**20)

        def release(self) -> None:
            released.append(self)

    monkeypatch.setattr(module.Trial, "start", lambda *a, **k: Held())
    budget = 60 * 2**20
    rows = {
        judged: TuneRow(Candidate("fp32", "none", 8, 1, 40 * 2**20, None, None, True), 0)
        for judged in (False, True)
    }
    cpu = torch.device("cpu")
    for judged, row in rows.items():
        module._start(row, None, None, None, None, budget, judged, cpu)
    fsdp, ddp = rows[False], rows[True]
    # FSDP2: the fit is the prediction's, and the row says what the measured peak is.
    assert fsdp.fits and fsdp.error is None and fsdp.measured_peak_bytes == Held.peak_bytes
    assert fsdp.note == (
        "measured in one process with the whole model: 85.53 MiB; the per-rank peak is "
        "predicted: 40.00 MiB"
    )
    # DDP or one process: the trial stands for the rank, and over the budget it fails.
    assert ddp.error == "over the budget as measured" and ddp.note is None and len(released) == 1
    res = TuneResult(fsdp, [fsdp], budget, 64, 8, "fsdp")
    text = res.summary()
    head, row_line = text.splitlines()[2:4]
    assert head.split()[:2] == ["#", "precision"] and "pred fits" in head
    assert "yes" in row_line and row_line.endswith(f"* best; {fsdp.note}")
    assert "pred fits: each rank's predicted peak against the budget" in text.splitlines()[1]
    assert json.loads(res.to_json())["rows"][0]["note"] == fsdp.note
    alone = TuneResult(ddp, [ddp], budget, 8, 1, None).summary()
    assert "pred fits: each rank" not in alone and "over the budget as measured" in alone


# ---------------------------------------------------------------- advice


def test_the_initial_loss_scale_keeps_the_largest_gradient_below_fp16s_max() -> None:
    scale = initial_loss_scale(GradStats(amax=0.5, underflow_fraction=0.0))
    assert scale == 4096.0  # 0.5 * 4096 * 16 = 32768 <= 65504 < 0.5 * 8192 * 16
    assert initial_loss_scale(GradStats(amax=1e-12, underflow_fraction=0.5)) == 2.0**24
    assert initial_loss_scale(GradStats(amax=1e6, underflow_fraction=0.0)) == 1.0
    text = loss_scale_advice(GradStats(0.5, 0.25), "fp16-mixed")
    assert "init_scale=4096" in text and "25.0%" in text
    assert "none needed" in loss_scale_advice(GradStats(0.5, 0.0), "bf16-mixed")


# ---------------------------------------------------------------- CLI


def test_memfit_tune_prints_the_choice_as_json(capsys) -> None:
    args = ["tune", *(f"--set={k}={v}" for k, v in CFG.items()), "--global-batch", "8"]
    with assumed_speed("cpu", SLOW_BF16):
        budget = str(int(0.5 * _plain_peak("fp32", 8)))
        assert main([*args, "--budget", budget, "--measure-top", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["precision"] == "fp32"
    assert out["best"]["micro_batch"] * out["best"]["accumulation_steps"] == 8
    assert out["rows"] and out["advice"]


def test_memfit_tune_bad_input_exits_2_or_1(capsys) -> None:
    base = ["tune", *(f"--set={k}={v}" for k, v in CFG.items()), "--measure-top", "0"]
    assert main([*base, "--budget", "1MiB", "--world-size", "3", "--global-batch", "16"]) == 2
    assert "valid choices near it" in capsys.readouterr().err
    assert main([*base, "--budget", "1KiB"]) == 1
    assert "smallest budget that would fit" in capsys.readouterr().err
    assert main([*base, "--budget", "1MiB", "--data-parallel", "fsdp"]) == 2
    assert "needs world_size > 1" in capsys.readouterr().err
    released = ["--budget", "1MiB", "--release-gradients", "on", "--world-size", "2"]
    assert main([*base, *released, "--global-batch", "16"]) == 2
    assert "cannot be tuned for a data-parallel run" in capsys.readouterr().err


def test_memfit_tune_release_gradients_on_releases_in_every_setting(capsys) -> None:
    args = ["tune", *(f"--set={k}={v}" for k, v in CFG.items()), "--global-batch", "2"]
    with assumed_speed("cpu", SLOW_BF16):
        assert main([*args, "--budget", "1GiB", "--measure-top", "0", "--json"]) == 0
        kept = json.loads(capsys.readouterr().out)
        on = ["--release-gradients", "on", "--budget", "1GiB", "--measure-top", "0", "--json"]
        assert main([*args, *on]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not kept["best"]["release_gradients"]
    assert out["best"]["release_gradients"] is True
    assert all(r["release_gradients"] and r["accumulation_steps"] == 1 for r in out["rows"])


TRAIN = [
    "train",
    *(f"--set={k}={v}" for k, v in CFG.items()),
    "--data=synthetic",
    "--steps=2",
    "--batch-size=8",
    "--eval-every=2",
    "--eval-batches=1",
    "--log-every=1",
]


def test_memfit_train_defaults_to_auto_and_trains_in_the_mode_chosen(tmp_path, capsys) -> None:
    with assumed_speed("cpu", SLOW_BF16):
        assert main([*TRAIN, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "precision auto: fp32" in out
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert config["precision"] == "auto" and summary["precision"] == "fp32"


def test_memfit_train_tune_saves_the_choice_and_refuses_what_it_chooses(tmp_path, capsys):
    budget = str(int(0.5 * _plain_peak("fp32", 8)))
    run = tmp_path / "run"
    with assumed_speed("cpu", FAST_BF16):
        assert main([*TRAIN, "--tune", "--budget", budget, "--out", str(run)]) == 0
    config = json.loads((run / "config.json").read_text())
    tuned = json.loads((run / "tune.json").read_text())
    best = tuned["best"]
    assert config["tune"] is True
    assert config["precision"] == best["precision"] != "auto"
    assert config["accumulation"] == best["accumulation_steps"]
    assert best["micro_batch"] * best["accumulation_steps"] == 8
    assert "advice: loss scale" in capsys.readouterr().out
    # Resumed: the saved choice, not tuned again.
    assert main([*TRAIN, "--steps=3", "--resume", str(run)]) == 0
    assert json.loads((run / "tune.json").read_text()) == tuned
    for extra, message in (
        (["--tune", "--accumulation=2", "--budget", budget], "--tune chooses --accumulation"),
        (["--tune"], "--tune needs --budget"),
    ):
        out = tmp_path / "refused"
        assert main([*TRAIN, *extra, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_a_model_that_cannot_run_on_meta_tensors_gets_the_estimators_advice() -> None:
    _, batch_fn, loss_fn = _parts()

    def model_fn():
        model = build_model("gpt", data="synthetic", **CFG).model
        model.scale = float(torch.ones(1).sum().item())  # reads a value: no meta tensor can
        return model

    with pytest.raises(ConfigError, match="smaller real instance"):
        memfit.tune(model_fn, batch_fn, loss_fn, budget="1GiB", global_batch=4, measure_top=0)


@dataclass(frozen=True)
class _AutoTier:
    budget: int
    chosen: TuneResult
    """Tuned with the tier "auto" midway between the least peaks without and with it."""
    roomy: TuneResult
    """Tuned with the tier "auto" at twice the least peak without it."""


def _tuned_with_auto(monkeypatch, setting: str, off: object, on: object, **kw) -> _AutoTier:
    """``memfit.tune(..., setting="auto")`` where nothing fits without the tier (and, as
    checked, tuning without it raises) and where everything fits without it."""
    _count_alone(monkeypatch)
    model_fn, batch_fn, loss_fn = _parts()
    with assumed_speed("cpu", FAST_BF16):
        least = {
            value: min(
                c.predicted_peak_bytes
                for c in rank_candidates(
                    model_fn, batch_fn, loss_fn, budget=2**40, **{setting: value}, **kw
                )
                if c.predicted_peak_bytes
            )
            for value in (off, on)
        }
        assert least[on] < least[off]
        budget = int((least[on] + least[off]) / 2)
        with pytest.raises(BudgetError, match="smallest budget"):
            memfit.tune(model_fn, batch_fn, loss_fn, budget=budget, measure_top=0, **kw)
        auto = {setting: "auto"}
        chosen = memfit.tune(
            model_fn,
            batch_fn,
            loss_fn,
            budget=budget,
            measure_top=1,
            steps=1,
            peers=False,
            **auto,
            **kw,
        )
        roomy = memfit.tune(
            model_fn, batch_fn, loss_fn, budget=2 * least[off], measure_top=0, **auto, **kw
        )
    return _AutoTier(budget, chosen, roomy)


def test_optimizer_state_auto_takes_fewer_bits_only_where_nothing_else_fits(monkeypatch) -> None:
    kw = {"global_batch": 8, "precisions": ["fp32"]}
    tuned = _tuned_with_auto(monkeypatch, "optimizer_state", "fp32", "8bit", **kw)
    res, roomy, budget = tuned.chosen, tuned.roomy, tuned.budget
    model_fn, batch_fn, loss_fn = _parts()
    assert res.best.optimizer_state == "8bit" and res.best.measured_peak_bytes <= budget
    assert "8bit optimizer state" in res.summary()
    assert json.loads(res.to_json())["best"]["optimizer_state"] == "8bit"
    torch.manual_seed(0)
    model = model_fn()
    engine = res.engine(model, torch.optim.AdamW(model.parameters()))
    assert engine.settings.optimizer_state == "8bit"
    engine.train_step(batch_fn(8), loss_fn)
    assert roomy.best.optimizer_state == "fp32"  # fp32 state fits: kept
    assert "optimizer_state" not in roomy.engine_kwargs()
    with pytest.raises(ConfigError, match="optimizer_state must be one of"):
        memfit.tune(model_fn, batch_fn, loss_fn, budget=budget, optimizer_state="4bit", **kw)


def test_bf16_sr_is_tuned_with_one_micro_batch_a_step() -> None:
    model_fn, batch_fn, loss_fn = _parts()
    with assumed_speed("cpu", FAST_BF16):
        ranked = rank_candidates(
            model_fn, batch_fn, loss_fn, budget=2**40, global_batch=8, precisions=["bf16-sr"]
        )
    assert ranked and {c.accumulation_steps for c in ranked} == {1}


def test_release_gradients_auto_releases_only_where_nothing_else_fits(monkeypatch) -> None:
    # One sample a step: the optimizer step, with every gradient, is this GPT's peak.
    kw = {"global_batch": 1, "precisions": ["fp32"]}
    tuned = _tuned_with_auto(monkeypatch, "release_gradients", False, True, **kw)
    res, roomy, budget = tuned.chosen, tuned.roomy, tuned.budget
    model_fn, batch_fn, loss_fn = _parts()
    assert res.best.release_gradients and res.best.measured_peak_bytes <= budget
    assert all(r.release_gradients and r.accumulation_steps == 1 for r in res.rows)
    assert "gradients released" in res.summary()
    assert json.loads(res.to_json())["best"]["release_gradients"] is True
    assert res.engine_kwargs()["release_gradients"] is True
    torch.manual_seed(0)
    model = model_fn()
    engine = res.engine(model, torch.optim.AdamW(model.parameters()))
    assert engine.settings.release_gradients
    engine.train_step(batch_fn(1), loss_fn)
    assert all(p.grad is None for p in model.parameters())  # each released in backward
    assert not roomy.best.release_gradients  # fits with every gradient kept: kept
    assert "release_gradients" not in roomy.engine_kwargs()
    with pytest.raises(ConfigError, match="release_gradients must be"):
        memfit.tune(model_fn, batch_fn, loss_fn, budget=budget, release_gradients="yes", **kw)
    with pytest.raises(ConfigError, match="data-parallel"):
        memfit.tune(
            model_fn,
            batch_fn,
            loss_fn,
            budget=budget,
            release_gradients=True,
            world_size=2,
            global_batch=2,
            precisions=["fp32"],
        )


@pytest.mark.usefixtures("free_coding")
def test_the_tuner_searches_activation_storage_and_the_engine_takes_it() -> None:
    """At 75 MiB this GPT's step fits only checkpointed; with fp8 storage offered, an
    ``optimal`` candidate stores blocks instead of recomputing them all, the choice says
    so, and the Engine it makes plans with the storage (measuring its gradient error).
    Coding is free here (the fixture): counted, this small GPT's blocks cost less to
    recompute than to code, and no candidate would store."""
    from memfit.models.gpt import GPT, GPTConfig, gpt_loss

    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128, vocab_size=256)

    def tuned(storage: tuple[str, ...]) -> TuneResult:
        return memfit.tune(
            lambda: GPT(cfg),
            lambda b: torch.randint(0, 256, (b, 129)),
            gpt_loss,
            budget="75MiB",
            global_batch=8,
            precisions=["fp32"],
            measure_top=0,
            activation_storage=storage,
        )

    plain, stored = tuned(("keep", "recompute")), tuned(("keep", "recompute", "fp8"))
    assert all(not r.candidate.stored for r in plain.rows)
    coded = [r for r in stored.rows if r.candidate.stored]
    assert coded and all(r.checkpoint == "optimal" and r.fits for r in coded)
    assert all(set(r.candidate.stored.values()) == {"fp8"} for r in coded)
    assert "activations in fp8" in coded[0].candidate.describe()
    # Beside each stored setting, the same split without storage recomputes more.
    for row in coded:
        same = next(
            r
            for r in plain.rows
            if (r.checkpoint, r.micro_batch) == ("optimal", row.micro_batch) and r.fits
        )
        assert row.plan.recompute_seconds < same.plan.recompute_seconds
    assert json.loads(stored.to_json())["rows"][0]["activation_storage"] == [
        "keep",
        "recompute",
        "fp8",
    ]
    # Predicted fastest (fp32 alone: the ranking is counted FLOPs, whatever the machine).
    assert stored.best.checkpoint == "optimal" and stored.best.candidate.stored
    assert stored.engine_kwargs()["activation_storage"] == ("keep", "recompute", "fp8")
    assert "activation_storage" not in plain.engine_kwargs()
    with pytest.raises(ConfigError, match="activation_storage"):
        tuned(("recompute", "fp8"))
