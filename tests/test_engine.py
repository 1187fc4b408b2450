"""Engine: skipped steps, accumulation, resume, atomic and checked checkpoints, clipping, errors."""

from __future__ import annotations

import copy
import io
import math
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import Batch
from engine_cases import assert_bitwise as _assert_bitwise
from engine_cases import batch as _batch
from engine_cases import inf_loss as _inf_loss
from engine_cases import loss as _loss
from engine_cases import net as _net
from engine_cases import noisy_loss as _noisy_loss
from torch import nn

import memfit
from memfit.engine import Engine, batch_size, split_batch
from memfit.errors import ConfigError, NonFiniteError, StateFileError
from memfit.precision import MODES, LossScaler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _quiet_fp16() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fp16 matmul is very slow")
        yield


# --- helpers --------------------------------------------------------------------------------


def _optimizer(model: nn.Module, fused: bool, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if fused:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)


def _build(
    mode: str,
    fused: bool = False,
    seed: int = 0,
    dropout: float = 0.0,
    kind: str = "adamw",
    scheduler: bool = True,
    **kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer, Any, Engine]:
    torch.manual_seed(seed)
    model = _net(dropout)
    opt = _optimizer(model, fused, kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if scheduler else None
    engine = Engine(model, opt, precision=mode, lr_scheduler=sched, **kwargs)
    return model, opt, sched, engine


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _snapshot(engine: Engine) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in engine.model.state_dict().items()},
        "master": engine.master.state_dict() if engine.master is not None else None,
        "optimizer": _clone(engine.optimizer.state_dict()),
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "scheduler": _clone(engine.lr_scheduler.state_dict()) if engine.lr_scheduler else None,
    }


