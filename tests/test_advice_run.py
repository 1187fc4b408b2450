"""Advice from what the monitor recorded: real short runs of a tiny net, their records, a
finished run directory, and the errors. Verdicts read the records, never a clock."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import statistics
import warnings
from pathlib import Path

import pytest
import torch
from engine_cases import batch, inf_loss, loss, net

import memfit
from memfit.cli import report_command as report_cli
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.monitor import Advice, Monitor, MonitorConfig, RunFacts, advise, load_run
from memfit.monitor import monitor as monitor_module
from memfit.monitor.advice import WARMUP_FACTOR
from memfit.tuning.hints import engine_facts

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 64 * 2**20


def train(steps: int, precision: str = "fp16-mixed", **engine: object) -> memfit.Engine:
    """``steps`` optimizer steps of the tiny net on 12-sample batches, logged every 5."""
    torch.manual_seed(0)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: the tiny net is the point
        eng = memfit.Engine(model, optimizer, precision=precision, log_every=5, **engine)  # type: ignore[arg-type]
    for i in range(steps):
        eng.train_step(batch(i), loss)
    return eng


def by_topic(advice: list[Advice]) -> dict[str, Advice]:
    return {a.topic: a for a in advice}


@pytest.fixture(scope="module")
def too_high(tmp_path_factory: pytest.TempPathFactory) -> memfit.Engine:
    """fp16-mixed starting at 2^24: the first steps overflow until the scale backs off.
    Its records also go to ``log_dir``'s metrics.jsonl."""
    eng = train(
        40,
        scaler=memfit.precision.LossScaler(init_scale=2.0**24),
        memory_budget=BUDGET,
        accumulation_steps=4,
        log_dir=tmp_path_factory.mktemp("too_high"),
    )
    eng.close()
    return eng


def test_a_scale_that_starts_too_high_is_advised_the_settled_one(
    too_high: memfit.Engine,
) -> None:
    records = too_high.monitor.records
    advice = by_topic(memfit.tuning.run_advice(too_high))
    scale = advice["loss scale"]
    skipped = records[-1]["amp/skipped"]
    settled = records[-1]["amp/scale"]
    assert skipped > 0 and settled < 2.0**24
    assert scale.numbers["skipped_steps"] == skipped
    assert scale.numbers["final_scale"] == settled
    assert scale.numbers["recommended_init_scale"] == settled
    assert scale.numbers["init_scale"] == 2.0**24
    assert scale.numbers["steps"] == records[-1]["step"] == 40
    assert f"LossScaler(init_scale={settled:g})" in scale.text
    assert "settled" in scale.text
    # Every skip came in the first log windows: none after the first clean one.
    assert scale.numbers["calibration_skips"] == skipped
    assert scale.numbers["overflow_rate_after_calibration"] == 0.0


def test_an_engine_log_dir_gives_the_live_records_advice(too_high: memfit.Engine) -> None:
    """The JSONL a monitor wrote, with the config.json and summary.json the Engine wrote
    beside it, reads back to the same numbers, the scaler's start included."""
    live = by_topic(memfit.tuning.run_advice(too_high))["loss scale"].numbers
    saved = by_topic(memfit.tuning.run_advice(too_high.log_dir))["loss scale"].numbers
    assert saved == live
    # A loop of its own asks its monitor, with the facts it knows (not the scaler's start).
    own = by_topic(too_high.monitor.advice(RunFacts(precision="fp16-mixed")))["loss scale"]
    assert own.numbers == {k: v for k, v in saved.items() if k != "init_scale"}
    assert too_high.monitor.advice(engine_facts(too_high)) == memfit.tuning.run_advice(too_high)


def test_starting_at_the_advised_scale_skips_no_step(too_high: memfit.Engine) -> None:
    advised = by_topic(memfit.tuning.run_advice(too_high))["loss scale"].numbers[
        "recommended_init_scale"
    ]
    again = train(
        40,
        scaler=memfit.precision.LossScaler(init_scale=advised),
        memory_budget=BUDGET,
        accumulation_steps=4,
    )
    assert again.monitor.records[-1]["amp/skipped"] == 0


