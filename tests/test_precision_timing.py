"""``precision="auto"`` timed on the model's own first micro-batch.

Every verdict is made from injected numbers: the probe's ratio (``assumed_speed``) and the
model's seconds per mode (``assumed_model_seconds``). The model still runs its timing
passes under the injected seconds, so the tests see everything those passes do (and that
training is bitwise as if they had not run), but never what they measured.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.cli.main import main
from memfit.engine.auto import timed_choice
from memfit.errors import ConfigError
from memfit.models import build_model
from memfit.monitor.monitor import MonitorConfig
from memfit.precision.mode_timing import time_modes
from memfit.precision.speed import (
    PrecisionChoice,
    assumed_model_seconds,
    assumed_speed,
    choose_from_model,
    probe_settles,
)
from tests.engine_cases import assert_bitwise

pytestmark = pytest.mark.usefixtures("one_thread")

FAST_BF16 = {torch.bfloat16: 2.7}  # the probe: bf16 matmul much faster
BF16_SLOWER = {"fp32": 1.0, "bf16-mixed": 1.3}  # the model: slower in bf16
BF16_FASTER = {"fp32": 1.0, "bf16-mixed": 0.5}


def _net() -> nn.Sequential:
    """Dropout (the RNG), BatchNorm (buffers the forward changes), a LayerNorm island."""
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    )


def _batch(i: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _engine(precision: str, **kw) -> memfit.Engine:
    torch.manual_seed(0)
    model = _net()
    monitor = MonitorConfig(activation_every=1, activation_units=["1", "5"])
    return memfit.Engine(
        model, torch.optim.AdamW(model.parameters()), precision=precision, monitor=monitor, **kw
    )


def _train(engine: memfit.Engine, steps: int = 3) -> list[torch.Tensor]:
    return [engine.train_step(_batch(i), _loss) for i in range(steps)]


def _state(engine: memfit.Engine) -> dict:
    return {
        "model": engine.model.state_dict(),  # the buffers: running stats, num_batches_tracked
        "optimizer": engine.optimizer.state_dict()["state"],
        "rng": torch.get_rng_state(),
        "ranges": engine.monitor.ranges.read(reset=False),
    }


# ---------------------------------------------------------------- the choice from the model


def test_the_model_decides_against_the_probe_with_the_margin() -> None:
    probe = PrecisionChoice("bf16-mixed", {"fp32": 1.0, "bf16-mixed": 2.7}, True)
    assert choose_from_model(probe, BF16_SLOWER).mode == "fp32"
    assert choose_from_model(probe, {"fp32": 1.0, "bf16-mixed": 0.95}).mode == "fp32"  # 1.05x
    chosen = choose_from_model(probe, BF16_FASTER)
    assert chosen.mode == "bf16-mixed" and chosen.model_speedup == 2.0
    slow_probe = PrecisionChoice("fp32", {"fp32": 1.0, "bf16-mixed": 1.05}, True)
    assert choose_from_model(slow_probe, BF16_FASTER).mode == "bf16-mixed"
    fp16 = PrecisionChoice("fp32", {"fp32": 1.0, "fp16-mixed": 1.5}, True)
    assert choose_from_model(fp16, {"fp32": 3.0, "fp16-mixed": 2.0}).mode == "fp16-mixed"


def test_injected_model_seconds_that_cannot_decide_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="positive seconds per mode, got {'fp32': 0}"):
        with assumed_model_seconds("cpu", {"fp32": 0, "bf16-mixed": 1.0}):
            pass
    for empty_or_bool in ({}, {"fp32": True, "bf16-mixed": True}):
        with pytest.raises(ConfigError, match="positive seconds per mode"):
            with assumed_model_seconds("cpu", empty_or_bool):
                pass
    probe = PrecisionChoice("bf16-mixed", {"fp32": 1.0, "bf16-mixed": 2.7}, True)
    with pytest.raises(ConfigError, match=r"give none for \['bf16-mixed'\]"):
        choose_from_model(probe, {"fp32": 1.0, "fp16-mixed": 0.5})


def test_the_probe_settles_it_when_far_below_one_or_injected_alone() -> None:
    slow = PrecisionChoice("fp32", {"fp32": 1.0, "bf16-mixed": 0.21}, True)
    assert "0.21x, below 0.5x" in probe_settles(slow, "cpu")
    measured = PrecisionChoice("bf16-mixed", {"fp32": 1.0, "bf16-mixed": 2.7}, True)
    assert probe_settles(measured, "cpu") == ""
    assumed = PrecisionChoice("bf16-mixed", {"fp32": 1.0, "bf16-mixed": 2.7}, False)
    assert probe_settles(assumed, "cpu") == "the probe's speeds are assumed"
    with assumed_model_seconds("cpu", BF16_SLOWER):
        assert probe_settles(assumed, "cpu") == ""
        assert probe_settles(assumed, "cuda") == "the probe's speeds are assumed"


@pytest.mark.parametrize(("seconds", "mode"), [(BF16_SLOWER, "fp32"), (BF16_FASTER, "bf16-mixed")])
def test_engine_trains_in_the_mode_the_model_is_fastest_in(seconds, mode) -> None:
    engine = _engine("auto")
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", seconds):
        engine.train_step(_batch(0), _loss)
    choice = engine.auto.precision_choice
    assert engine.settings.precision == mode == choice.mode == engine.policy.mode
    assert choice.model_seconds == seconds and not choice.model_measured
    assert choice.timing_seconds > 0
    line = choice.describe()
    assert line.startswith(f"precision auto: {mode} (forward+backward of the first micro-batch")
    assert "assumed: fp32 1000.00 ms" in line and "matmul probe, assumed: bf16-mixed 2.70x" in line


def test_a_probe_far_below_one_chooses_fp32_without_running_the_model() -> None:
    calls = []

    def counted(model, batch):
        calls.append(1)
        return _loss(model, batch)

    engine = _engine("auto")
    with assumed_speed("cpu", {torch.bfloat16: 0.3}), assumed_model_seconds("cpu", BF16_FASTER):
        engine.train_step(_batch(0), counted)
    choice = engine.auto.precision_choice
    assert engine.settings.precision == "fp32" and choice.model_seconds == {}
    assert len(calls) == 1  # the training step's micro-batch only
    assert "model not timed: the bf16-mixed matmul runs at 0.30x, below 0.5x" in choice.describe()


def test_injected_probe_alone_decides_without_timing() -> None:
    calls = []

    def counted(model, batch):
        calls.append(1)
        return _loss(model, batch)

    engine = _engine("auto")
    with assumed_speed("cpu", FAST_BF16):
        engine.train_step(_batch(0), counted)
    assert engine.settings.precision == "bf16-mixed" and len(calls) == 1
    assert engine.auto.precision_choice.model_seconds == {}


def test_data_parallel_keeps_rank_zeros_probe() -> None:
    probe = PrecisionChoice("bf16-mixed", {"fp32": 1.0, "bf16-mixed": 2.7}, True)
    first = types.SimpleNamespace(data_parallel=True, device=torch.device("cpu"))

    def never(model, batch):  # noqa: ARG001
        raise AssertionError("the model must not be timed under DDP/FSDP2")

    with assumed_model_seconds("cpu", BF16_SLOWER):
        choice = timed_choice(first, probe, _batch(0), never)
    assert choice.mode == "bf16-mixed" and choice.model_seconds == {}
    assert "rank 0's probe" in choice.note


def test_a_model_with_lazy_modules_is_not_timed_and_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16), nn.GELU(), nn.Linear(16, 4))
    engine = memfit.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="auto")
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        engine.train_step(_batch(0), _loss)
        engine.train_step(_batch(1), _loss)
    choice = engine.auto.precision_choice
    assert choice.mode == "bf16-mixed" and "lazy modules" in choice.note  # the probe's
    assert model[0].weight.shape == (16, 8)


# ---------------------------------------------------------------- training is unchanged


@pytest.mark.parametrize(("seconds", "mode"), [(BF16_SLOWER, "fp32"), (BF16_FASTER, "bf16-mixed")])
def test_the_mode_chosen_trains_bitwise_as_given_by_hand(seconds, mode) -> None:
    timed = _engine("auto")
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", seconds):
        timed_losses = _train(timed)
    assert timed.settings.precision == mode
    by_hand = _engine(mode)
    hand_losses = _train(by_hand)
    assert_bitwise(timed_losses, hand_losses)
    assert_bitwise(_state(timed), _state(by_hand))
    assert timed.monitor.ranges.calls == by_hand.monitor.ranges.calls == 3
    assert timed.islands == by_hand.islands


def test_the_timing_restores_what_it_touches() -> None:
    engine = _engine("auto")
    model = engine.model
    before_params = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    calls = []

    def counted(model, batch):
        calls.append(batch[0].shape[0])
        return _loss(model, batch)

    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        engine.prepare(_batch(0, n=6), counted)
    assert len(calls) >= 4 and set(calls) == {6}  # warm-ups and a round, on the micro-batch
    assert engine.settings.precision == "fp32"
    assert all(p.grad is None for p in model.parameters())
    assert_bitwise(model.state_dict(), before_params)  # num_batches_tracked is 0 again
    assert_bitwise(torch.get_rng_state(), rng)
    assert hooks == [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]
    assert all("_memfit_island_forward" not in m.__dict__ for m in model.modules())
    assert engine.monitor.ranges.calls == 0 and engine.monitor.ranges.read() == {}
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert engine.optimizer.state_dict()["state"] == {}


def test_gradients_there_before_the_timing_are_kept() -> None:
    model = _net()
    grads = []
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
        grads.append(p.grad)
    policies = [memfit.PrecisionPolicy("fp32"), memfit.PrecisionPolicy("bf16-mixed")]
    times = time_modes(model, _batch(0), _loss, policies, torch.device("cpu"), rounds=1)
    assert set(times.seconds) == {"fp32", "bf16-mixed"} and times.rounds == 1
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g and bool((g == 0.5).all())


# ---------------------------------------------------------------- errors


def test_a_loss_that_raises_raises_as_in_the_first_step() -> None:
    def not_scalar(model, batch):
        return model(batch[0])

    for precision in ("fp32", "auto"):
        engine = _engine(precision)
        with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
            with pytest.raises(ConfigError, match="must return a scalar tensor, got \\(12, 4\\)"):
                engine.train_step(_batch(0), not_scalar)
    assert engine.settings.precision == "auto"  # not chosen: the next step tries again

    def broken(model, batch):
        raise ValueError("the user's own bug")

    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        with pytest.raises(ValueError, match="the user's own bug"):
            engine.train_step(_batch(0), broken)
        assert all(p.grad is None for p in engine.model.parameters())
        engine.train_step(_batch(0), _loss)
    assert engine.settings.precision == "fp32"


def test_out_of_memory_while_timing_falls_back_to_the_probe() -> None:
    calls = []

    def oom_once(model, batch):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("out of memory (injected)")
        return _loss(model, batch)

    engine = _engine("auto")
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        engine.train_step(_batch(0), oom_once)
    choice = engine.auto.precision_choice
    assert engine.settings.precision == "bf16-mixed" == choice.mode  # the probe's 2.7x
    assert choice.model_seconds == {} and len(calls) == 2
    assert "model not timed: out of memory" in choice.describe()
    assert engine.steps == 1


# ---------------------------------------------------------------- micro_batch, CLI


def test_micro_batch_auto_times_the_split_and_ranks_in_the_mode_chosen() -> None:
    cfg = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **cfg)
    sizes = []

    def seen(model, batch):
        sizes.append(batch.shape[0])
        return loss_fn(model, batch)

    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="auto",
        micro_batch="auto",
        memory_budget=2**30,
    )
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        engine.train_step(batch_fn(8, generator=0), seen)
    split = engine.auto.split_choice
    assert engine.settings.precision == "fp32" == split.precision
    assert engine.auto.precision_choice.model_seconds == BF16_SLOWER
    # Timed on a micro-batch of a split (the probe's mode's), then trained on the split chosen.
    assert len(sizes) > 1 and 8 % sizes[0] == 0 and sizes[-1] == split.micro_batch


def test_memfit_train_prints_what_the_model_measured(tmp_path, capsys) -> None:
    cfg = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)
    argv = [
        "train",
        *(f"--set={k}={v}" for k, v in cfg.items()),
        "--data=synthetic",
        "--steps=1",
        "--batch-size=4",
        "--eval-every=1",
        "--eval-batches=1",
        "--out",
        str(tmp_path / "run"),
    ]
    with assumed_speed("cpu", FAST_BF16), assumed_model_seconds("cpu", BF16_SLOWER):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "precision auto: fp32 (forward+backward of the first micro-batch, assumed" in out
    assert "fp32 1000.00 ms, bf16-mixed 1300.00 ms = 0.77x" in out
