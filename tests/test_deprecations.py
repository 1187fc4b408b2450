"""Old paths, names and call forms keep working for one release, with a DeprecationWarning:
moved modules (the same module), names moved off the top level, memfit.plan's old forms."""

from __future__ import annotations

import functools
import importlib
import re
import subprocess
import sys

import pytest
import torch

import memfit
from memfit.checkpoint.plan import Plan
from memfit.deprecations import MOVED_MODULES
from memfit.errors import ConfigError


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_new_module_and_warns(old: str) -> None:
    if old.startswith("memfit.keras"):
        pytest.importorskip("keras")
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED_MODULES[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is new
    # The module keeps its own spec (a reload or find_spec sees the new path).
    assert module.__spec__.name == MOVED_MODULES[old]
    assert module.__name__ == MOVED_MODULES[old]


def test_old_paths_of_estimate_and_capacity_leave_the_functions_public() -> None:
    code = (
        "import warnings, types, memfit\n"
        "warnings.simplefilter('ignore')\n"
        "from memfit.estimate import Estimate\n"
        "from memfit.capacity import Capacity\n"
        "assert callable(memfit.estimate) and not isinstance(memfit.estimate, types.ModuleType)\n"
        "assert callable(memfit.capacity) and not isinstance(memfit.capacity, types.ModuleType)\n"
        "assert Estimate is memfit.Estimate\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_new_paths_do_not_warn() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import memfit.estimator, memfit.capacity_view, memfit.engine.plan_stage\n"
        "import memfit.cli.main\n"
    )
    subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning:torch", "-c", code], check=True
    )
    assert memfit.__version__


def test_bf16_true_trains_as_bf16_master_and_warns_at_the_callers_line() -> None:
    from memfit.precision.policy import ALIASES, PrecisionPolicy, resolve_mode

    with pytest.warns(DeprecationWarning, match="no fp32 master copy") as record:
        policy = PrecisionPolicy("bf16-true")
    assert policy.mode == "bf16-master"
    assert record[0].filename == __file__  # the user's line, not memfit's
    message = str(record[0].message)
    assert "'bf16-master'" in message and "'bf16-mixed'" in message and "0.3" in message
    with pytest.warns(DeprecationWarning, match="'BF16-True'"):  # any case, named as given
        assert resolve_mode(" BF16-True ") == "bf16-master"
    assert "bf16-true" not in ALIASES  # no longer offered as a spelling of a memfit mode


def test_renamed_functions_are_the_new_ones_and_warn() -> None:
    # In a fresh interpreter: importing the old module path above binds the package's
    # ``evaluate`` attribute to that module.
    code = (
        "import warnings\n"
        "from memfit.checkpoint.solvers import plan_cost\n"
        "from memfit.checkpoint.step_memory import RankLayout\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "for old, new in [('memfit.checkpoint.solvers', 'evaluate'),"
        " ('memfit.candidates', 'rank_layout'), ('memfit.monitor.metrics', 'SCALE_HEADROOM')]:\n"
        "    try:\n"
        "        exec(f'from {old} import {new}')\n"
        "    except DeprecationWarning as w:\n"
        "        assert 'memfit.checkpoint' in str(w) or 'memfit.precision' in str(w), w\n"
        "    else:\n"
        "        raise AssertionError(f'{old}.{new} did not warn')\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from memfit.checkpoint.solvers import evaluate\n"
        "from memfit.candidates import rank_layout\n"
        "assert evaluate is plan_cost and rank_layout == RankLayout.of\n"
        "from memfit.monitor.metrics import MAX_SUGGESTED_SCALE, SCALE_HEADROOM\n"
        "assert (SCALE_HEADROOM, MAX_SUGGESTED_SCALE) == (8.0, 2.0**24)\n"
    )
    subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning:torch", "-c", code], check=True
    )


def test_engine_state_resume_settings_is_read_resume_point_and_warns() -> None:
    import memfit.engine.state as state

    with pytest.warns(DeprecationWarning, match=r"memfit\.engine\.state\.read_resume_point"):
        old = state.resume_settings
    assert old is state.read_resume_point
    with pytest.raises(AttributeError, match="no_such_name"):
        state.no_such_name  # noqa: B018


# The top level keeps the names a training script uses daily; the rest moved to their
# modules and work as memfit.NAME for one release.


@pytest.mark.parametrize("name", sorted(memfit._MOVED))
def test_a_name_moved_off_the_top_level_warns_naming_its_module(name: str) -> None:
    module = importlib.import_module(memfit._MOVED[name])
    assert name not in memfit.__all__
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module.__name__}.{name}")):
        value = getattr(memfit, name)
    assert value is getattr(module, name)


def test_checkpoint_error_is_the_state_file_error() -> None:
    from memfit.errors import StateFileError

    with pytest.warns(DeprecationWarning, match=r"memfit\.errors\.StateFileError"):
        assert memfit.CheckpointError is StateFileError


