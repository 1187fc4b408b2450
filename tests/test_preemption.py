"""Preemption-safe runs: killed at any moment, the same command continues, and the final
state equals an uninterrupted run's bitwise.

The kills are real (SIGKILL, SIGTERM, SIGINT to a ``memfit train`` process) and land at
chosen moments deterministically: the process is started through :data:`WRAPPER`, which
patches one function to send the signal to its own process when the moment comes (as a
step begins, halfway through writing a state file, before old state files are rotated
away, after the last step). Nothing waits on a clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import memfit
from memfit.cli.main import main
from memfit.cli.run_dir import partial_files, state_files
from memfit.data import ResumableLoader
from memfit.distributed import any_rank
from memfit.engine import PREEMPTED_EXIT_CODE, Preempted
from memfit.errors import ConfigError
from memfit.savefile import safe_load

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich wraps at the terminal's width (80 under pytest): one line stays one line."""
    monkeypatch.setenv("COLUMNS", "1000")


# A 1-layer, 32-wide GPT on synthetic data: 12 steps, a state file every 3.
TINY = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "block_size=16"]
TINY += ["--data", "synthetic", "--precision", "fp32", "--batch-size", "4", "--steps", "12"]
TINY += ["--eval-every", "6", "--eval-batches", "1", "--save-every", "3", "--log-every", "1"]

