"""The CLI's modules: main imports the subcommands, the subcommands import only common
(and train its start-up helpers, start, which imports only common)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memfit.cli
from memfit.cli.common import UsageError, model_config_cls, parse_overrides
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
    for name in SUBCOMMANDS - {"train"}:
        assert _cli_imports(package / f"{name}.py") <= {"common"}, name
    assert _cli_imports(package / "train.py") == {"common", "start"}
    assert _cli_imports(package / "start.py") == {"common"}
    assert _cli_imports(package / "common.py") == set()
    assert _cli_imports(package / "main.py") == SUBCOMMANDS | {"common"}


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
