"""``import memfit`` and building the CLI's parser stay light: the public names load on
first use, and ``memfit --help`` imports neither torch nor the subcommands' machinery."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import memfit

# Heavy packages a light import must not pull in.
HEAVY = ("torch", "numpy", "rich", "matplotlib", "transformers", "tensorboard", "tensorflow")


def _modules_after(code: str) -> list[str]:
    """The heavy top-level packages in sys.modules after running ``code`` in a fresh
    interpreter."""
    script = textwrap.dedent(code) + (
        f"\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_import_memfit_imports_nothing_heavy() -> None:
    assert _modules_after("import memfit; memfit.__version__") == []


def test_the_workload_is_light_and_not_the_command_lines() -> None:
    # memfit.Workload lives below the tuner and the estimator, not in memfit.cli.
    assert _modules_after("import memfit; memfit.Workload") == []
    code = (
        "import memfit, sys; memfit.Workload; "
        "print(sorted(m for m in sys.modules if m.startswith('memfit.cli')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_building_the_cli_parser_imports_nothing_heavy() -> None:
    code = """
        from memfit.cli.main import build_parser
        parser = build_parser()
        for command in ("train", "plan", "estimate", "tune", "report"):
            try:
                parser.parse_args([command, "--help"])
            except SystemExit:
                pass
    """
    assert _modules_after(code) == []


def test_help_and_bad_flags_through_python_m() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "memfit", "--help"], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0 and ok.stdout.startswith("usage: memfit")
    bad = subprocess.run(
        [sys.executable, "-m", "memfit", "train", "--steps", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "usage: memfit train" in bad.stderr and "--steps" in bad.stderr


@pytest.mark.parametrize("name", memfit.__all__)
def test_every_public_name_resolves_to_its_source(name: str) -> None:
    value = getattr(memfit, name)
    assert value is not None
    assert name in dir(memfit)
    source = getattr(memfit, "_SOURCES", {}).get(name)
    if source is not None:
        assert value is getattr(importlib.import_module(source), name)


def test_functions_keep_their_names_over_same_named_submodules() -> None:
    # memfit/estimator.py defines estimate(), memfit/capacity_view.py capacity(): importing the
    # submodules must not turn memfit.estimate into a module.
    importlib.import_module("memfit.estimator")
    importlib.import_module("memfit.capacity_view")
    assert callable(memfit.estimate) and not isinstance(memfit.estimate, types.ModuleType)
    assert callable(memfit.capacity) and not isinstance(memfit.capacity, types.ModuleType)
    from memfit import capacity, estimate

    assert estimate is sys.modules["memfit.estimator"].estimate
    assert capacity is sys.modules["memfit.capacity_view"].capacity


def test_submodules_and_unknown_names() -> None:
    assert isinstance(memfit.checkpoint, types.ModuleType)
    assert memfit.checkpoint is sys.modules["memfit.checkpoint"]
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        memfit.not_a_name  # noqa: B018
    assert not hasattr(memfit, "__wrapped__")


def test_the_top_level_is_what_a_training_script_uses_daily() -> None:
    # Everything else lives in its module (docs/reference.md); the names moved off the top
    # level still resolve there for one release (tests/test_deprecations.py).
    assert set(memfit.__all__) == {
        "__version__",
        "Engine",
        "evaluate",
        "plan",
        "Plan",
        "apply_plan",
        "remove_plan",
        "estimate",
        "Estimate",
        "capacity",
        "tune",
        "TuneResult",
        "parallelize",
        "measure",
        "MonitorConfig",
        "PrecisionPolicy",
        "MemfitError",
        "Workload",
    }
    assert not set(memfit._MOVED) & set(memfit.__all__)
    assert set(memfit._SOURCES) == set(memfit.__all__) - {"__version__"}


def test_every_public_name_is_in_the_reference() -> None:
    reference = (Path(__file__).parents[1] / "docs" / "reference.md").read_text()
    for name in [*memfit.__all__, *memfit._MOVED]:
        assert f"`{name}`" in reference, name


def test_the_keras_front_end_leaves_torchs_flop_counter_unimported() -> None:
    # torch.utils.flop_counter imports triton where it is installed (torch's CUDA builds
    # from PyPI bring it), and triton's LLVM beside TensorFlow's aborts the process
    # ("LLVM ERROR: inconsistency in registered CommandLine options": a Keras user's first
    # memfit.keras.plan, with torch 2.15 and TensorFlow 2.21). memfit.keras plans with the
    # solvers alone: the counter, which only torch steps use, stays out.
    pytest.importorskip("tensorflow")
    code = """
        import os
        os.environ["KERAS_BACKEND"] = "tensorflow"
        import tensorflow, keras
        import memfit.keras as mk
        mk.plan, mk.MonitorCallback, mk.measure_step, mk.apply_plan
        import json, sys
        print(json.dumps(sorted(m for m in sys.modules if m in ("torch.utils.flop_counter", "triton"))))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
