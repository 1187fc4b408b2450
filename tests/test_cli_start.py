"""``memfit train``'s start: a failed start leaves the disk as it was, a resumed run keeps
its settings (some flags may change), ``--factory`` batches go to ``--device``, and
``python -m memfit`` is the ``memfit`` command."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.cli import plan_command as plan_cli
from memfit.cli import start
from memfit.cli.common import UsageError, pick_device, to_device
from memfit.cli.main import main
from memfit.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

# A 1-layer, 32-wide GPT on synthetic data, two steps: a start costs well under a second.
TINY = [
    "--set",
    "n_layer=1",
    "--set",
    "n_embd=32",
    "--set",
    "block_size=16",
    "--data",
    "synthetic",
    "--precision",
    "fp32",
    "--steps",
    "2",
    "--batch-size",
    "4",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--save-every",
    "2",
    "--log-every",
    "1",
]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich wraps at the terminal's width (80 under pytest): one line stays one line."""
    monkeypatch.setenv("COLUMNS", "1000")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content's digest ("dir" for a directory)."""
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory that trained TINY to its end (step 2)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY, "--out", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of ``finished_run`` this test may change."""
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


# Each fails after argparse accepted the flags; the exit code and the message it gives.
BAD_STARTS = {
    # A size argparse accepts (a fraction of the device's memory) that is under a byte; a
    # malformed one ("lots") is argparse's error (tests/test_cli_conventions.py).
    "budget": (["--budget", "1e-30"], 2, "is less than one byte"),
    "checkpoint": (["--checkpoint", "uniform:0"], 2, "k must be a whole number >= 1"),
    "accumulation": (
        ["--accumulation", "32", "--batch-size", "16"],
        2,
        "--accumulation 32 is more micro-batches than --batch-size 16 has samples",
    ),
    "set": (["--set", "nope=1"], 2, "--set 'nope=1': expected KEY=VALUE"),
    "set-type": (["--set", "n_layer=x"], 2, "n_layer needs a int"),
    "precision": (["--precision", "fp99"], 2, "unknown precision 'fp99'"),
    "model": (["--model", "nope"], 2, "unknown --model 'nope'"),
    "data": (["--data", "nope"], 2, "cannot use data='nope'"),
    "device": (["--device", "meta"], 2, "--device meta: meta tensors hold no data"),
    "device-name": (["--device", "gpu0"], 2, "--device 'gpu0' is not a device name"),
    # Found only by planning: the optimizer step alone is over the budget.
    "plan": (["--checkpoint", "optimal", "--budget", "1KiB"], 1, "no checkpoint plan can fit"),
}


@pytest.mark.parametrize("case", list(BAD_STARTS), ids=list(BAD_STARTS))
def test_a_failed_start_creates_no_run_directory(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, code, message = BAD_STARTS[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "old").mkdir(parents=True)  # an earlier run's directory
    (tmp_path / "runs" / "old" / "config.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    # Without --out (the default runs/<model>-<precision>-<time>), with a new nested
    # --out, and with an existing directory that holds no run.
    for out in ([], ["--out", "new/nested/run"], ["--out", str(empty)]):
        assert main(["train", *TINY, *extra, *out]) == code, out
        assert message in capsys.readouterr().err, out
        assert snapshot(tmp_path) == before, out


def test_a_failed_start_with_no_runs_folder_leaves_the_cwd_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--budget", "1e-30"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_making_the_run_directory_removes_what_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened = []

    def open_then_fail(self: start.RunSinks) -> None:
        opened.append(self.run_dir)
        real_open(self)  # metrics.jsonl and tensorboard/ now exist
        raise ConfigError("disk full")

    real_open = start.RunSinks.open
    monkeypatch.setattr(start.RunSinks, "open", open_then_fail)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out in ("a/b", "kept"):
        assert main(["train", *TINY, "--out", out]) == 2
        assert "disk full" in capsys.readouterr().err
        assert snapshot(tmp_path) == before
    assert opened == [Path("a/b"), Path("kept")]


def test_undone_on_failure_keeps_what_was_there(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "old").mkdir(parents=True)
    (run_dir / "old" / "a.txt").write_text("a")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError), start.undone_on_failure(run_dir):
        (run_dir / "old" / "b.txt").write_text("b")
        (run_dir / "new" / "deep").mkdir(parents=True)
        (run_dir / "new" / "deep" / "c.txt").write_text("c")
        raise ConfigError("stop")
    assert snapshot(tmp_path) == before
    with start.undone_on_failure(run_dir):  # no failure: everything stays
        (run_dir / "d.txt").write_text("d")
    assert (run_dir / "d.txt").read_text() == "d"


def test_a_good_start_after_a_failed_one_uses_the_same_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--out", "run", "--checkpoint", "uniform:0"]) == 2
    assert not (tmp_path / "run").exists()
    assert main(["train", *TINY, "--out", "run"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    capsys.readouterr()
    # The same command again continues the run in it (here: finished, so nothing to do);
    # another setting is refused with the saved one, never a new run over the old.
    assert main(["train", *TINY, "--out", "run"]) == 0
    assert "the run in run is finished (step 2 of --steps 2); nothing to train" in (
        capsys.readouterr().out
    )
    assert main(["train", *TINY, "--out", "run", "--lr", "0.5"]) == 2
    assert "--lr 0.5 (saved: 0.001)" in capsys.readouterr().err


def test_resume_with_conflicting_flags_names_each_and_changes_nothing(
    finished_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(finished_run)
    resume = ["train", "--resume", str(finished_run)]
    assert main([*resume, "--precision", "bf16-mixed", "--lr", "5", "--steps", "9"]) == 2
    err = capsys.readouterr().err
    assert "--precision bf16-mixed (saved: fp32)" in err
    assert "--lr 5.0 (saved: 0.001)" in err
    assert "--steps 9" not in err  # allowed, so not a conflict
    assert "start a new run with --out NEW_DIR" in err
    assert main([*resume, "--set", "n_layer=2"]) == 2
    err = capsys.readouterr().err
    assert ": --set n_layer=2 (saved: --set n_layer=1 --set n_embd=32 --set block_size=16)." in err
    assert main([*resume, "--out", str(finished_run.parent / "elsewhere")]) == 2
    assert "continues the run in its own directory" in capsys.readouterr().err
    assert main([*resume, "--steps", "1"]) == 2
    assert "already at step 2, past --steps 1: a run cannot go back" in capsys.readouterr().err
    assert main(resume) == 0  # a finished run: exit 0, its summary and report kept as they are
    assert "is finished (step 2 of --steps 2); nothing to train\n" in capsys.readouterr().out
    assert snapshot(finished_run) == before


def test_resume_of_a_checkpoint_that_does_not_fit_changes_nothing(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((run_copy / "config.json").read_text())
    config["overrides"] = ["n_layer=2", "n_embd=32", "block_size=16"]  # not the saved model
    (run_copy / "config.json").write_text(json.dumps(config))
    before = snapshot(run_copy)
    assert main(["train", "--resume", str(run_copy)]) == 2
    assert "does not fit this model/optimizer" in capsys.readouterr().err
    assert snapshot(run_copy) == before  # no new event file, no metrics line


def test_resume_accepts_the_saved_values_and_their_aliases(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same overrides in another order, the same precision by an alias.
    same = ["--set", "block_size=16", "--set", "n_layer=1", "--set", "n_embd=32"]
    same += ["--precision", "32", "--batch-size", "4", "--lr", "0.001"]
    assert main(["train", "--resume", str(run_copy), *same, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "applied on resume: --steps 3 (was 2)\n" in out


def test_resume_applies_the_flags_that_may_change_and_saves_them(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--steps", "4", "--log-every", "2", "--eval-every", "1", "--save-every", "1"]
    assert main(["train", "--resume", str(run_copy), *args]) == 0
    out = capsys.readouterr().out
    assert (
        "applied on resume: --steps 4 (was 2), --log-every 2 (was 1), --eval-every 1 (was 2), "
        "--save-every 1 (was 2)"
    ) in out
    assert "step 3: validation loss" in out  # --eval-every 1 is in force
    config = json.loads((run_copy / "config.json").read_text())
    assert (config["steps"], config["log_every"], config["eval_every"]) == (4, 2, 1)
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 4
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    # Metrics were read every step up to 2, then every 2nd step (the Engine's log_every).
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 4]


def test_resume_that_trains_longer_keeps_the_learning_rate_schedule(tmp_path: Path) -> None:
    run = tmp_path / "run"
    schedule = ["--steps", "3", "--warmup", "1", "--lr", "0.001"]
    assert main(["train", *TINY, *schedule, "--out", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert (config["steps"], config["lr_schedule_steps"]) == (6, 3)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {int(r["step"]): r["lr"] for r in rows if "lr" in r}
    # Past the 3 steps it started with, the rate stays at the schedule's floor (10% of the
    # peak); a schedule stretched to 6 steps would have raised it again.
    assert [lrs[k] for k in (4, 5, 6)] == pytest.approx([1e-4] * 3, rel=1e-6)


def test_resume_without_a_config_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (A config.json without a state file restarts at step 0: tests/test_preemption.py.)
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_pick_device_refuses_devices_this_machine_lacks() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(UsageError, match="meta tensors hold no data"):
        pick_device("meta")
    with pytest.raises(UsageError, match="not a device name"):
        pick_device("nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device is available here"):
            pick_device("cuda")
    else:
        with pytest.raises(UsageError, match="CUDA device"):
            pick_device(f"cuda:{torch.cuda.device_count()}")


def test_to_device_moves_every_tensor_of_a_nested_batch() -> None:
    batch = {"x": torch.ones(2, 3), "pair": (torch.zeros(2), "tag"), "n": 4}
    moved = to_device(batch, torch.device("meta"))  # meta: a second device on any machine
    assert moved["x"].device.type == "meta" and moved["pair"][0].device.type == "meta"
    assert (moved["pair"][1], moved["n"]) == ("tag", 4)
    assert batch["x"].device.type == "cpu"  # the input is left as it was


FACTORY = """
import torch

