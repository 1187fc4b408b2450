"""The CLI's modules: main imports the subcommands, the subcommands import only common
(and train its loop and start-up helpers: train_loop, start and run_dir, which import
nothing above them); every ``--factory`` takes one form, a memfit.Workload."""

from __future__ import annotations

import ast
import json
import re
import warnings
from pathlib import Path

import pytest

import memfit.cli
from memfit.cli.common import UsageError, load_workload, model_config_cls, parse_overrides
from memfit.cli.main import main

SUBCOMMANDS = {"train", "plan", "estimate", "report", "tune"}


def _cli_imports(path: Path) -> set[str]:
    """The memfit.cli modules that ``path`` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "memfit.cli":
                out.update(a.name for a in node.names)
            elif node.module.startswith("memfit.cli."):
                out.add(node.module.removeprefix("memfit.cli."))
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("memfit.cli.")
                for a in node.names
                if a.name.startswith("memfit.cli.")
            )
    return out


def test_subcommands_import_only_common_and_main_imports_them() -> None:
    package = Path(memfit.cli.__file__).parent
    modules = {f"{name}_command" for name in SUBCOMMANDS}
    for module in modules - {"train_command"}:
        assert _cli_imports(package / f"{module}.py") <= {"common"}, module
    assert _cli_imports(package / "train_command.py") == {
        "common",
        "run_dir",
        "start",
        "train_loop",
    }
    assert _cli_imports(package / "train_loop.py") == {"run_dir"}
    assert _cli_imports(package / "start.py") == {"common", "run_dir"}
    assert _cli_imports(package / "run_dir.py") == set()
    assert _cli_imports(package / "common.py") == set()
    assert _cli_imports(package / "main.py") == modules | {"common"}


def test_no_cli_code_reads_private_engine_attributes() -> None:
    package = Path(memfit.cli.__file__).parent
    for path in package.glob("*.py"):
        assert "engine._" not in path.read_text(), path.name


def test_set_overrides_are_typed_and_checked() -> None:
    config_cls = model_config_cls("gpt")
    assert parse_overrides(["n_layer=2", "dropout=0.1", "bias=false"], config_cls) == {
        "n_layer": 2,
        "dropout": 0.1,
        "bias": False,
    }
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        parse_overrides(["nope=1"], config_cls)
    with pytest.raises(UsageError, match="n_layer needs a int"):
        parse_overrides(["n_layer=x"], config_cls)
    with pytest.raises(UsageError, match="unknown --model 'foo'"):
        model_config_cls("foo")


def test_usage_errors_exit_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: memfit")
    assert "memfit plan: error: unknown --model 'foo'; valid: gpt, resnet, lstm" in err


# One factory contract: every --factory returns a memfit.Workload; the tuples each
# subcommand took before keep working for one release, with a DeprecationWarning.

FACTORIES = """
import torch

import memfit


def net():
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(8, 1))


def batch_of(n):
    return {"x": torch.randn(n, 8), "y": torch.randn(n, 1)}


def loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def workload():
    return memfit.Workload(model_fn=net, batch_fn=batch_of, loss_fn=loss)


def workload_without_loss():
    return memfit.Workload(model_fn=net, batch_fn=lambda n: torch.randn(n, 8))


def plan_tuple():
    return net(), batch_of(4), loss


def plan_pair():
    return net(), torch.randn(4, 8)


def tune_tuple():
    return net, batch_of, loss


def estimate_pair():
    return net, lambda n: torch.randn(n, 8)


def not_a_workload():
    return 42


def bad_workload():
    return memfit.Workload(model_fn=net(), batch_fn=batch_of)