# memfit.plan: loss_fn(model, batch) and settings by keyword; the old forms warn.


def _blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)]
    return torch.nn.Sequential(*blocks)


def _step_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _same(a: Plan, b: Plan) -> bool:
    return (a.decisions, a.predicted_peak_bytes) == (b.decisions, b.predicted_peak_bytes)


def test_plan_step_is_memfit_plan_and_warns() -> None:
    from memfit.checkpoint import plan_step

    model, x = _blocks(), torch.randn(4, 16)
    new = memfit.plan(model, x, _step_loss, strategy="full", precision="fp32")
    with pytest.warns(DeprecationWarning, match=r"memfit\.checkpoint\.plan_step.*memfit\.plan"):
        by_position = plan_step(model, x, _step_loss, None, "full", "fp32")
    with pytest.warns(DeprecationWarning, match="plan_step"):
        by_keyword = plan_step(model, x, _step_loss, strategy="full", precision="fp32")
    assert _same(new, by_position) and _same(new, by_keyword)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="multiple values"):
        plan_step(model, x, _step_loss, None, "full", strategy="none")


def test_plan_with_a_loss_of_the_output_warns_and_plans_as_before() -> None:
    model, x = _blocks(), torch.randn(4, 16)
    # The default loss is the sum of the output's first floating-point tensor, in fp32.
    default = memfit.plan(model, x, strategy="full", precision="fp32")
    with pytest.warns(DeprecationWarning, match=r"loss_fn\(output\).*loss_fn\(model, batch\)"):
        old = memfit.plan(
            model, x, loss_fn=lambda out: out.float().sum(), strategy="full", precision="fp32"
        )
    assert _same(default, old)
    with pytest.warns(DeprecationWarning, match=r"loss_fn\(output\)"):
        held = memfit.plan(
            model, x, lambda out: out.float().sum(), strategy="full", precision="fp32"
        )
    assert _same(default, held)


def test_plan_settings_by_position_in_either_old_order_warn_and_mean_the_same() -> None:
    model, x = _blocks(), torch.randn(4, 16)
    default = memfit.plan(model, x, strategy="full", precision="fp32")
    step = memfit.plan(model, x, _step_loss, strategy="full", precision="fp32")
    # memfit.plan's old order: budget, strategy, loss_fn, precision, ...
    with pytest.warns(DeprecationWarning, match=r"by position \(budget, strategy\)"):
        assert _same(default, memfit.plan(model, x, None, "full", precision="fp32"))
    with pytest.warns(DeprecationWarning, match="by position"):
        assert _same(step, memfit.plan(model, x, None, "full", _step_loss, "fp32"))
    # plan_step's old order: loss_fn, budget, strategy, precision, ...
    with pytest.warns(DeprecationWarning, match=r"by position \(budget, strategy, precision\)"):
        assert _same(step, memfit.plan(model, x, _step_loss, None, "full", "fp32"))
    with pytest.warns(DeprecationWarning, match=r"example_inputs"):
        assert _same(
            default, memfit.plan(model, example_inputs=x, strategy="full", precision="fp32")
        )
    with pytest.raises(TypeError, match="multiple values for argument 'budget'"):
        memfit.plan(model, x, "1GiB", budget="2GiB")
    with pytest.raises(TypeError, match="multiple values for argument 'loss_fn'"):
        memfit.plan(model, x, _step_loss, loss_fn=_step_loss)
    with pytest.raises(TypeError, match="settings by keyword"):
        memfit.plan(model, x, None, *range(10))
    with pytest.raises(TypeError, match="needs a batch"):
        memfit.plan(model)


def test_keep_output_is_for_the_output_s_loss_only() -> None:
    model, x = _blocks(), torch.randn(4, 16)
    with pytest.raises(ConfigError, match="keep_output applies to memfit.plan without a loss_fn"):
        memfit.plan(model, x, _step_loss, keep_output=False, precision="fp32")


class _StepLoss:
    def __call__(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).sum()


def test_the_old_loss_form_is_told_by_its_one_required_positional_parameter() -> None:
    from memfit.checkpoint.old_calls import takes_output

    def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()

    def many(*args: object) -> torch.Tensor:
        raise AssertionError(args)

    assert takes_output(lambda out: out.loss)
    assert takes_output(functools.partial(mse, target=torch.zeros(1)))
    assert takes_output(torch.sum)  # a builtin: no signature to read, only ever an output
    assert not takes_output(_step_loss)
    assert not takes_output(lambda model, batch, scale=1.0: model(batch) * scale)
    assert not takes_output(_StepLoss())
    assert not takes_output(many)


def test_train_command_evaluate_is_validation_loss() -> None:
    from memfit.cli import train_command

    with pytest.warns(DeprecationWarning, match=r"train_command\.validation_loss"):
        assert train_command.evaluate is train_command.validation_loss
    with pytest.raises(AttributeError, match="no_such_name"):
        train_command.no_such_name  # noqa: B018
