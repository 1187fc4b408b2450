"""Runs are self-describing: an Engine's ``log_dir`` holds the ``config.json`` and
``summary.json`` that ``memfit train`` writes, so ``memfit report`` and ``run_advice`` know
the budget, the precision and the plan; where a file is missing, the advice says what it
does not know instead of guessing. Also: health rows that do not apply are left out with
one note, and the tuner's checkpoint advice counts units and FLOPs from one plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import memfit
from memfit.candidates import Candidate
from memfit.checkpoint.plan import Plan
from memfit.cli.main import main
from memfit.models import build_model
from memfit.monitor import check_health, render_health
from memfit.monitor.advice import plan_unit_counts
from memfit.monitor.health import not_applicable_note
from memfit.tuning import run_advice
from memfit.tuning.hints import checkpoint_advice
from memfit.tuning.result import TuneRow

BUDGET = "30MiB"
STEPS = 20


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GPT trained 20 steps by an Engine with a budget and a log_dir, closed."""
    torch.manual_seed(0)
    built = build_model(
        "gpt", data="synthetic", device=torch.device("cpu"), n_layer=2, n_embd=128, block_size=64
    )
    run_dir = tmp_path_factory.mktemp("engine_run")
    engine = memfit.Engine(
        built.model,
        torch.optim.AdamW(built.model.parameters(), lr=1e-3),
        precision="fp32",
        memory_budget=BUDGET,
        log_dir=run_dir,
        log_every=5,
    )
    for i in range(STEPS):
        engine.train_step(built.batch_fn(8, generator=i), built.loss_fn)
    engine.log_metrics({"val/loss": 4.5})
    assert (run_dir / "config.json").is_file()  # written with the first step
    assert not (run_dir / "summary.json").exists()  # ... and this one at close
    engine.close()
    return run_dir


def test_an_engine_log_dir_holds_config_and_summary(engine_run: Path) -> None:
    config = json.loads((engine_run / "config.json").read_text())
    summary = json.loads((engine_run / "summary.json").read_text())
    assert config["budget"] == BUDGET and config["budget_bytes"] == 30 * 2**20
    assert config["precision"] == "fp32" and config["checkpoint"] == "auto"
    assert config["written_by"] == "memfit.Engine"
    assert summary["budget_bytes"] == 30 * 2**20
    assert summary["steps"] == STEPS and summary["precision"] == "fp32"
    assert summary["final_val_loss"] == 4.5 and summary["final_train_loss"] > 0
    assert summary["samples_per_second"] > 0 and summary["wall_seconds"] > 0
    # The keys memfit train writes (memfit/cli/train_loop.py), every one of them.
    for key in (
        "steps applied_steps skipped_steps final_train_loss final_val_loss peak_memory_bytes "
        "samples_per_second tokens_per_second wall_seconds precision loss_scale budget_bytes "
        "accumulation_steps init_scale growth_interval"
    ).split():
        assert key in summary, key
    assert (engine_run / "plan.json").is_file()
    # Written like the state files: the mode a plain open() gives, not a temp file's 0600.
    assert (engine_run / "summary.json").stat().st_mode & 0o044


def test_memfit_report_on_an_engine_run_names_budget_precision_and_plan(
    engine_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = engine_run.parent / "report_out"
    assert main(["report", str(engine_run), "--out", str(out)]) == 0
    advice = capsys.readouterr().err
    assert "30.00 MiB budget" in advice
    assert "none needed in fp32" in advice
    assert "plan auto" in advice
    assert "no budget was set" not in advice and "unknown" not in advice
    assert "30.00 MiB budget" in (out / "report.html").read_text()


def test_a_directory_without_config_or_summary_says_what_it_does_not_know(
    engine_run: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(engine_run / "metrics.jsonl", bare / "metrics.jsonl")
    advice = {a.topic: a.text for a in run_advice(bare)}
    assert "the budget is unknown" in advice["checkpointing"]
    assert "the budget is unknown" in advice["micro-batch"]
    assert advice["loss scale"].startswith("the precision is unknown")
    everything = " ".join(advice.values())
    assert "no budget was set" not in everything
    assert "this precision" not in everything


def test_a_recorded_absence_is_said_as_such(engine_run: Path, tmp_path: Path) -> None:
    """A config.json that records no budget: the advice says none was set."""
    run = tmp_path / "nobudget"
    run.mkdir()
    shutil.copy(engine_run / "metrics.jsonl", run / "metrics.jsonl")
    config = {"precision": "fp32", "checkpoint": "none", "budget": None, "accumulation": 1}
    (run / "config.json").write_text(json.dumps(config))
    advice = {a.topic: a.text for a in run_advice(run)}
    assert "no budget was set" in advice["checkpointing"]
    assert "unknown" not in " ".join(advice.values())


def test_health_rows_that_do_not_apply_are_left_out_with_one_note() -> None:
    from rich.console import Console

    checks = check_health({"loss": 2.0}, "fp32")
    assert len(checks) == 7 and sum(c.applies for c in checks) == 1
    note = not_applicable_note(checks)
    assert note is not None
    for c in checks:
        if not c.applies:
            assert note.count(c.name) == 1
    assert note.count("keeps fp32's exponent range") == 1  # the reason said once
    console = Console(width=200, record=True)
    console.print(render_health(checks))
    text = console.export_text()
    assert "n/a" not in text and "loss" in text and "left out" in text
    # Under fp16 every check applies: no note.
    fp16 = check_health({"loss": 2.0}, "fp16-mixed", extra={"has_plan": True})
    assert not_applicable_note(fp16) is None


def test_tuner_checkpoint_advice_counts_units_and_flops_from_one_plan() -> None:
    """Two units recomputed selectively add no matmul FLOPs: the advice says so, and
    counts the model's 4 blocks, not its 6 decisions (the model and its ModuleList)."""
    decisions = {"": "keep", "blocks": "keep", **{f"blocks.{i}": "keep" for i in range(4)}}
    decisions["blocks.0"] = decisions["blocks.1"] = "selective"
    plan = Plan(decisions=decisions, recompute_flops=0.0)
    candidate = Candidate("fp32", "optimal", 2, 8, 1.0, 1.0, 0.0, True, plan)
    text = checkpoint_advice(TuneRow(candidate, rank=0), len(decisions))
    assert "2 recomputed of 4 units" in text
    assert "0.0% of a forward pass's matmul FLOPs" in text
    assert "2 selectively" in text
    counts = plan_unit_counts({**decisions, "blocks.2": "recompute"})
    assert (counts.units, counts.whole, counts.selective) == (4, 1, 2)