#: ``python -c WRAPPER ARGS...`` is ``memfit ARGS...`` with one moment of
#: ``MEMFIT_TEST_MOMENT`` made deadly:
#: ``step:K`` SIGKILL as step K+1 begins; ``signal:K:NAME:N`` N signals NAME as step K+1
#: begins; ``mid-save:K`` SIGKILL halfway through writing checkpoint-K.pt; ``rotate``
#: SIGKILL once a new state file is complete, before old ones are rotated away; ``finish``
#: SIGKILL after the last step's save, before the summary is written.
WRAPPER = textwrap.dedent(
    """
    import io, os, signal, sys
    kind, _, arg = os.environ.get("MEMFIT_TEST_MOMENT", "").partition(":")

    def die(sig=signal.SIGKILL, times=1):
        for _ in range(times):
            os.kill(os.getpid(), sig)

    if kind in ("step", "signal"):
        from memfit.engine.core import Engine
        at, _, how = arg.partition(":")
        name, _, times = how.partition(":")
        sig = getattr(signal, name) if name else signal.SIGKILL
        original = Engine.train_step

        def train_step(self, batch, loss_fn):
            if self.steps == int(at):
                die(sig, int(times or 1))
            return original(self, batch, loss_fn)

        Engine.train_step = train_step
    elif kind == "mid-save":
        import memfit.savefile as savefile
        original = savefile.write_atomically

        def write_atomically(path, write):
            if os.path.basename(path) != f"checkpoint-{arg}.pt":
                return original(path, write)

            def half(f):
                buffer = io.BytesIO()
                write(buffer)
                data = buffer.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                die()

            return original(path, half)

        savefile.write_atomically = write_atomically
    elif kind == "rotate":
        import memfit.cli.run_dir as run_dir
        run_dir.rotate = lambda *args, **kwargs: die()
    elif kind == "finish":
        import memfit.cli.train_command as train_command
        train_command.finish = lambda *args, **kwargs: die()

    from memfit.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _memfit(cwd: Path, args: list[str], moment: str = "") -> subprocess.CompletedProcess[str]:
    """``memfit ARGS`` in a new process (one thread, as these tests), killed at ``moment``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000", "MEMFIT_TEST_MOMENT": moment}
    return subprocess.run(
        [sys.executable, "-c", WRAPPER, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang only
    )


def _names(run_dir: Path) -> list[str]:
    return [p.name for p in state_files(run_dir)]


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values, tensors bitwise (dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_same_state(path: Path, reference: Path) -> None:
    """Two state files hold the same training state bitwise: weights, optimizer, scaler,
    schedule, random generators and counters (not ``extra``, which records wall time)."""
    a, b = safe_load(path), safe_load(reference)
    a.pop("extra"), b.pop("extra")
    _assert_same(a, b)


@pytest.fixture
def no_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's report (which matplotlib draws, seconds a run) is left out."""
    import memfit.monitor

    monkeypatch.setattr(memfit.monitor, "make_report", lambda run_dir: run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run of TINY, uninterrupted, its 4 newest state files kept (its report, which
    matplotlib draws, left out)."""
    import memfit.monitor

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    make_report = memfit.monitor.make_report
    memfit.monitor.make_report = lambda run_dir: run_dir
    try:
        assert main(["train", *TINY, "--keep", "4", "--out", str(run_dir)]) == 0
    finally:
        memfit.monitor.make_report = make_report
    return run_dir


def test_killed_five_times_the_same_command_ends_bitwise_equal(
    tmp_path: Path,
    reference: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = ["train", *TINY, "--out", "run"]
    run = tmp_path / "run"

    # 1. Before the first save: config.json and no state file.
    done = _memfit(tmp_path, command, "step:2")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (run / "config.json").is_file() and _names(run) == []

    # 2. In a save: the run restarts at step 0, saves at step 3, and is killed halfway
    # through writing checkpoint-6.pt, whose temp file is left half-written.
    done = _memfit(tmp_path, command, "mid-save:6")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "restarted run at step 0 with its saved settings" in done.stdout
    assert _names(run) == ["checkpoint-3.pt"]
    (partial,) = partial_files(run)
    assert partial.name.startswith(".checkpoint-6.pt.") and partial.stat().st_size > 0

    # 3. Between saves: the partial file is never read (removed), the run continues from
    # checkpoint-3.pt, saves at 6 and is killed as step 8 begins.
    done = _memfit(tmp_path, command, "step:7")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert f"removed {partial.name}: a save cut short by a kill (never read)" in done.stdout
    assert "resumed run at step 3 from checkpoint-3.pt" in done.stdout
    assert _names(run) == ["checkpoint-6.pt", "checkpoint-3.pt"] and partial_files(run) == []

    # 4. Right after a save, before the old state files are rotated away.
    done = _memfit(tmp_path, command, "rotate")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "resumed run at step 6 from checkpoint-6.pt" in done.stdout
    assert _names(run) == ["checkpoint-9.pt", "checkpoint-6.pt", "checkpoint-3.pt"]

    # 5. After the last step and its save, before the summary is written.
    done = _memfit(tmp_path, command, "finish")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "resumed run at step 9 from checkpoint-9.pt" in done.stdout
    assert _names(run) == ["checkpoint-12.pt", "checkpoint-9.pt"]  # --keep 2
    assert not (run / "summary.json").exists()

    # The same command once more: the run is finished; what was missing is written.
    monkeypatch.chdir(tmp_path)
    assert main(command) == 0
    out = capsys.readouterr().out
    assert (
        "the run in run is finished (step 12 of --steps 12); nothing to train; wrote what "
        "was missing: summary.json, health.json"
    ) in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["samples_per_second"] > 0
    assert (
        summary["final_val_loss"]
        == json.loads((reference / "summary.json").read_text())["final_val_loss"]
    )
    assert (run / "report" / "report.html").is_file()
    _assert_same_state(run / "checkpoint-12.pt", reference / "checkpoint-12.pt")
    # The log reads as one run: each step once, the killed attempts' extra rows dropped.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
    # Once more: nothing is missing, nothing changes.
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert main(command) == 0
    assert "nothing to train\n" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_sigterm_saves_at_the_next_step_boundary_and_exits_75(
    tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch, no_report: None
) -> None:
    command = ["train", *TINY, "--out", "run"]
    run = tmp_path / "run"
    # SIGTERM as step 5 begins: step 5 finishes, is saved, and the run exits 75.
    done = _memfit(tmp_path, command, "signal:4:SIGTERM")
    assert done.returncode == PREEMPTED_EXIT_CODE == 75, done.stderr
    assert "memfit: SIGTERM received; the state is saved at the end of this step" in done.stderr
    assert "memfit train: stopped after step 5 on SIGTERM: the state is saved in " in done.stderr
    assert _names(run) == ["checkpoint-5.pt", "checkpoint-3.pt"]
    # Two SIGINTs as step 8 begins (a second Ctrl-C): the second ends the run at once,
    # nothing saved after checkpoint-6.pt.
    done = _memfit(tmp_path, command, "signal:7:SIGINT:2")
    assert done.returncode == -signal.SIGINT, done.stderr
    assert "resumed run at step 5 from checkpoint-5.pt" in done.stdout
    assert _names(run) == ["checkpoint-6.pt", "checkpoint-5.pt"]
    # The same command continues, bitwise.
    monkeypatch.chdir(tmp_path)
    assert main(command) == 0
    _assert_same_state(run / "checkpoint-12.pt", reference / "checkpoint-12.pt")


def test_a_state_file_that_does_not_load_is_passed_over(
    tmp_path: Path, reference: Path, capsys: pytest.CaptureFixture[str], no_report: None
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text((reference / "config.json").read_text())
    good = run / "checkpoint-9.pt"
    good.write_bytes((reference / "checkpoint-9.pt").read_bytes())
    bad = run / "checkpoint-12.pt"  # damaged on disk (a kill cannot do this: saves are atomic)
    data = (reference / "checkpoint-12.pt").read_bytes()
    bad.write_bytes(data[: len(data) // 3])
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "passed over checkpoint-12.pt: it does not load" in out
    assert f"resumed {run} at step 9 from checkpoint-9.pt" in out
    _assert_same_state(bad, reference / "checkpoint-12.pt")  # written over by the good one
    # None loads: the error names each and what to do; nothing changes.
    bad.write_bytes(data[:100])
    good.write_bytes(data[:100])
    assert main(["train", "--resume", str(run)]) == 1
    err = capsys.readouterr().err
    assert f"no state file of the run in {run} loads: checkpoint-12.pt: state file" in err
    assert "Move them out of" in err and "to start the run again at step 0" in err


def test_save_every_minutes_and_keep_rotate_the_state_files(
    tmp_path: Path, no_report: None
) -> None:
    run = tmp_path / "run"
    # A save due every step (any step takes longer than 1e-9 minutes), the 3 newest kept.
    args = ["--steps", "5", "--save-every", "100", "--save-every-minutes", "1e-9", "--keep", "3"]
    assert main(["train", *TINY, *args, "--out", str(run)]) == 0
    assert _names(run) == ["checkpoint-5.pt", "checkpoint-4.pt", "checkpoint-3.pt"]


def test_run_directories_of_earlier_versions_resume_and_rotate(
    tmp_path: Path, reference: Path, capsys: pytest.CaptureFixture[str], no_report: None
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text((reference / "config.json").read_text())
    (run / "checkpoint.pt").write_bytes((reference / "checkpoint-9.pt").read_bytes())
    (run / "checkpoint.prev.pt").write_bytes((reference / "checkpoint-6.pt").read_bytes())
    assert _names(run) == ["checkpoint.pt", "checkpoint.prev.pt"]
    assert main(["train", "--resume", str(run), "--keep", "2"]) == 0
    assert f"resumed {run} at step 9 from checkpoint.pt" in capsys.readouterr().out
    assert _names(run) == ["checkpoint-12.pt", "checkpoint.pt"]  # --keep 2
    _assert_same_state(run / "checkpoint-12.pt", reference / "checkpoint-12.pt")


def test_a_directory_with_state_files_and_no_config_is_refused(
    tmp_path: Path, reference: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-3.pt").write_bytes((reference / "checkpoint-3.pt").read_bytes())
    assert main(["train", *TINY, "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "holds state files (checkpoint-3.pt) but no config.json, so its settings are" in err
    assert _names(run) == ["checkpoint-3.pt"] and len(list(run.iterdir())) == 1


# ---------------------------------------------------------------- the Engine API


def _toy() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))


def _loader() -> ResumableLoader:
    """10 shuffled batches an epoch."""
    g = torch.Generator().manual_seed(1)
    return ResumableLoader(DataLoader(_dataset(), batch_size=4, shuffle=True, generator=g))


def _train(path: Path, signal_at: int | None = None, sig: int = signal.SIGINT) -> Any:
    """Three epochs with the Engine and a DataLoader, resuming from ``path`` when it exists;
    ``signal_at``: the step at whose start this process sends itself ``sig``."""
    model, optimizer = _toy()
    loader = _loader()
    if path.exists():
        engine = memfit.Engine.resume(path, model, optimizer, monitor=False)
        loader.load_state_dict(engine.extra["data"])
    else:
        engine = memfit.Engine(model, optimizer, precision="fp32", monitor=False, log_every=100)
    with engine.stop_on_signal(path, extra=lambda: {"data": loader.state_dict()}):
        while loader.epoch < 3:
            for batch in loader:
                if engine.steps == signal_at:
                    os.kill(os.getpid(), sig)
                engine.train_step(batch, _loss)
    return engine


def test_stop_on_signal_saves_at_the_step_boundary_and_resumes_bitwise(tmp_path: Path) -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    reference = _train(tmp_path / "reference.pt")
    path = tmp_path / "run.pt"
    with pytest.raises(Preempted) as stopped:
        _train(path, signal_at=13)  # mid-epoch 2: step 14 finishes, is saved, and stops
    assert stopped.value.code == 75 and stopped.value.step == 14
    assert stopped.value.signal == signal.SIGINT and stopped.value.path == path
    assert "stopped after step 14 on SIGINT: the state is saved in" in str(stopped.value)
    # The handlers that were there before are back.
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert safe_load(path)["extra"]["data"]["position"] == 4  # 14 = 10 + 4 batches
    resumed = _train(path)
    assert resumed.steps == reference.steps == 30
    _assert_same(resumed.model_state_dict(), reference.model_state_dict())
    _assert_same(resumed.optimizer.state_dict(), reference.optimizer.state_dict())


def test_any_rank_on_one_process_is_the_flags() -> None:
    assert any_rank(True, False) == (True, False)


class _Counted(torch.utils.data.Sampler[int]):
    """A sampler with a state: each epoch's order is a function of a counter it keeps."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, 0

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(100 + self.epochs)
        self.epochs += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epochs = state["epochs"]


class _Stream(IterableDataset):
    """An iterable dataset whose epoch's order is a function of set_epoch()."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 20

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(20, generator=g).float().unsqueeze(1))


LOADERS = {
    "shuffle-generator": lambda: DataLoader(
        _dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    ),
    "shuffle-alone": lambda: DataLoader(_dataset(), batch_size=3, shuffle=True),
    "sequential": lambda: DataLoader(_dataset(), batch_size=6),
    "set-epoch": lambda: DataLoader(
        _dataset(), batch_size=4, sampler=DistributedSampler(_dataset(), 1, 0, seed=3)
    ),
    "state-dict": lambda: DataLoader(_dataset(), batch_size=4, sampler=_Counted(40)),
    "iterable": lambda: DataLoader(_Stream(), batch_size=3),
    "workers-replay": lambda: DataLoader(
        _dataset(), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator()
    ),
}


def _batches(loader: ResumableLoader, count: int) -> list[Any]:
    out: list[Any] = []
    while len(out) < count:
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_resumed_loader_gives_the_batches_that_followed(kind: str, tmp_path: Path) -> None:
    replay = kind == "workers-replay"
    total = 2 * len(LOADERS[kind]()) + 3  # into a third epoch
    expected = _batches(ResumableLoader(LOADERS[kind](), replay=replay), total)
    for cut in (5, len(LOADERS[kind]()), total - 2):  # mid-epoch, at an epoch's end, later
        first = ResumableLoader(LOADERS[kind](), replay=replay)
        got = _batches(first, cut)
        torch.save(first.state_dict(), tmp_path / "data.pt")  # as Engine.save stores it
        again = ResumableLoader(LOADERS[kind](), replay=replay)
        again.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
        got += _batches(again, total - cut)
        _assert_same(got, expected, f"{kind} cut at {cut}")


def test_a_sampler_without_a_way_to_repeat_its_order_is_refused() -> None:
    class Opaque(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(torch.randperm(40).tolist())

        def __len__(self) -> int:
            return 40

    with pytest.raises(ConfigError, match=r"gives no way to make an epoch's order again"):
        ResumableLoader(DataLoader(_dataset(), batch_size=4, sampler=Opaque()))


# ---------------------------------------------------------------- two ranks under torchrun

SITE = textwrap.dedent(
    """
    import os
    if "RANK" in os.environ and "MEMFIT_TEST_SIGNAL" in os.environ:
        # "RANK:K": that rank sends itself SIGTERM as step K+1 begins.
        import signal
        from memfit.engine.core import Engine
        rank, at = map(int, os.environ["MEMFIT_TEST_SIGNAL"].split(":"))
        original = Engine.train_step

        def train_step(self, batch, loss_fn):
            if self.steps == at and int(os.environ["RANK"]) == rank:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, batch, loss_fn)

        Engine.train_step = train_step
    if "RANK" in os.environ and "MEMFIT_TEST_NO_REPORT" in os.environ:
        import memfit.monitor
        memfit.monitor.make_report = lambda run_dir: run_dir
    """
)


@pytest.mark.slow
def test_sigterm_to_one_of_two_ranks_stops_both_at_one_step_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    args = [*TINY, "--steps", "8", "--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}
    env |= {"PYTHONPATH": str(tmp_path / "site"), "MEMFIT_TEST_NO_REPORT": "1"}

    def memfit_train(out: str, **more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "memfit", "train", *args, "--out", out],
            cwd=tmp_path,
            env={**env, **more},
            capture_output=True,
            text=True,
            timeout=300,  # a guard against a hang only
        )

    done = memfit_train("reference")
    assert done.returncode == 0, done.stdout + done.stderr
    # Rank 1 alone receives SIGTERM, as step 5 begins: both ranks stop after step 5.
    done = memfit_train("run", MEMFIT_TEST_SIGNAL="1:4")
    assert done.returncode == PREEMPTED_EXIT_CODE, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "memfit: rank 1: SIGTERM received" in output
    assert "rank 1: stopped after step 5 on SIGTERM" in output
    assert "rank 0: stopped after step 5 on a signal to another rank" in output
    assert _names(tmp_path / "run") == ["checkpoint-5.pt", "checkpoint-3.pt"]
    done = memfit_train("run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed run at step 5 from checkpoint-5.pt" in done.stdout
    _assert_same_state(
        tmp_path / "run" / "checkpoint-8.pt", tmp_path / "reference" / "checkpoint-8.pt"
    )