def _grads_at_step(opt: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Record the (unscaled, about to be applied) gradients each time the optimizer steps."""
    record: list[list[torch.Tensor]] = []

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        record.append(
            [p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]]
        )

    opt.register_step_pre_hook(hook)
    return record


# --- skipped steps --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-False", "fused"])
@pytest.mark.parametrize("inject", ["loss", "grad"])
def test_skipped_step_changes_nothing(mode: str, fused: bool, inject: str) -> None:
    accumulation = 1 if mode == "bf16-sr" else 2  # bf16-sr sums no micro-batches in bf16
    model, opt, sched, engine = _build(mode, fused, dropout=0.1, accumulation_steps=accumulation)
    poison = {"on": False}

    def nan_into_one_grad(grad: torch.Tensor) -> torch.Tensor:
        if not poison["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[3] = float("nan")
        return grad

    model[4].weight.register_hook(nan_into_one_grad)
    for i in range(3):
        engine.train_step(_batch(i), _loss)
    before = _snapshot(engine)
    applied, skipped = engine.applied_steps, engine.scaler.stats.skipped
    assert applied == 3 and skipped == 0

    if inject == "loss":
        loss = engine.train_step(_batch(3), _inf_loss)
        assert not torch.isfinite(loss)
    else:
        poison["on"] = True
        engine.train_step(_batch(3), _loss)
        poison["on"] = False

    _assert_bitwise(_snapshot(engine), before)
    assert engine.applied_steps == applied
    assert engine.scaler.stats.skipped == skipped + 1
    assert engine.scaler.stats.consecutive_skips == 1
    assert engine.steps == 4
    if engine.master is not None:
        for w, m in zip(engine.master.working, engine.master.masters):
            assert torch.equal(w, m.detach().to(w.dtype))
    assert all(p.grad is None for p in model.parameters())

    # The next clean step is applied: weights, optimizer state and schedule move again.
    engine.train_step(_batch(4), _loss)
    assert engine.applied_steps == applied + 1
    assert engine.scaler.stats.consecutive_skips == 0
    after = _snapshot(engine)
    assert not torch.equal(after["model"]["4.weight"], before["model"]["4.weight"])
    assert after["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] + 1
    assert after["lr"][0] < before["lr"][0]


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-master"])
@pytest.mark.parametrize("kind", ["adamw-fused", "adamw", "sgd-momentum-fused"])
def test_skipping_the_very_first_step_is_as_if_it_never_happened(mode: str, kind: str) -> None:
    # fp16's first steps often overflow, before the optimizer has created any state.
    def run(first_skipped: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = _net()
        if kind == "sgd-momentum-fused":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                model.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True
            )
        else:
            opt = _optimizer(model, fused=kind == "adamw-fused")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        # A static scale, so that the skip changes nothing in the scaler's arithmetic either.
        scaler = LossScaler(init_scale=2.0**8, dynamic=False)
        engine = Engine(model, opt, precision=mode, lr_scheduler=sched, scaler=scaler)
        if first_skipped:
            engine.train_step(_batch(0), _inf_loss)
        for i in range(1, 4):
            engine.train_step(_batch(i), _loss)
        assert engine.applied_steps == 3
        return _snapshot(engine)

    _assert_bitwise(run(first_skipped=True), run(first_skipped=False))


def test_skip_counters_without_a_scheduler() -> None:
    _, _, _, engine = _build("bf16-mixed", scheduler=False)
    for _ in range(2):
        engine.train_step(_batch(0), _inf_loss)
    engine.train_step(_batch(1), _loss)
    assert (engine.steps, engine.applied_steps) == (3, 1)
    stats = engine.scaler.stats
    assert (stats.steps, stats.skipped, stats.consecutive_skips) == (3, 2, 0)


# --- accumulation ---------------------------------------------------------------------------


def _reference_grads(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    model.zero_grad()
    _loss(model, batch).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    # Relative to the tensor's own scale, so near-zero elements do not dominate.
    scale = b.abs().max().clamp_min(1e-12)
    assert (a - b).abs().max() <= rtol * scale, ((a - b).abs().max() / scale, rtol)


@pytest.mark.parametrize(("n", "k"), [(12, 3), (12, 4), (10, 3), (10, 4), (7, 7)])
def test_accumulation_equals_one_big_batch_fp32(n: int, k: int) -> None:
    batch = _batch(0, n)
    grads = {}
    for steps in (1, k):
        model, opt, _, engine = _build(
            "fp32", kind="sgd", scheduler=False, accumulation_steps=steps
        )
        record = _grads_at_step(opt)
        engine.train_step(batch, _loss)
        grads[steps] = record[0]
    torch.manual_seed(0)
    reference = _reference_grads(_net(), batch)
    for one, many, ref in zip(grads[1], grads[k], reference):
        _close(many, one, 1e-6)
        _close(many, ref, 1e-6)


def test_unequal_micro_batches_are_weighted_by_size() -> None:
    # 10 samples in 3 micro-batches of 4, 3, 3: an unweighted mean of the three losses would
    # give a different gradient from the full batch's.
    batch = _batch(0, 10)
    model, opt, _, engine = _build("fp32", kind="sgd", scheduler=False, accumulation_steps=3)
    record = _grads_at_step(opt)
    losses = []
    engine.train_step(batch, lambda m, b: losses.append(len(b[0])) or _loss(m, b))
    assert losses == [4, 3, 3]
    torch.manual_seed(0)
    ref_model = _net()
    reference = _reference_grads(ref_model, batch)
    for got, ref in zip(record[0], reference):
        _close(got, ref, 1e-6)
    # The unweighted mean is measurably different on this data.
    ref_model.zero_grad()
    sum(_loss(ref_model, mb) / 3 for mb in split_batch(batch, 3)).backward()
    unweighted = [p.grad for p in ref_model.parameters()]
    assert max((u - r).abs().max() for u, r in zip(unweighted, reference)) > 1e-3


def test_returned_loss_is_the_batch_mean() -> None:
    batch = _batch(0, 10)
    torch.manual_seed(0)
    expected = _loss(_net(), batch)
    _, _, _, engine = _build("fp32", kind="sgd", scheduler=False, accumulation_steps=3)
    loss = engine.train_step(batch, _loss)
    assert loss.dim() == 0 and not loss.requires_grad
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("n", "k"), [(12, 3), (10, 3)])
def test_accumulation_in_bf16_master_is_fp32(n: int, k: int) -> None:
    batch = _batch(0, n)
    grads = {}
    per_micro: list[torch.Tensor] = []
    for steps in (1, k):
        model, opt, _, engine = _build(
            "bf16-master", kind="sgd", scheduler=False, accumulation_steps=steps
        )
        record = _grads_at_step(opt)
        if steps == k:
            # The bf16 gradient of each micro-batch, as autograd hands it over.
            model[0].weight.register_hook(lambda g: per_micro.append(g.detach().clone()))
        engine.train_step(batch, _loss)
        grads[steps] = record[0]
        names = engine.master.names
    assert len(per_micro) == k and all(g.dtype is torch.bfloat16 for g in per_micro)
    assert all(g.dtype is torch.float32 for g in grads[k])
    # Exactly the fp32 sum of the micro-batch gradients: no rounding to bf16 in between;
    # micro-batches of unequal sizes (4, 3, 3) are weighted by size / (k * 4) and the sum
    # rescaled once to the step's total (memfit.engine.feed).
    index = names.index("0.weight")
    fp32_sum = per_micro[0].float()
    for g in per_micro[1:]:
        fp32_sum = fp32_sum + g.float()
    reference = k * -(-n // k)
    expected = fp32_sum if reference == n else fp32_sum * (reference / n)
    assert torch.equal(grads[k][index], expected)
    # And the same update as one batch of n, within bf16's precision.
    torch.manual_seed(0)
    reference = _reference_grads(_net(), batch)
    for one, many, ref in zip(grads[1], grads[k], reference):
        _close(many, one, 3e-2)
        _close(many, ref, 3e-2)


def test_scale_is_fixed_within_an_accumulation_window() -> None:
    scaler = LossScaler(init_scale=2.0**10, growth_interval=1)
    _, _, _, engine = _build(
        "fp16-mixed", kind="sgd", scheduler=False, accumulation_steps=3, scaler=scaler
    )
    seen: list[float] = []
    original = scaler.scale

    def recording_scale(loss: torch.Tensor) -> torch.Tensor:
        out = original(loss)
        seen.append(scaler.get_scale())
        return out

    scaler.scale = recording_scale  # type: ignore[method-assign]
    engine.train_step(_batch(0), _loss)
    engine.train_step(_batch(1), _loss)
    calls = {"n": 0}

    def overflow_in_the_middle(model: nn.Module, batch: Batch) -> torch.Tensor:
        calls["n"] += 1
        return _inf_loss(model, batch) if calls["n"] == 2 else _loss(model, batch)

    engine.train_step(_batch(2), overflow_in_the_middle)
    engine.train_step(_batch(3), _loss)
    assert seen == [1024.0] * 3 + [2048.0] * 3 + [4096.0] * 3 + [2048.0] * 3
    assert engine.applied_steps == 3


# --- save and resume ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master", "fp16-mixed"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-False", "fused"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, mode: str, fused: bool
) -> None:
    n, m = 3, 4
    kwargs = dict(dropout=0.25, accumulation_steps=2, clip_grad_norm=0.5, log_every=2)
    random.seed(7)
    _, _, _, engine = _build(mode, fused, seed=0, **kwargs)
    for i in range(n):
        engine.train_step(_batch(i), _noisy_loss if i != 1 else _inf_loss)  # one skip
    path = engine.save(tmp_path / "ckpt.pt", extra={"epoch": 2, "note": "mid"})
    losses = [engine.train_step(_batch(i), _noisy_loss) for i in range(n, n + m)]
    want = _snapshot(engine)

    # A different process state: other seeds, other RNG draws, fresh objects.
    random.seed(99)
    torch.manual_seed(99)
    torch.rand(17)
    model2 = _net(0.25)
    opt2 = _optimizer(model2, fused)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.9)
    resumed = Engine.resume(path, model2, opt2, lr_scheduler=sched2)
    assert resumed.settings == engine.settings
    assert resumed.extra == {"epoch": 2, "note": "mid"}
    assert (resumed.steps, resumed.applied_steps) == (n, n - 1)
    resumed_losses = [resumed.train_step(_batch(i), _noisy_loss) for i in range(n, n + m)]

    for a, b in zip(losses, resumed_losses):
        assert torch.equal(a, b)
    _assert_bitwise(_snapshot(resumed), want)
    _assert_bitwise(resumed.scaler.state_dict(), engine.scaler.state_dict())
    assert (resumed.steps, resumed.micro_steps, resumed.applied_steps) == (
        engine.steps,
        engine.micro_steps,
        engine.applied_steps,
    )
    assert resumed.metrics.keys() == engine.metrics.keys()


def test_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    _, _, _, engine = _build("bf16-master", dropout=0.1)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "ckpt.pt")
    record = torch.load(path, weights_only=True)
    payload = record["payload"]
    assert {"settings", "model", "master", "optimizer", "scaler", "rng", "counters"} <= set(payload)
    assert payload["settings"]["precision"] == "bf16-master"
    assert payload["model"]["0.weight"].dtype is torch.bfloat16
    assert payload["master"]["0.weight"].dtype is torch.float32
    assert payload["counters"] == {"steps": 1, "micro_steps": 1, "applied_steps": 1}


def test_resume_overrides_settings(tmp_path: Path) -> None:
    _, _, _, engine = _build("fp32", accumulation_steps=2)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "c.pt")
    model = _net()
    opt = _optimizer(model, False)
    resumed = Engine.resume(path, model, opt, log_every=5)
    assert resumed.settings.log_every == 5
    assert resumed.settings.accumulation_steps == 2


def test_resume_into_a_different_model_is_a_config_error(tmp_path: Path) -> None:
    _, _, _, engine = _build("fp32")
    path = engine.save(tmp_path / "c.pt")
    other = nn.Sequential(nn.Linear(8, 3))
    with pytest.raises(ConfigError, match="does not fit"):
        Engine.resume(path, other, torch.optim.SGD(other.parameters(), lr=0.1))


def _failing_save(written: int) -> Callable[..., None]:
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[:written])
        raise OSError("No space left on device")

    return save


def test_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, _, engine = _build("bf16-mixed", dropout=0.1)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "last.pt")
    before = path.read_bytes()
    engine.train_step(_batch(1), _loss)
    monkeypatch.setattr(torch, "save", _failing_save(2000))
    with pytest.raises(OSError, match="No space"):
        engine.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left
    model = _net(0.1)
    resumed = Engine.resume(path, model, _optimizer(model, False))
    assert resumed.steps == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "resave"])
def test_damaged_checkpoint_raises_and_the_previous_one_still_loads(
    tmp_path: Path, damage: str
) -> None:
    _, _, _, engine = _build("fp32", scheduler=False)
    engine.train_step(_batch(0), _loss)
    first = engine.save(tmp_path / "step1.pt")
    engine.train_step(_batch(1), _loss)
    second = engine.save(tmp_path / "step2.pt")
    weight = engine.model.state_dict()["0.weight"]
    data = bytearray(second.read_bytes())
    if damage == "truncate":
        second.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        start = data.find(weight.numpy().tobytes())
        assert start >= 0
        data[start + 9] ^= 0x01  # one bit of one weight
        second.write_bytes(bytes(data))
    else:
        record = torch.load(second, weights_only=True)
        record["payload"]["model"]["0.weight"][0, 0] += 1.0
        torch.save(record, second)  # well-formed, with the old digest

    model = _net()
    with pytest.raises(StateFileError) as info:
        Engine.resume(second, model, _optimizer(model, False))
    assert str(second) in str(info.value)

    model = _net()
    resumed = Engine.resume(first, model, _optimizer(model, False))
    assert resumed.steps == 1
    resumed.train_step(_batch(1), _loss)
    for k, v in engine.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


# --- persistent non-finite values -----------------------------------------------------------


def test_non_finite_loss_raises_after_max_consecutive_skips(tmp_path: Path) -> None:
    _, _, _, engine = _build("bf16-mixed", max_consecutive_skips=3)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "good.pt")
    engine.train_step(_batch(1), _inf_loss)
    engine.train_step(_batch(2), _inf_loss)
    engine.train_step(_batch(3), _loss)  # a clean step resets the count
    engine.train_step(_batch(4), _inf_loss)
    engine.train_step(_batch(5), _inf_loss)
    with pytest.raises(NonFiniteError) as info:
        engine.train_step(_batch(6), _inf_loss)
    message = str(info.value)
    assert "3 optimizer steps in a row" in message
    assert "loss" in message and "inf" in message
    assert "learning rate" in message or "inputs" in message  # a remedy
    assert isinstance(info.value, FloatingPointError) and isinstance(info.value, memfit.MemfitError)
    # The checkpoint saved before is still good.
    model = _net()
    resumed = Engine.resume(path, model, _optimizer(model, False))
    assert resumed.steps == 1
    assert torch.isfinite(resumed.train_step(_batch(1), _loss))


def _poison_grad(model: nn.Module, name: str) -> None:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    model.get_parameter(name).register_hook(hook)


@pytest.mark.parametrize("mode", ["fp32", "fp16-mixed", "bf16-master"])
def test_non_finite_gradient_names_the_parameter(mode: str) -> None:
    model, _, _, engine = _build(mode, max_consecutive_skips=2)
    _poison_grad(model, "4.weight")
    engine.train_step(_batch(0), _loss)
    with pytest.raises(NonFiniteError) as info:
        engine.train_step(_batch(1), _loss)
    message = str(info.value)
    assert "'4.weight'" in message
    assert "Remedy" in message and "clip_grad_norm" in message
    if mode == "fp16-mixed":
        assert "init_scale" in message


def test_non_finite_gradient_is_named_correctly_with_clipping() -> None:
    model, _, _, engine = _build("fp32", max_consecutive_skips=1, clip_grad_norm=1.0)
    _poison_grad(model, "4.weight")
    with pytest.raises(NonFiniteError) as info:
        engine.train_step(_batch(0), _loss)
    assert "'4.weight'" in str(info.value)


def test_non_finite_gradient_of_an_island_is_named_in_master_mode() -> None:
    model, _, _, engine = _build("bf16-master", max_consecutive_skips=1)
    _poison_grad(model, "1.weight")  # the LayerNorm: fp32, not mastered
    with pytest.raises(NonFiniteError) as info:
        engine.train_step(_batch(0), _loss)
    assert "'1.weight'" in str(info.value)


def test_training_can_continue_after_non_finite_error() -> None:
    _, _, _, engine = _build("fp32", max_consecutive_skips=1)
    with pytest.raises(NonFiniteError):
        engine.train_step(_batch(0), _inf_loss)
    engine.train_step(_batch(1), _loss)  # e.g. after lowering the learning rate
    assert engine.applied_steps == 1


def test_an_interrupted_step_leaves_no_stale_gradients() -> None:
    calls = {"n": 0}

    def out_of_memory_once(model: nn.Module, batch: Batch) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory")
        return _loss(model, batch)

    _, _, _, engine = _build("fp32", kind="sgd", scheduler=False, accumulation_steps=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.train_step(_batch(0), out_of_memory_once)
    engine.train_step(_batch(1), _loss)
    _, _, _, clean = _build("fp32", kind="sgd", scheduler=False, accumulation_steps=2)
    clean.train_step(_batch(1), _loss)
    _assert_bitwise(_snapshot(engine)["model"], _snapshot(clean)["model"])


# --- clipping -------------------------------------------------------------------------------


def test_reported_grad_norm_is_of_the_unscaled_gradients() -> None:
    scaler = LossScaler(init_scale=2.0**16, growth_interval=10_000)
    model, opt, _, engine = _build(
        "fp16-mixed", kind="sgd", scheduler=False, scaler=scaler, clip_grad_norm=1e9, log_every=1
    )
    reference_model = copy.deepcopy(model)
    record = _grads_at_step(opt)
    batch = _batch(0)
    engine.train_step(batch, _loss)
    independent = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.double()) for g in record[0]])
    ).item()
    assert engine.metrics["grad/norm"] == pytest.approx(independent, rel=1e-6)
    # The same gradients without any loss scale, from a plain fp16 autocast backward.
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(reference_model, batch)
    loss.backward()
    plain = torch.linalg.vector_norm(
        torch.stack(
            [torch.linalg.vector_norm(p.grad.double()) for p in reference_model.parameters()]
        )
    ).item()
    assert engine.metrics["grad/norm"] == pytest.approx(plain, rel=1e-2)
    assert engine.metrics["amp/scale"] == 2.0**16


def test_clipping_acts_on_unscaled_gradients() -> None:
    scaler = LossScaler(init_scale=2.0**16, growth_interval=10_000)
    model, _, _, engine = _build(
        "fp16-mixed", kind="sgd", scheduler=False, scaler=scaler, clip_grad_norm=0.01, log_every=1
    )
    engine.optimizer.param_groups[0]["lr"] = 1.0
    before = [p.detach().double().clone() for p in model.parameters()]
    engine.train_step(_batch(0), _loss)
    assert engine.metrics["grad/norm"] > 0.1  # the pre-clip norm, well above the limit
    step = torch.linalg.vector_norm(
        torch.stack(
            [
                torch.linalg.vector_norm(p.detach().double() - b)
                for p, b in zip(model.parameters(), before)
            ]
        )
    ).item()
    # SGD with lr=1 moves the weights by exactly the clipped gradient: norm 0.01, not 0.01/scale.
    assert step == pytest.approx(0.01, rel=1e-3)


def test_metrics_are_read_every_log_every_steps() -> None:
    _, _, _, engine = _build("bf16-mixed", log_every=2, clip_grad_norm=1.0)
    engine.train_step(_batch(0), _loss)
    assert engine.metrics == {}
    engine.train_step(_batch(1), _loss)
    metrics = engine.metrics
    assert metrics["step"] == 2.0 and metrics["applied_steps"] == 2.0
    assert metrics["amp/scale"] == 1.0 and metrics["amp/overflow_rate"] == 0.0
    assert math.isfinite(metrics["loss"]) and metrics["grad/norm"] > 0
    assert metrics["lr"] == pytest.approx(1e-2 * 0.9**2)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.5])
def test_bad_accumulation_steps(bad: float) -> None:
    model = _net()
    with pytest.raises(ConfigError, match="accumulation_steps"):
        Engine(model, _optimizer(model, False), "fp32", accumulation_steps=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(clip_grad_norm=0.0),
        dict(clip_grad_norm=-1.0),
        dict(clip_grad_norm=math.inf),
        dict(clip_grad_norm=math.nan),
        dict(log_every=0),
        dict(max_consecutive_skips=0),
    ],
)
def test_bad_engine_settings(kwargs: dict) -> None:
    model = _net()
    with pytest.raises(ConfigError):
        Engine(model, _optimizer(model, False), "fp32", **kwargs)


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda m, b: m(b[0]).float().mean(dim=1), "scalar"),
        (lambda m, b: m(b[0]).float(), "scalar"),
        (lambda m, b: 1.5, "scalar tensor, got float"),
        (lambda m, b: _loss(m, b).detach(), "does not require grad"),
        (lambda m, b: torch.tensor(1.0), "does not require grad"),
    ],
)
def test_bad_loss_fn(loss_fn: Callable, match: str) -> None:
    _, _, _, engine = _build("bf16-mixed", accumulation_steps=2)
    with pytest.raises(ConfigError, match=match):
        engine.train_step(_batch(0), loss_fn)


def test_a_loss_computed_under_no_grad_is_refused() -> None:
    _, _, _, engine = _build("fp32")

    def under_no_grad(model: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return _loss(model, batch)

    with pytest.raises(ConfigError, match="no_grad"):
        engine.train_step(_batch(0), under_no_grad)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ((torch.randn(8, 8), torch.randn(6, 4)), "disagree"),
        ({"x": torch.randn(8, 8), "y": torch.randn(7, 4)}, "disagree"),
        (torch.tensor(3.0), "scalar"),
        (("a", 1), "no tensor"),
        (5, "no tensor"),
    ],
)
def test_bad_batches(batch: Any, match: str) -> None:
    _, _, _, engine = _build("fp32", accumulation_steps=2)
    with pytest.raises(ConfigError, match=match):
        engine.train_step(batch, _loss)


def test_named_tuple_batches_are_split() -> None:
    from typing import NamedTuple

    class Pair(NamedTuple):
        x: torch.Tensor
        y: torch.Tensor

    x, y = _batch(0, 10)
    parts = split_batch(Pair(x, y), 3)
    assert all(isinstance(p, Pair) for p in parts)
    assert torch.equal(torch.cat([p.y for p in parts]), y)


def test_split_batch_shapes() -> None:
    x, y = torch.arange(10).reshape(10, 1), torch.arange(10)
    parts = split_batch({"x": x, "y": y, "tag": "t"}, 3)
    assert [len(p["x"]) for p in parts] == [4, 3, 3]
    assert all(p["tag"] == "t" for p in parts)
    assert torch.equal(torch.cat([p["y"] for p in parts]), y)
    lists = split_batch([x, y, 7], 2)
    assert all(isinstance(p, list) and p[2] == 7 and len(p[0]) == 5 for p in lists)
    tuples = split_batch((x, (y, y)), 5)
    assert all(isinstance(p, tuple) and len(p[1][0]) == 2 for p in tuples)
    assert split_batch(x, 1)[0] is x
    assert batch_size({"a": [x, {"b": y}]}) == 10


def test_a_batch_whose_tensors_disagree_on_dim_0_is_refused_with_the_shapes_and_a_remedy() -> None:
    # A recommender's bags as (tables, n, ids): the samples are not along dim 0.
    batch = {"dense": torch.zeros(16, 13), "bags": torch.zeros(8, 16, 4, dtype=torch.long)}
    with pytest.raises(ConfigError) as info:
        batch_size(batch)
    message = str(info.value)
    assert "[8, 16]" in message and "(8, 16, 4)" in message
    assert "samples along dim 0" in message and "not a tensor" in message


def test_split_batch_keeps_containers_and_gives_non_tensors_to_every_part() -> None:
    import collections
    import dataclasses as dc

    from memfit.engine import split_batch

    Pair = collections.namedtuple("Pair", "x y")

    @dc.dataclass
    class Batch:
        ids: torch.Tensor
        name: str

    x = torch.arange(8).reshape(4, 2)
    parts = split_batch({"p": Pair(x, x[:, 0]), "b": Batch(x, "s"), "lr": 0.5}, 2)
    assert [type(p["p"]) for p in parts] == [Pair, Pair]
    assert torch.equal(parts[1]["p"].x, x[2:]) and torch.equal(parts[1]["p"].y, x[2:, 0])
    assert type(parts[0]["b"]) is Batch and torch.equal(parts[0]["b"].ids, x[:2])
    assert parts[0]["b"].name == "s" and [p["lr"] for p in parts] == [0.5, 0.5]
    user = collections.UserDict({"input_ids": x})  # Hugging Face's BatchEncoding is one
    assert [p["input_ids"].shape[0] for p in split_batch(user, 4)] == [1, 1, 1, 1]


def test_planning_leaves_no_gradient_behind_in_the_master_modes() -> None:
    # Planning runs backward passes; in bf16-master their gradients land in the fp32
    # masters' buffers. The first step with a plan must equal the first without one.
    import copy

    from memfit.models import build_model

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=32
    )
    twin = copy.deepcopy(model)
    batch = batch_fn(4, generator=0)
    engines = [
        Engine(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="bf16-master", checkpoint=c)
        for m, c in ((model, "full"), (twin, "none"))
    ]
    for engine in engines:
        engine.train_step(batch, loss_fn)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_a_failed_planning_is_tried_again_not_skipped() -> None:
    from memfit.errors import BudgetError
    from memfit.models import build_model

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=32
    )
    engine = Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        precision="fp32",
        checkpoint="auto",
        memory_budget="100KB",
    )
    for _ in range(2):  # the second try plans again and fails again: it never trains unplanned
        with pytest.raises(BudgetError):
            engine.train_step(batch_fn(4, generator=0), loss_fn)
    assert engine.plan is None and engine.steps == 0


def test_split_batch_opens_list_and_tuple_subclasses() -> None:
    from memfit.engine import split_batch

    class Pairs(list):  # a list subclass nobody registered with pytree
        pass

    x = torch.arange(8).reshape(4, 2)
    parts = split_batch(Pairs([x, x * 2]), 2)
    assert [type(p) for p in parts] == [Pairs, Pairs]
    assert torch.equal(parts[1][1], (x * 2)[2:])
