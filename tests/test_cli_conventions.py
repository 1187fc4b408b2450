"""The CLI's conventions (issue 25): one ``--factory`` for every command, sizes checked as
they are parsed, the subcommand's usage on an error, missing paths named, a run's files
written with one mode, and output that does not contradict itself."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memfit.cli.common import PROFILER_NOTE, join_size_values, without_profiler_note
from memfit.cli.estimate_command import dominated_notes
from memfit.cli.main import main
from memfit.cli.run_dir import write_json
from memfit.cli.train_loop import EMPTY_FIELDS, _progress_fields, step_speed
from memfit.errors import StateFileError
from memfit.savefile import safe_load

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "my_model.py") + ":build"

TRAIN = ["train", "--precision", "fp32", "--device", "cpu", "--batch-size", "4"]
TRAIN += ["--eval-batches", "1"]


def _plain_mode(folder: Path) -> int:
    """The mode ``open()`` gives a new file under the current umask."""
    plain = folder / "plain"
    plain.write_bytes(b"")
    return stat.S_IMODE(plain.stat().st_mode)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``memfit train --factory examples/my_model.py:build --steps 2 --out DIR``: the run
    directory and what the command printed."""
    out = tmp_path_factory.mktemp("runs") / "mine"
    torch.set_num_threads(1)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*TRAIN, "--factory", EXAMPLE, "--steps", "2", "--out", str(out)])
    assert code == 0, buffer.getvalue()
    return out, buffer.getvalue()


# A. One --factory, one Workload, for train, plan, estimate and tune.


def test_train_trains_the_example_factory(example_run: tuple[Path, str]) -> None:
    out, printed = example_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["applied_steps"] == 2
    assert math.isfinite(summary["final_train_loss"])
    assert (out / "checkpoint-2.pt").is_file()
    assert json.loads((out / "config.json").read_text())["factory"] == EXAMPLE
    assert f"memfit train {EXAMPLE}" in printed.replace("\n", "")