import memfit

SEEN = []


def build():
    torch.manual_seed(0)

    def loss_fn(model, batch):
        SEEN.append(batch["x"].device)
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    return memfit.Workload(
        model_fn=lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        ),
        batch_fn=lambda n: {"x": torch.randn(n, 8), "y": torch.randn(n, 1), "name": "toy"},
        loss_fn=loss_fn,
    )
"""


def _factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plan_factory_batch_is_moved_to_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _factory(tmp_path, monkeypatch, "factory_cpu")
    moved_to = []

    def spy(batch, device):  # type: ignore[no-untyped-def]
        moved_to.append(device)
        return to_device(batch, device)

    monkeypatch.setattr(plan_cli, "to_device", spy)
    args = ["plan", "--factory", "factory_cpu:build", "--precision", "fp32"]
    assert main([*args, "--device", "cpu", "--strategy", "none", "--json"]) == 0
    assert moved_to == [torch.device("cpu")]
    assert json.loads(capsys.readouterr().out)["strategy"] == "none"
    assert main([*args, "--device", "meta"]) == 2
    assert "--device meta: meta tensors hold no data" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_factory_cpu_batch_runs_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _factory(tmp_path, monkeypatch, "factory_cuda")
    args = ["plan", "--factory", "factory_cuda:build", "--device", "cuda", "--strategy", "none"]
    assert main(args) == 0
    import factory_cuda  # type: ignore[import-not-found]

    assert factory_cuda.SEEN and all(d.type == "cuda" for d in factory_cuda.SEEN)


def test_python_dash_m_memfit_is_the_memfit_command(tmp_path: Path) -> None:
    def memfit(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "memfit", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = memfit("--help")
    assert done.returncode == 0 and "usage: memfit" in done.stdout
    done = memfit("train", "--budget", "lots")
    assert done.returncode == 2
    assert "memfit train: error: argument --budget: must be a positive size like 2GiB" in (
        done.stderr
    )
    assert memfit("train", "--steps", "0").returncode == 2  # argparse's own usage error
    assert list(tmp_path.iterdir()) == []