def test_headroom_under_a_large_budget_suggests_less_accumulation(
    too_high: memfit.Engine,
) -> None:
    records = too_high.monitor.records
    advice = by_topic(memfit.tuning.run_advice(too_high))
    peak = max(
        r[k] for r in records for k in ("memory/peak_bytes", "plan/measured_peak_bytes") if k in r
    )
    checkpointing = advice["checkpointing"]
    assert checkpointing.numbers["peak_bytes"] == peak
    assert checkpointing.numbers["budget_bytes"] == BUDGET
    assert checkpointing.numbers["peak_share_of_budget"] == peak / BUDGET
    assert checkpointing.numbers["recomputed_units"] == 0  # the plan keeps everything
    assert "none needed" in checkpointing.text
    micro = advice["micro-batch"]
    assert micro.numbers["samples_per_step"] == 12 and micro.numbers["micro_batch"] == 3
    assert micro.numbers["suggested_micro_batch"] == 12
    assert micro.numbers["suggested_accumulation_steps"] == 1
    assert "12 x 1" in micro.text and "approximate" in micro.text and "memfit tune" in micro.text
    throughput = advice["throughput"]
    # The first window and any whose steps took over WARMUP_FACTOR x the median (a slow
    # moment of a loaded machine) are warm-up; the median is over the rest, as recorded.
    windows = records[1:]
    slow = WARMUP_FACTOR * statistics.median(r["time/step_seconds"] for r in windows)
    rates = [r["throughput/samples_per_second"] for r in windows if r["time/step_seconds"] <= slow]
    assert throughput.numbers["samples_per_second"] == statistics.median(rates)
    assert throughput.numbers["windows"] == len(rates)


def test_a_peak_over_the_budget_says_so(too_high: memfit.Engine) -> None:
    facts = engine_facts(too_high)
    peak = by_topic(memfit.tuning.run_advice(too_high))["checkpointing"].numbers["peak_bytes"]
    small = dataclasses.replace(facts, budget_bytes=peak / 2)
    advice = by_topic(advise(too_high.monitor.records, small))
    assert advice["checkpointing"].numbers["peak_share_of_budget"] == 2.0
    assert "over it" in advice["checkpointing"].text
    assert "peaks over the budget" in advice["micro-batch"].text


def test_a_scale_that_keeps_growing_is_advised_to_start_higher() -> None:
    eng = train(20, scaler=memfit.precision.LossScaler(init_scale=2.0, growth_interval=2))
    records = eng.monitor.records
    scale = by_topic(memfit.tuning.run_advice(eng))["loss scale"]
    assert records[-1]["amp/skipped"] == 0 and records[-1]["amp/scale"] > 2.0
    assert scale.numbers["recommended_init_scale"] == records[-1]["amp/scale"]
    assert "kept growing" in scale.text and "no overflow in 20 steps" in scale.text


def test_overflows_in_every_window_are_called_high() -> None:
    torch.manual_seed(0)
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = memfit.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            precision="fp16-mixed",
            log_every=5,
            max_consecutive_skips=1000,
        )
    for i in range(20):
        eng.train_step(batch(i), inf_loss)
    scale = by_topic(memfit.tuning.run_advice(eng))["loss scale"]
    assert scale.numbers["skipped_steps"] == eng.monitor.records[-1]["amp/skipped"] == 20
    assert "is high" in scale.text and "every log window" in scale.text


def test_bf16_needs_no_scale_and_a_fixed_plan_with_headroom_is_told_auto() -> None:
    eng = train(20, precision="bf16-mixed", checkpoint="full", memory_budget=BUDGET)
    advice = by_topic(memfit.tuning.run_advice(eng))
    assert advice["loss scale"].text.startswith("none needed in bf16-mixed")
    checkpointing = advice["checkpointing"]
    assert checkpointing.numbers["recomputed_units"] > 0
    assert checkpointing.numbers["predicted_peak_bytes"] == eng.plan.predicted_peak_bytes
    assert "checkpoint='auto' at this budget would recompute less" in checkpointing.text
    assert checkpointing.numbers["predicted_recompute_seconds"] == eng.plan.recompute_seconds > 0
    step = statistics.median(r["time/step_seconds"] for r in eng.monitor.records[1:])
    assert checkpointing.numbers["step_seconds"] == step


def test_too_few_steps_say_so_instead_of_guessing() -> None:
    eng = train(5)
    advice = memfit.tuning.run_advice(eng)
    assert [a.topic for a in advice] == ["run"]
    assert "too few steps" in advice[0].text
    assert advice[0].numbers == {"steps": 5.0, "log_records": 1.0}