def test_the_same_command_again_finds_the_factory_run_finished(
    example_run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = example_run
    assert main([*TRAIN, "--factory", EXAMPLE, "--steps", "2", "--out", str(out)]) == 0
    assert "is finished" in capsys.readouterr().out


def test_train_refuses_model_flags_with_a_factory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*TRAIN, "--factory", EXAMPLE, "--set", "n_layer=2", "--out", str(tmp_path / "r")]
    assert main(args) == 2
    assert "--factory builds its own" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--precision", "fp32", "--device", "cpu", "--batch-size", "4", "--json"],
        ["estimate", "--precision", "fp32", "--strategy", "none", "--batch-size", "4", "--json"],
        ["tune", "--budget", "1GiB", "--global-batch", "4", "--precisions", "fp32"]
        + ["--measure-top", "0", "--device", "cpu", "--json"],
    ],
    ids=["plan", "estimate", "tune"],
)
def test_plan_estimate_and_tune_take_the_same_factory(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--factory", EXAMPLE]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)


def test_a_factory_file_that_does_not_exist_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--factory", "nowhere/none.py:build"]) == 2
    assert "no such file 'nowhere/none.py'" in capsys.readouterr().err


# B. Conventions: sizes, usage lines, missing paths, file modes.

SIZE_ARGS = [
    ["train", "--budget"],
    ["plan", "--budget"],
    ["tune", "--budget"],
    ["estimate", "--device-memory"],
]


@pytest.mark.parametrize("value", ["-5MiB", "0", "5XB", "lots", "-1"])
@pytest.mark.parametrize("command", SIZE_ARGS, ids=lambda c: c[0])
def test_bad_sizes_say_what_a_size_is(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: memfit {command[0]} ")
    assert "must be a positive size like 2GiB" in err
    assert "expected one argument" not in err


def test_a_negative_size_is_joined_to_its_flag() -> None:
    assert join_size_values(["plan", "--budget", "-5MiB", "--json"]) == [
        "plan",
        "--budget=-5MiB",
        "--json",
    ]
    assert join_size_values(["plan", "--budget", "2GiB"]) == ["plan", "--budget", "2GiB"]
    assert join_size_values(["plan", "--budget", "--json"]) == ["plan", "--budget", "--json"]


def test_an_error_prints_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: memfit plan ")
    assert "COMMAND" not in err.splitlines()[0]


def test_resume_of_a_missing_directory_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent"
    assert main(["train", "--resume", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {missing}: no such directory" in err
    assert "config.json" not in err


def test_a_runs_files_all_get_the_usual_mode(example_run: tuple[Path, str]) -> None:
    out, _ = example_run
    expected = _plain_mode(out.parent)
    names = ["config.json", "summary.json", "health.json", "metrics.jsonl", "checkpoint-2.pt"]
    modes = {name: oct(stat.S_IMODE((out / name).stat().st_mode)) for name in names}
    assert modes == dict.fromkeys(names, oct(expected))


def test_json_files_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_json(tmp_path / "summary.json", {"steps": 1})
        plain = _plain_mode(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == plain == 0o640


# C. Output that agrees with itself.


def test_the_progress_bar_shows_nothing_before_its_first_window() -> None:
    assert set(EMPTY_FIELDS.values()) == {""}
    assert _progress_fields({}, 128) == EMPTY_FIELDS
    shown = _progress_fields(
        {
            "loss": 5.25,
            "throughput/samples_per_second": 4.0,
            "amp/scale": 1.0,
            "memory/peak_bytes": 3 * 2**20,
        },
        128,
    )
    assert shown == {
        "loss": "loss 5.2500",
        "speed": "512 tok/s",
        "scale": "scale 1",
        "mem": "mem 3.00 MiB",
    }


def test_the_summary_repeats_the_progress_bars_speed_with_labels(
    example_run: tuple[Path, str],
) -> None:
    out, printed = example_run
    assert "loss -" not in printed and "mem -" not in printed
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "throughput/samples_per_second" in r][-1]
    assert summary["step_samples_per_second"] == last["throughput/samples_per_second"]
    speed = step_speed({"throughput/samples_per_second": summary["step_samples_per_second"]}, None)
    flat = " ".join(printed.replace("│", " ").split())
    assert f"step throughput (progress bar) {speed}" in flat
    assert "run throughput (wall time)" in flat


def test_a_dominated_estimate_row_gets_a_note() -> None:
    def row(strategy: str, peak: float, recompute: float) -> SimpleNamespace:
        return SimpleNamespace(
            precision="fp32", strategy=strategy, peak_bytes=peak, recompute_fraction=recompute
        )

    rows = [
        row("none", 5e6, 0.0),
        row("full", 3.9e6, 0.64),
        row("sqrt", 4.4e6, 0.79),
        row("optimal", 5e6, 0.0),
    ]
    notes = dominated_notes(rows)
    assert len(notes) == 1 and notes[0].startswith("note: fp32 sqrt is dominated by full")


def test_torchs_profiler_note_is_dropped_and_the_rest_kept(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from memfit.allocator import allocator_peak

    made_before = [torch.randn(256, 256)]

    def frees_it() -> None:
        made_before.clear()  # freed inside the measurement: torch's C++ note
        torch.randn(8)

    with without_profiler_note():
        allocator_peak(frees_it)
        os.write(2, b"memfit: kept\n")
    err = capfd.readouterr().err
    assert PROFILER_NOTE not in err
    assert "memfit: kept" in err


def test_an_unreadable_state_file_starts_with_memfits_message(tmp_path: Path) -> None:
    garbage = tmp_path / "checkpoint-9.pt"
    garbage.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(StateFileError) as info:
        safe_load(garbage)
    text = str(info.value)
    assert text.startswith(f"state file {garbage} cannot be read: it is truncated or not a memfit")
    assert "file an issue" not in text and "weights_only` set to `False`" not in text