"""

COMMANDS = {
    "plan": ["plan", "--precision", "fp32", "--device", "cpu", "--strategy", "full", "--json"],
    "estimate": ["estimate", "--precision", "fp32", "--strategy", "none", "--json"],
    "tune": [
        "tune",
        "--budget",
        "1GiB",
        "--global-batch",
        "4",
        "--precisions",
        "fp32",
        "--measure-top",
        "0",
        "--device",
        "cpu",
        "--json",
    ],
}


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cli_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_factories"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("name", ["workload", "workload_without_loss"])
def test_every_subcommand_takes_a_workload_without_a_warning(
    command: str, name: str, factories: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*COMMANDS[command], "--factory", f"{factories}:{name}"]
    if command != "tune":
        args += ["--batch-size", "4"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*--factory", category=DeprecationWarning)
        assert main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("command", "name", "shape"),
    [
        ("plan", "plan_tuple", "(model, batch, loss_fn)"),
        ("plan", "plan_pair", "(model, batch)"),
        ("tune", "tune_tuple", "(model_fn, batch_fn, loss_fn)"),
        ("estimate", "tune_tuple", "(model_fn, batch_fn, loss_fn)"),
        ("estimate", "estimate_pair", "(model_fn, batch_fn)"),
    ],
)
def test_the_old_factory_tuples_work_and_warn(
    command: str, name: str, shape: str, factories: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*COMMANDS[command], "--factory", f"{factories}:{name}"]
    with pytest.warns(DeprecationWarning, match=re.escape(shape) + r".*memfit\.Workload"):
        assert main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)


def test_an_old_plan_tuple_is_the_same_model_and_batch(factories: str) -> None:
    with pytest.warns(DeprecationWarning):
        workload = load_workload(f"{factories}:plan_tuple")
    model, batch = workload.model_fn(), workload.batch_fn(16)
    assert model is workload.model_fn() and batch is workload.batch_fn(2)
    assert workload.loss_fn(model, batch).ndim == 0


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_factory_that_returns_something_else_is_a_usage_error(
    command: str, factories: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*COMMANDS[command], "--factory", f"{factories}:not_a_workload"]) == 2
    assert "must return a memfit.Workload(model_fn, batch_fn, loss_fn), got int" in (
        capsys.readouterr().err
    )
    assert main([*COMMANDS[command], "--factory", f"{factories}:bad_workload"]) == 2
    assert "Workload.model_fn must be a function that builds the model, got a built Sequential" in (
        capsys.readouterr().err
    )


@pytest.mark.usefixtures("one_thread")
def test_plan_reports_the_measured_peak_unless_told_not_to_measure(
    factories: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*COMMANDS["plan"], "--factory", f"{factories}:workload", "--batch-size", "4"]
    assert main(args) == 0, capsys.readouterr().err
    measured = json.loads(capsys.readouterr().out)["measured_peak_bytes"]
    assert isinstance(measured, float) and measured > 0
    assert main([*args, "--no-verify"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["measured_peak_bytes"] is None


GPT_SMALL = ["--set", "n_layer=4", "--set", "n_embd=256", "--set", "n_head=4"]
GPT_SMALL += ["--set", "block_size=128", "--batch-size", "8", "--precision", "fp32"]


@pytest.mark.usefixtures("one_thread", "free_coding")
def test_activation_storage_flag_reaches_the_plan_and_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The budget (75 MiB) is below this GPT's unplanned peak: plain,
    the plan recomputes; given fp8, it stores blocks instead (coding counted free: whether
    it pays on this CPU is not this test's). A run keeps the setting."""
    plan_args = ["plan", *GPT_SMALL, "--budget", "75MiB", "--json"]
    assert main(plan_args) == 0, capsys.readouterr().err
    plain = json.loads(capsys.readouterr().out)
    assert main([*plan_args, "--activation-storage", "fp8"]) == 0, capsys.readouterr().err
    stored = json.loads(capsys.readouterr().out)
    assert not plain["storage"] and "recompute" in plain["decisions"].values()
    assert set(stored["storage"].values()) == {"fp8"}
    assert stored["recompute_flops"] < plain["recompute_flops"]
    run = tmp_path / "run"
    train = ["train", *GPT_SMALL, "--budget", "75MiB", "--activation-storage", "fp8"]
    train += ["--steps", "2", "--eval-batches", "1", "--out", str(run)]
    assert main(train) == 0, capsys.readouterr().err
    config = json.loads((run / "config.json").read_text())
    assert config["activation_storage"] == ["keep", "recompute", "fp8"]
    assert json.loads((run / "plan.json").read_text())["storage"]
    with pytest.raises(SystemExit) as bad:  # argparse's own error
        main(["plan", *GPT_SMALL, "--activation-storage", "int4"])
    assert bad.value.code == 2
    assert "takes one or more of bf16, int8, fp8, offload" in capsys.readouterr().err


def test_the_cli_offers_every_coded_storage_the_planner_knows() -> None:
    # Written out in memfit.cli.common so that building the parser imports no torch.
    from memfit.checkpoint.storage_stage import CODED
    from memfit.cli.common import CODED_STORAGES, activation_storage

    assert CODED_STORAGES == CODED
    assert activation_storage("fp8,bf16,fp8") == ("keep", "recompute", "fp8", "bf16")


@pytest.mark.usefixtures("one_thread")
def test_chunked_loss_trains_the_same_steps_and_is_kept_with_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.models.gpt as gpt

    calls = []
    chunked = gpt.chunked_gpt_loss
    monkeypatch.setattr(gpt, "chunked_gpt_loss", lambda *a: calls.append(1) or chunked(*a))
    tiny = ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2"]
    tiny += ["--set", "block_size=32", "--batch-size", "4", "--precision", "fp32"]
    tiny += ["--steps", "3", "--eval-batches", "1", "--log-every", "1"]
    losses = {}
    for name, extra in (("plain", []), ("chunked", ["--chunked-loss"])):
        run = tmp_path / name
        assert main(["train", *tiny, *extra, "--out", str(run)]) == 0, capsys.readouterr().err
        lines = (run / "metrics.jsonl").read_text().splitlines()
        losses[name] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    assert json.loads((tmp_path / "chunked" / "config.json").read_text())["chunked_loss"]
    assert calls  # the run trained with it
    # The same seed, data and updates: the same losses to rounding (the pieces are summed).
    assert losses["chunked"] == pytest.approx(losses["plain"], rel=1e-5)
    assert len(losses["plain"]) == 3
    bad = tmp_path / "lstm"
    assert main(["train", "--model", "lstm", "--chunked-loss", "--out", str(bad)]) == 2
    assert "--chunked-loss is the built-in gpt's loss" in capsys.readouterr().err
    assert not bad.exists()  # a failed start leaves nothing