def test_the_monitor_thins_its_records_keeping_the_first_and_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(monitor_module, "MAX_RECORDS", 8)
    monitor = Monitor(net(), MonitorConfig(enabled=False), None)
    for step in range(1, 21):
        monitor.log({"step": float(step), "amp/skipped": 0.0, "amp/scale": 1.0})
    steps = [r["step"] for r in monitor.records]
    assert len(steps) <= 8 and steps[0] == 1 and steps[-1] == 20
    assert steps == sorted(steps)


# ---------------------------------------------------------------------- run directories

TRAIN = [
    "train",
    *("--set", "n_layer=1", "--set", "n_embd=32", "--set", "block_size=16"),
    *("--data", "synthetic", "--precision", "fp32", "--steps", "20", "--batch-size", "8"),
    *("--accumulation", "2", "--eval-every", "20", "--eval-batches", "1"),
    *("--save-every", "20", "--log-every", "5", "--budget", "64MiB"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("advice") / "run"
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setenv("COLUMNS", "1000")  # rich wraps at the terminal's width
        assert main([*TRAIN, "--out", str(run_dir)]) == 0
    return run_dir, out.getvalue()


def test_memfit_train_prints_the_advice_of_its_run_directory(
    finished_run: tuple[Path, str],
) -> None:
    run_dir, printed = finished_run
    advice = memfit.tuning.run_advice(run_dir)
    assert "advice" in printed
    for item in advice:
        assert f"{item.topic}: {item.text}" in printed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["budget_bytes"] == 64 * 2**20 and summary["accumulation_steps"] == 2


def test_a_finished_run_directory_gives_advice_matching_its_records(
    finished_run: tuple[Path, str],
) -> None:
    run_dir, _ = finished_run
    records = load_run(run_dir).records
    logged = [r for r in records if "amp/scale" in r]
    advice = by_topic(memfit.tuning.run_advice(run_dir))
    assert advice["loss scale"].text.startswith("none needed in fp32")
    assert advice["loss scale"].numbers["steps"] == logged[-1]["step"] == 20
    checkpointing = advice["checkpointing"]
    peak = max(
        r[k] for r in records for k in ("memory/peak_bytes", "plan/measured_peak_bytes") if k in r
    )
    assert checkpointing.numbers["peak_bytes"] == peak
    assert checkpointing.numbers["budget_bytes"] == 64 * 2**20
    micro = advice["micro-batch"]
    assert micro.numbers["samples_per_step"] == 8 and micro.numbers["accumulation_steps"] == 2
    rates = [r["throughput/samples_per_second"] for r in logged[1:]]
    assert advice["throughput"].numbers["samples_per_second"] == statistics.median(rates)


def test_memfit_report_prints_the_advice_and_puts_it_in_the_page(
    finished_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = finished_run
    parser = argparse.ArgumentParser(prog="memfit")
    report_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert args.run(args) == 0
    captured = capsys.readouterr()
    assert Path(captured.out.strip()) == tmp_path / "out" / "report.html"
    for item in memfit.tuning.run_advice(run_dir):
        assert f"{item.topic}: {item.text}" in captured.err
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<section id='advice'>" in page and "micro-batch" in page


def test_a_run_directory_without_metrics_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        memfit.tuning.run_advice(tmp_path / "missing")
    with pytest.raises(ConfigError, match="holds no metrics.jsonl.*memfit train --out"):
        memfit.tuning.run_advice(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no valid line"):
        memfit.tuning.run_advice(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert "no valid line" in capsys.readouterr().err


def test_a_short_run_directory_says_too_few_steps(tmp_path: Path) -> None:
    lines = [{"step": s, "amp/scale": 1.0, "amp/skipped": 0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    advice = memfit.tuning.run_advice(tmp_path)
    assert [a.topic for a in advice] == ["run"] and "too few steps" in advice[0].text


# ---------------------------------------------------------------------- edge records


def _records(steps: int, every: int, **per_step: object) -> list[dict[str, float]]:
    """Synthetic log records: a loss scale, throughput and memory, ``per_step`` overrides
    as functions of the step."""
    out = []
    for step in range(every, steps + 1, every):
        r: dict[str, float] = {
            "step": float(step),
            "loss": 1.0,
            "amp/scale": 65536.0,
            "amp/skipped": 0.0,
            "time/step_seconds": 0.1,
            "throughput/samples_per_second": 160.0,
            "memory/peak_bytes": 4e6,
            "memory/kind/params": 1e6,
            "memory/kind/grads": 1e6,
            "memory/kind/optimizer": 1e6,
            "memory/kind/activations": 1e6,
        }
        for key, fn in per_step.items():
            r[key.replace("__", "/")] = fn(step)  # type: ignore[operator]
        out.append(r)
    return out


def test_a_sqrt_plan_counts_its_segments_as_recomputed() -> None:
    torch.manual_seed(0)
    chain = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(9)]
    )
    eng = memfit.Engine(
        chain,
        torch.optim.SGD(chain.parameters(), lr=0.01),
        checkpoint="sqrt",
        log_every=5,
        precision="bf16-mixed",
    )
    for i in range(20):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i))
        eng.train_step(x, lambda m, b: m(b).square().mean())
    # A sqrt plan keeps every unit's decision and recomputes through segments of them.
    assert all(d == "keep" for d in eng.plan.decisions.values()) and eng.plan.segments
    checkpointing = by_topic(memfit.tuning.run_advice(eng))["checkpointing"]
    spans = [e - s + 1 for spans in eng.plan.segments.values() for s, e in spans]
    assert checkpointing.numbers["recomputed_units"] == sum(spans) > 0
    assert f"{sum(spans)} of" in checkpointing.text


def test_rare_late_skips_recommend_no_new_start() -> None:
    records = _records(1000, 50, amp__skipped=lambda s: 1.0 if s >= 600 else 0.0)
    facts = RunFacts(precision="fp16-mixed", init_scale=65536.0)
    scale = by_topic(advise(records, facts))["loss scale"]
    assert "recommended_init_scale" not in scale.numbers
    assert "1 of 1000 steps skipped, all after the first clean log window" in scale.text


def test_weights_and_state_over_the_budget_fit_no_micro_batch() -> None:
    records = _records(40, 5)
    facts = RunFacts(precision="fp32", budget_bytes=2.5e6, accumulation_steps=2)
    advice = by_topic(advise(records, facts))
    assert "no micro-batch fits" in advice["micro-batch"].text
    assert "about -" not in advice["micro-batch"].text
    assert "which no checkpointing lowers" in advice["checkpointing"].text
    nan_kind = _records(40, 5, memory__kind__grads=lambda s: float("nan"))
    text = by_topic(advise(nan_kind, facts))["micro-batch"].text
    assert "nan" not in text


def test_full_checkpointing_over_the_budget_is_told_a_smaller_micro_batch() -> None:
    facts = RunFacts(
        precision="fp32",
        budget_bytes=3.5e6,  # above the 3e6 of weights and state, below the 4e6 peak
        checkpoint="full",
        plan_predicted_peak_bytes=3.4e6,
        plan_recomputed_units=4,
        plan_units=4,
        accumulation_steps=1,
    )
    text = by_topic(advise(_records(40, 5), facts))["checkpointing"].text
    assert "every unit is recomputed already" in text and "checkpoint='full'" not in text


def test_a_zero_peak_is_no_measurement_and_tiny_rates_do_not_crash() -> None:
    records = _records(40, 5, memory__peak_bytes=lambda s: 0.0)
    for r in records:
        for k in [k for k in r if k.startswith("memory/kind/")]:
            del r[k]
    advice = by_topic(advise(records, RunFacts(precision="fp32", budget_bytes=1e9)))
    assert "measured peak" not in advice["checkpointing"].text
    assert advice["micro-batch"].text.startswith("no memory was measured")
    slow = _records(40, 5, throughput__samples_per_second=lambda s: 0.4)
    slow = [{**r, "time/step_seconds": 1.0} for r in slow]
    facts = RunFacts(precision="fp32", budget_bytes=1e9, accumulation_steps=2)
    assert by_topic(advise(slow, facts))["micro-batch"].text  # no ZeroDivisionError


def test_a_resumed_runs_warm_up_window_is_left_out_of_the_throughput() -> None:
    records = _records(40, 5)
    records[4]["time/step_seconds"] = 1.0  # step 25: the first window after a resume
    records[4]["throughput/samples_per_second"] = 8.0
    throughput = by_topic(advise(records, RunFacts(precision="fp32")))["throughput"]
    assert throughput.numbers["windows"] == len(records) - 2
    assert throughput.numbers["samples_per_second"] == 160.0
    assert "2 with warm-up left out" in throughput.text
