"""Run reports: loading logs (crash-tolerant), figures, the HTML page, the CLI subcommand."""

from __future__ import annotations

import argparse
import base64
import json
import math
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import pytest

from memfit.cli import report_command as report_cli
from memfit.errors import ConfigError
from memfit.monitor.health import check_health, health_to_dict
from memfit.monitor.report import load_run, make_report

pytest.importorskip("matplotlib")

GiB = 2**30


def write_run(
    run_dir: Path,
    *,
    steps: int = 200,
    precision: str = "fp16-mixed",
    memory: bool = True,
    plan: bool = True,
    summary: bool = True,
) -> Path:
    """A run directory like ``memfit train`` writes, with the metric names the engine uses."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"model": "gpt", "precision": precision}))
    lines = []
    skipped, scale = 0, 8192.0
    for step in range(10, steps + 1, 10):
        if step in (30, 120):  # overflows: the scaler skips and backs off
            skipped += 1
            scale /= 2
        elif step % 100 == 0:
            scale *= 2
        row = {
            "step": float(step),
            "applied_steps": float(step - skipped),
            "loss": 4.0 * math.exp(-step / 80) + 1.0,
            "lr": 3e-3,
            "amp/scale": scale,
            "amp/skipped": float(skipped),
            "amp/overflow_rate": skipped / step,
            "amp/consecutive_skips": 0.0,
            "time/step_seconds": 0.05,
            "throughput/samples_per_second": 320.0 + step / 10,
            "throughput/tokens_per_second": (320.0 + step / 10) * 256,
            "grad/norm": 2.0 * math.exp(-step / 100) + 0.3,
            "memory/peak_bytes": 1.5 * GiB,
        }
        if memory and step == steps:
            row.update(
                {
                    "memory/kind/params": 0.2 * GiB,
                    "memory/kind/grads": 0.2 * GiB,
                    "memory/kind/optimizer": 0.4 * GiB,
                    "memory/kind/activations": 0.6 * GiB,
                    "memory/kind/temp": 0.1 * GiB,
                    "memory/dtype/float32": 0.8 * GiB,
                    "memory/dtype/float16": 0.7 * GiB,
                    "memory/low_precision_share": 0.7 / 1.5,
                }
            )
        lines.append(json.dumps(row))
        if step % 50 == 0:
            lines.append(
                json.dumps({"step": float(step), "val/loss": 4.2 * math.exp(-step / 90) + 1.1})
            )
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "steps": steps,
                    "applied_steps": steps - skipped,
                    "skipped_steps": skipped,
                    "final_train_loss": 1.3,
                    "final_val_loss": math.nan,
                    "peak_memory_bytes": int(1.5 * GiB),
                    "samples_per_second": 330.5,
                    "precision": precision,
                    "loss_scale": scale,
                }
            )
        )
    if plan:
        frontier = [
            {
                "peak_bytes": (3.0 - 0.4 * i) * GiB,
                "recompute_seconds": 0.004 * i**1.5,
                "recompute_flops": 1e9 * i,
            }
            for i in range(6)
        ]
        (run_dir / "plan.json").write_text(
            json.dumps(
                {
                    "frontier": frontier,
                    "predicted_peak_bytes": frontier[3]["peak_bytes"],
                    "recompute_seconds": frontier[3]["recompute_seconds"],
                    "budget_bytes": 2.0 * GiB,
                }
            )
        )
    return run_dir


def test_a_run_that_asked_for_auto_names_the_mode_it_trained_in(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", precision="auto")
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "precision": "bf16-mixed"}))
    assert load_run(run_dir).precision == "bf16-mixed"
    (run_dir / "summary.json").unlink()  # still running: no mode known yet
    assert load_run(run_dir).precision is None


def test_load_run_reads_every_file(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run"))
    assert run.precision == "fp16-mixed"
    assert run.skipped_lines == 0
    steps, losses = run.series("loss")
    assert steps[:3] == [10.0, 20.0, 30.0] and len(losses) == 20
    assert len(run.series("val/loss")[0]) == 4
    assert run.latest()["memory/kind/activations"] == 0.6 * GiB
    assert run.plan is not None and len(run.plan["frontier"]) == 6
    assert math.isnan(run.summary["final_val_loss"])
    assert run.health is None


def test_half_written_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", summary=False)
    path = run_dir / "metrics.jsonl"
    n = len(path.read_text().splitlines())
    with open(path, "a") as f:
        f.write('[1, 2]\n{"step": 210.0, "loss": "nan"}\n{"step": 220.0, "lo')
    with pytest.warns(UserWarning) as caught:
        run = load_run(run_dir)
    messages = [str(w.message) for w in caught]
    assert any(f"metrics.jsonl:{n + 1}:" in m for m in messages)  # not an object
    assert any(f"metrics.jsonl:{n + 3}:" in m for m in messages)  # half-written
    assert run.skipped_lines == 2
    assert math.isnan(run.latest()["loss"])  # "nan" read back as a float
    assert run.series("loss")[0][-1] == 210.0
    # The report still renders from what was read.
    with pytest.warns(UserWarning):
        html_path = make_report(run_dir)
    assert "2 malformed line(s) skipped" in html_path.read_text()


def test_missing_run_dir_and_empty_logs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no metrics.jsonl"):
        load_run(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no metrics"):
        load_run(tmp_path / "blank")
    with pytest.raises(ConfigError, match="does not exist"):
        make_report(tmp_path / "nope")


def test_report_renders_every_figure_embedded(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = make_report(run_dir)
    assert path == run_dir / "report" / "report.html"
    text = path.read_text()
    for name in ("loss", "loss_scale", "grad_norm", "memory", "throughput", "plan"):
        png = run_dir / "report" / f"{name}.png"
        assert png.read_bytes().startswith(b"\x89PNG")
        assert base64.b64encode(png.read_bytes()).decode() in text  # the same image, embedded
    assert text.count("src='data:image/png;base64,") == 6
    # Self-contained: nothing is fetched from anywhere.
    for needle in ("http://", "https://", "<link", "<script", "src='file:"):
        assert needle not in text
    assert "memfit run report" in text
    assert "overflow rate" in text  # the health table, computed from the last metrics
    assert "<td class='warn'>warn</td>" in text  # low-precision share 47% < 60%


def test_absent_data_becomes_notes_not_errors(tmp_path: Path) -> None:
    run_dir = write_run(
        tmp_path / "run", precision="bf16-mixed", memory=False, plan=False, summary=False
    )
    # A bf16 run: scale fixed at 1 and no gradient norm.
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r.pop("grad/norm", None)
        if "amp/scale" in r:
            r["amp/scale"] = 1.0
            r["amp/skipped"] = 0.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "elsewhere"
    html_path = make_report(run_dir, out)
    assert html_path == out / "report.html"
    text = html_path.read_text()
    assert "No checkpoint plan" in text
    assert "does not scale the loss" in text
    assert "No gradient norm was logged" in text
    assert "Only the peak was recorded: 1.50 GiB" in text
    assert "No summary.json" in text
    assert text.count("data:image/png;base64,") == 2  # loss and throughput
    assert not (out / "plan.png").exists()


def test_health_json_is_used_when_present(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    checks = check_health({"amp/overflow_rate": 0.3, "loss": 1.0}, "fp16-mixed")
    (run_dir / "health.json").write_text(json.dumps(health_to_dict(checks), allow_nan=False))
    text = make_report(run_dir).read_text()
    assert "From health.json" in text
    assert "30%" in text


def test_cli_report_prints_the_html_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = write_run(tmp_path / "run")
    parser = argparse.ArgumentParser(prog="memfit")
    sub = parser.add_subparsers(dest="command", required=True)
    report_cli.add_parser(sub)
    args = parser.parse_args(["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert args.run(args) == 0
    printed = capsys.readouterr().out.strip()
    assert Path(printed) == tmp_path / "out" / "report.html"
    assert Path(printed).is_file()
    args = parser.parse_args(["report", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="does not exist"):
        args.run(args)


def test_report_screenshot_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not on PATH (apt-get install chromium to run this check)")
    import matplotlib.image

    html_path = make_report(write_run(tmp_path / "run"))
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=1200,3000",
                html_path.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert shot.is_file(), f"chromium wrote no screenshot: {result.stderr[-2000:]}"
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (3000, 1200)
    non_white = (pixels < 0.97).any(axis=-1)
    assert non_white.mean() > 0.05, "the screenshot is (almost) blank"
    # Text near the top (the title) and content far down the page (the figures).
    assert non_white[:120].mean() > 0.005
    assert non_white[2000:].mean() > 0.02
