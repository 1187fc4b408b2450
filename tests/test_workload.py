"""``memfit.Workload`` as the Python API's first argument: ``memfit.tune(workload, ...)`` and
``memfit.estimate(workload, ...)`` give the rows of the three functions given one by one,
and a Workload beside a separate batch function or loss is refused, saying which to drop.

Only what does not depend on the machine is compared: predicted bytes, plans, fits and
the order of prediction under an injected matmul ratio, never a measured time.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import memfit
from memfit.errors import ConfigError
from memfit.precision.speed import assumed_speed
from memfit.workload import Workload, unpack_workload

pytestmark = pytest.mark.usefixtures("one_thread")


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    )


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8), torch.randn(n, 1)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


WORK = Workload(model_fn=_net, batch_fn=_batch, loss_fn=_loss)


def _tune_rows(res: memfit.TuneResult) -> list[tuple]:
    return [
        (
            r.rank,
            r.precision,
            r.checkpoint,
            r.micro_batch,
            r.accumulation_steps,
            r.predicted_peak_bytes,
            r.fits,
            None if r.plan is None else r.plan.decisions,
        )
        for r in res.rows
    ]


def _estimate_rows(est: memfit.Estimate) -> list[tuple]:
    return [
        (
            r.precision,
            r.strategy,
            r.peak_bytes,
            dict(r.parts),
            r.fits,
            r.max_micro_batch,
            None if r.plan is None else r.plan.decisions,
        )
        for r in est.rows
    ]


def test_the_public_name_is_the_librarys_and_the_cli_takes_the_same_class() -> None:
    assert memfit.Workload is Workload
    assert importlib.import_module("memfit.cli.common").Workload is Workload


def test_tune_takes_a_workload_in_place_of_the_three_functions() -> None:
    kw = dict(budget="60MiB", global_batch=8, precisions=["fp32", "bf16-mixed"], measure_top=0)
    with assumed_speed("cpu", {torch.bfloat16: 2.7}):
        given = memfit.tune(_net, _batch, _loss, **kw)
        held = memfit.tune(WORK, **kw)
    assert len(held.rows) > 4 and _tune_rows(held) == _tune_rows(given)
    assert (held.best.precision, held.best.checkpoint, held.best.micro_batch) == (
        given.best.precision,
        given.best.checkpoint,
        given.best.micro_batch,
    )


def test_estimate_takes_a_workload_in_place_of_the_three_functions() -> None:
    kw = dict(batch_size=4, precisions=["fp32", "bf16-master"], device_memory="1MiB")
    given = memfit.estimate(_net, _batch, _loss, **kw)
    held = memfit.estimate(WORK, **kw)
    assert len(held.rows) == 8 and _estimate_rows(held) == _estimate_rows(given)


def test_the_workloads_own_loss_is_the_one_that_runs() -> None:
    calls: list[int] = []

    def counted(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        calls.append(1)
        return _loss(model, batch)

    memfit.estimate(
        dataclasses.replace(WORK, loss_fn=counted),
        batch_size=2,
        precisions=["fp32"],
        strategies=["none"],
    )
    assert calls  # the loss the Workload holds, not the default sum of the output


@pytest.mark.parametrize(
    "extra, dropped",
    [
        ({"batch_fn": _batch}, "drop batch_fn,"),
        ({"loss_fn": _loss}, "drop loss_fn,"),
        ({"batch_fn": _batch, "loss_fn": _loss}, "drop batch_fn and loss_fn,"),
    ],
)
def test_tune_with_a_workload_and_its_parts_again_says_which_to_drop(extra, dropped) -> None:
    with pytest.raises(ConfigError) as info:
        memfit.tune(WORK, **extra, budget="60MiB", global_batch=8, measure_top=0)
    text = str(info.value)
    assert text.startswith("memfit.tune(workload, ...) takes the batch and the loss from the")
    assert dropped in text and "without a Workload" in text


def test_estimate_with_a_workload_and_its_parts_again_says_which_to_drop() -> None:
    with pytest.raises(ConfigError, match=r"memfit\.estimate\(workload, \.\.\.\).*drop inputs_fn,"):
        memfit.estimate(WORK, _batch, batch_size=2)
    with pytest.raises(ConfigError, match=r"drop loss_fn,"):
        memfit.estimate(WORK, loss_fn=_loss, batch_size=2)


def test_the_positional_form_without_a_batch_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match=r"memfit\.tune needs a batch: write memfit\.tune\("):
        memfit.tune(_net, budget="60MiB", global_batch=8)
    with pytest.raises(
        ConfigError, match=r"memfit\.estimate\(memfit\.Workload\(model_fn, inputs_fn"
    ):
        memfit.estimate(_net, batch_size=2)


def test_unpack_workload_returns_the_three_functions_either_way() -> None:
    assert unpack_workload(WORK, None, None, call="f") == (_net, _batch, _loss)
    assert unpack_workload(_net, _batch, None, call="f") == (_net, _batch, None)
    no_loss = Workload(_net, _batch)
    assert unpack_workload(no_loss, None, None, call="f") == (_net, _batch, None)
