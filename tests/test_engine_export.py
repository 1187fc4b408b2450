"""Evaluation, export and loading: plain calls after training in every mode, eval_context,
evaluate, model_state_dict/export (fp32 masters), engine.load and resume onto live objects."""

from __future__ import annotations

import copy
import math
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_cases import Batch
from engine_cases import assert_bitwise as _assert_bitwise
from engine_cases import batch as _batch
from engine_cases import inf_loss as _inf_loss
from engine_cases import loss as _loss
from engine_cases import net as _net
from engine_cases import noisy_loss as _noisy_loss
from torch import nn

import memfit
from memfit.engine import Engine
from memfit.errors import ConfigError
from memfit.models import build_model
from memfit.precision import PrecisionPolicy, apply_precision, precision_applied, remove_precision

pytestmark = pytest.mark.usefixtures("one_thread")

#: A bf16 matmul keeps 8 significant bits (relative rounding 2**-9 per operand); through
#: a few layers the outputs of the 16-bit model stay within 3% of the largest output of an
#: fp32 model holding the same (master) weights. Measured: 0.5% for the GPT and the ResNet.
BF16_TOLERANCE = 0.03

GPT = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)
RESNET = dict(widths=(8, 16), blocks_per_stage=(1, 1))


@pytest.fixture(autouse=True)
def _quiet_fp16() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fp16 matmul is very slow")
        yield


# --- helpers --------------------------------------------------------------------------------


def _engine(mode: str, seed: int = 0, dropout: float = 0.25, **kwargs: Any) -> Engine:
    torch.manual_seed(seed)
    model = _net(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    sched = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        if kwargs.pop("scheduler", True)
        else None
    )
    return Engine(model, opt, precision=mode, lr_scheduler=sched, **kwargs)


def _snapshot(engine: Engine) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": engine.model.state_dict(),
            "master": engine.master.state_dict() if engine.master is not None else None,
            "optimizer": engine.optimizer.state_dict(),
            "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "scaler": engine.scaler.state_dict(),
            "counters": (engine.steps, engine.micro_steps, engine.applied_steps),
        }
    )


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).abs().max() / ref.abs().max())


def _train_builtin(name: str, mode: str, steps: int = 3) -> tuple[Engine, Any, Any]:
    torch.manual_seed(0)
    config = GPT if name == "gpt" else RESNET
    model, loss_fn, batch_fn = build_model(name, data="synthetic", **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = Engine(model, opt, precision=mode, log_every=10**6, monitor=False)
    for i in range(steps):
        engine.train_step(batch_fn(4, generator=i), loss_fn)
    return engine, loss_fn, batch_fn


def _inputs(name: str, batch: Any) -> torch.Tensor:
    return batch[:, :-1] if name == "gpt" else batch[0]  # token ids, or fp32 images


def _fresh_fp32(name: str, engine: Engine) -> nn.Module:
    config = GPT if name == "gpt" else RESNET
    fresh = build_model(name, data="synthetic", **config).model
    fresh.load_state_dict(engine.model_state_dict(), strict=True)
    return fresh.eval()


# --- fp32 islands and plain calls -----------------------------------------------------------


def test_an_island_returns_the_dtype_that_came_in() -> None:
    norm = nn.LayerNorm(8)
    apply_precision(norm, PrecisionPolicy("bf16-mixed"))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x.bfloat16()).dtype is torch.bfloat16
        assert norm(x).dtype is torch.float32
    out = norm(x.bfloat16())
    assert out.dtype is torch.bfloat16
    # Computed in fp32 and rounded once: the fp32 result rounded to bf16.
    want = F.layer_norm(x.bfloat16().float(), (8,), norm.weight, norm.bias).bfloat16()
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_a_bf16_master_model_answers_a_plain_call_like_its_fp32_masters(name: str) -> None:
    engine, _, batch_fn = _train_builtin(name, "bf16-master")
    x = _inputs(name, batch_fn(4, generator=99))
    ref = _fresh_fp32(name, engine)(x)
    model = engine.model
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()
    # fp32 images in, fp32 logits out; token ids in, the weights' bf16 out.
    assert out.dtype is (torch.float32 if name == "resnet" else torch.bfloat16)
    assert _relative_error(out, ref) < BF16_TOLERANCE
    model.train()
    with engine.eval_context():
        assert not model.training
        in_context = model(x)
    assert model.training
    assert torch.isfinite(in_context).all() and not in_context.requires_grad
    assert _relative_error(in_context, ref) < BF16_TOLERANCE


def test_a_plain_call_after_fp16_master_training_matches_the_masters() -> None:
    engine, _, batch_fn = _train_builtin("gpt", "fp16-master", steps=2)
    x = _inputs("gpt", batch_fn(4, generator=99))
    with torch.no_grad():
        out = engine.model.eval()(x)
    assert out.dtype is torch.float16
    # fp16 keeps 11 significant bits, so the bf16 tolerance holds with room to spare.
    assert _relative_error(out, _fresh_fp32("gpt", engine)(x)) < BF16_TOLERANCE


def test_plain_call_casts_are_off_under_autocast_and_removable() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    apply_precision(model, PrecisionPolicy("bf16-master"))
    x = torch.randn(2, 4)
    assert model(x).dtype is torch.float32  # cast in and back out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype is torch.bfloat16  # autocast decides, as in training
    remove_precision(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)  # bf16 weights, fp32 input: the plain call is the user's again


def test_precision_applied_leaves_no_input_cast_behind() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with precision_applied(model, PrecisionPolicy("bf16-master")):
        assert model[0].weight.dtype is torch.bfloat16
        assert model(torch.randn(2, 4)).dtype is torch.float32
    assert model[0].weight.dtype is torch.float32
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_hf_generate_after_bf16_master_training() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16-master")
    for i in range(2):
        ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(i))
        engine.train_step(ids, lambda m, b: m(input_ids=b, labels=b).loss)
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(engine.model_state_dict(), strict=True)
    with torch.no_grad():
        ref = fresh.eval()(prompt).logits
    with engine.eval_context():
        logits = model(prompt).logits
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert model.training
    assert _relative_error(logits, ref) < BF16_TOLERANCE
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 64
    # A plain call generates too, with the same greedy tokens (the same bf16 arithmetic).
    model.eval()
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(plain, out)


# --- model_state_dict and export ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master", "fp16-master"])
def test_model_state_dict_holds_the_masters_bitwise(mode: str) -> None:
    engine, _, batch_fn = _train_builtin("gpt", mode, steps=2)
    model = engine.model
    state = engine.model_state_dict()
    assert list(state) == list(model.state_dict())
    masters = dict(zip(engine.master.names, engine.master.masters)) if engine.master else {}
    assert bool(masters) == mode.endswith("-master")
    params = dict(model.named_parameters())
    for name, value in state.items():
        assert value.dtype is torch.float32 or not value.is_floating_point(), name
        assert value.is_contiguous() and not value.requires_grad, name
        want = masters.get(name, params.get(name))
        if want is not None:
            assert torch.equal(value, want.detach().float()), name
    # The tied head (lm_head.weight is tok_emb.weight) carries the master under both keys.
    assert torch.equal(state["lm_head.weight"], state["tok_emb.weight"])
    # Nothing shares storage with training: not the model, not the masters, not Adam.
    training = [*model.state_dict().values(), *masters.values()]
    training += [t for s in engine.optimizer.state.values() for t in s.values()]
    pointers = {t.untyped_storage().data_ptr() for t in training if isinstance(t, torch.Tensor)}
    assert not pointers & {t.untyped_storage().data_ptr() for t in state.values()}
    fresh = build_model("gpt", data="synthetic", **GPT).model
    fresh.load_state_dict(state, strict=True)
    x = _inputs("gpt", batch_fn(2, generator=7))
    with engine.eval_context():
        assert _relative_error(model(x), fresh.eval()(x)) < BF16_TOLERANCE


def test_model_state_dict_dtypes() -> None:
    engine, _, _ = _train_builtin("resnet", "bf16-master", steps=1)
    kept = engine.model_state_dict(dtype=None)
    working = engine.model.state_dict()
    masters = dict(zip(engine.master.names, engine.master.masters))
    for name, value in kept.items():
        want = torch.float32 if name in masters else working[name].dtype
        assert value.dtype is want, name
    assert any(v.dtype is torch.int64 for v in kept.values())  # BatchNorm's step counter
    half = engine.model_state_dict(dtype=torch.bfloat16)
    assert all(v.dtype is torch.bfloat16 for v in half.values() if v.is_floating_point())
    assert any(v.dtype is torch.int64 for v in half.values())


def test_keys_are_unchanged_by_a_checkpoint_plan_and_the_islands() -> None:
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **GPT)
    keys = list(model.state_dict())
    engine = Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        precision="bf16-master",
        checkpoint="full",
        monitor=False,
    )
    engine.train_step(batch_fn(4, generator=0), loss_fn)
    assert engine.plan is not None and memfit.checkpoint.apply.is_applied(model)
    assert list(engine.model_state_dict()) == keys
    fresh = build_model("gpt", data="synthetic", **GPT).model
    fresh.load_state_dict(engine.model_state_dict(), strict=True)
    # The planned model evaluates too: without gradients a plan runs its units plainly.
    x = _inputs("gpt", batch_fn(2, generator=3))
    with engine.eval_context():
        assert _relative_error(model(x), fresh.eval()(x)) < BF16_TOLERANCE


def test_export_writes_a_plain_state_dict(tmp_path: Path) -> None:
    engine, _, _ = _train_builtin("resnet", "bf16-master", steps=2)
    path = engine.export(tmp_path / "out" / "model.pt")
    assert path == tmp_path / "out" / "model.pt"
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temp file left
    loaded = torch.load(path, weights_only=True)
    _assert_bitwise(loaded, engine.model_state_dict())
    for name, master in zip(engine.master.names, engine.master.masters):
        assert torch.equal(loaded[name], master.detach()), name
    fresh = build_model("resnet", data="synthetic", **RESNET).model
    fresh.load_state_dict(loaded, strict=True)


# --- evaluate -------------------------------------------------------------------------------


def test_evaluate_is_the_size_weighted_mean_loss() -> None:
    engine = _engine("fp32", dropout=0.5)
    engine.train_step(_batch(0), _loss)
    engine.model[3].eval()  # a module the user froze in eval mode stays so
    batches = [_batch(1, n=3), _batch(2, n=5)]
    seen: list[tuple[bool, bool]] = []

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        seen.append((model.training, torch.is_grad_enabled()))
        return _loss(model, batch)

    value = memfit.evaluate(engine, batches, loss_fn)
    model = copy.deepcopy(engine.model).eval()
    with torch.no_grad():
        want = (3 * _loss(model, batches[0]) + 5 * _loss(model, batches[1])) / 8
    assert value == pytest.approx(float(want), rel=1e-6)
    assert seen == [(False, False), (False, False)]
    assert engine.model.training and engine.model[0].training and not engine.model[3].training
    assert all(p.grad is None for p in engine.model.parameters())


def test_evaluate_runs_under_the_training_precision() -> None:
    engine = _engine("bf16-master")
    seen: list[tuple[bool, torch.dtype]] = []

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(batch[0])
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return F.mse_loss(out.float(), batch[1])

    assert math.isfinite(memfit.evaluate(engine, [_batch(0)], loss_fn))
    assert seen == [(True, torch.bfloat16)]


def test_evaluation_forwards_are_not_in_the_activation_ranges() -> None:
    engine = _engine("fp32", monitor=memfit.MonitorConfig(activation_every=1))
    ranges = engine.monitor.ranges
    assert ranges is not None
    engine.train_step(_batch(0), _loss)
    calls, recorded = ranges.calls, ranges.read(reset=False)
    big = (_batch(1)[0] * 1000, _batch(1)[1])  # would raise every maximum if recorded
    memfit.evaluate(engine, [big], _loss)
    assert ranges.calls == calls
    assert ranges.read(reset=False) == recorded


def test_evaluate_errors() -> None:
    engine = _engine("fp32")
    with pytest.raises(ConfigError, match="no batches"):
        memfit.evaluate(engine, [], _loss)
    with pytest.raises(ConfigError, match="scalar"):
        memfit.evaluate(engine, [_batch(0)], lambda m, b: m(b[0]))
    assert engine.model.training  # restored after the failure too


# --- load and resume ------------------------------------------------------------------------


def _run(engine: Engine, start: int, n: int) -> list[torch.Tensor]:
    return [
        engine.train_step(_batch(i), _inf_loss if i == 1 else _noisy_loss)
        for i in range(start, start + n)
    ]


SETTINGS = dict(accumulation_steps=2, clip_grad_norm=0.5, log_every=2)


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"])
def test_load_into_the_live_engine_is_bitwise_like_the_saved_run(tmp_path: Path, mode: str) -> None:
    n, m = 3, 3
    random.seed(7)
    engine = _engine(mode, **SETTINGS)
    _run(engine, 0, n)  # step 1 is skipped
    path = engine.save(tmp_path / "ckpt.pt", extra={"epoch": 1})
    losses = _run(engine, n, m)
    want = _snapshot(engine)

    random.seed(99)  # another process state, which load must replace
    torch.manual_seed(99)
    engine.extra = {}
    engine.load(path)
    assert (engine.steps, engine.applied_steps, engine.extra) == (n, n - 1, {"epoch": 1})
    again = _run(engine, n, m)
    for a, b in zip(losses, again):
        assert torch.equal(a, b)
    _assert_bitwise(_snapshot(engine), want)

    # A second Engine made the same way and loaded continues identically too.
    other = _engine(mode, seed=5, **SETTINGS)
    other.load(path)
    _run(other, n, m)
    _assert_bitwise(_snapshot(other), want)


def test_load_keeps_the_live_plan_and_the_values(tmp_path: Path) -> None:
    random.seed(3)
    engine = _engine("bf16-master")
    _run(engine, 0, 2)
    path = engine.save(tmp_path / "ckpt.pt")
    _run(engine, 2, 2)
    want = _snapshot(engine)
    planned = _engine("bf16-master", checkpoint="full")
    planned.train_step(_batch(0), _loss)  # makes and applies its plan
    plan = planned.plan
    planned.load(path)
    assert planned.plan is plan and memfit.checkpoint.apply.is_applied(planned.model)
    _run(planned, 2, 2)
    # Recomputing changes no value: the continuation is the saved run's, bitwise.
    _assert_bitwise(
        {k: v for k, v in _snapshot(planned).items() if k != "counters"},
        {k: v for k, v in want.items() if k != "counters"},
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16-mixed"}, "precision='fp32'"),
        ({"accumulation_steps": 3}, "accumulation_steps=1"),
    ],
)
def test_load_refuses_conflicting_settings(tmp_path: Path, kwargs: dict, match: str) -> None:
    path = _engine("fp32").save(tmp_path / "ckpt.pt")
    engine = _engine(kwargs.pop("precision", "fp32"), **kwargs)
    before = _snapshot(engine)
    with pytest.raises(ConfigError, match=match):
        engine.load(path)
    _assert_bitwise(_snapshot(engine), before)  # refused before anything changed


def test_resume_with_a_precision_that_keeps_no_masters_is_a_config_error(tmp_path: Path) -> None:
    path = _engine("bf16-master").save(tmp_path / "ckpt.pt")
    model = _net()
    with pytest.raises(ConfigError, match="precision='bf16-master'.*master"):
        Engine.resume(path, model, torch.optim.AdamW(model.parameters()), precision="fp32")


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master"])
def test_resume_onto_the_live_objects_points_to_load(tmp_path: Path, mode: str) -> None:
    engine = _engine(mode)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "ckpt.pt")
    with pytest.raises(ConfigError, match=r"engine\.load\(path\)"):
        Engine.resume(path, engine.model, engine.optimizer, lr_scheduler=engine.lr_scheduler)


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed"])
def test_resume_onto_the_live_objects_continues_exactly(tmp_path: Path, mode: str) -> None:
    random.seed(1)
    engine = _engine(mode, **SETTINGS)
    _run(engine, 0, 2)
    path = engine.save(tmp_path / "ckpt.pt")
    _run(engine, 2, 2)
    want = _snapshot(engine)
    engine.close()
    resumed = Engine.resume(path, engine.model, engine.optimizer, lr_scheduler=engine.lr_scheduler)
    _run(resumed, 2, 2)
    _assert_bitwise(_snapshot(resumed), want)


@pytest.mark.parametrize("saved", ["none", "full"])
@pytest.mark.parametrize("override", ["none", "full"])
def test_resume_takes_a_checkpoint_override(tmp_path: Path, saved: str, override: str) -> None:
    engine = _engine("fp32", checkpoint=saved, scheduler=False)
    engine.train_step(_batch(0), _loss)
    path = engine.save(tmp_path / "ckpt.pt")
    model = _net(0.25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = Engine.resume(path, model, opt, checkpoint=override)
    assert resumed.settings.checkpoint == override
    resumed.train_step(_batch(1), _loss)
    assert (resumed.plan is not None) == (override == "full")
    assert resumed.steps == 2


def test_resume_with_another_budget_plans_again(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(0)
        return build_model("gpt", data="synthetic", **GPT)

    model, loss_fn, batch_fn = build()
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp32",
        checkpoint="full",
        log_every=10**9,
    )
    engine.train_step(batch_fn(4, generator=0), loss_fn)
    path = engine.save(tmp_path / "a.pt")
    # The saved plan was made without a budget: with one, the run is planned again.
    fresh, _, _ = build()
    with pytest.warns(UserWarning, match="planned again"):
        resumed = Engine.resume(
            path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), memory_budget="1GiB"
        )
    resumed.train_step(batch_fn(4, generator=1), loss_fn)
    assert resumed.plan is not None and resumed.plan.budget_bytes == 2**30
    # The same settings keep the saved plan, silently.
    again, _, _ = build()
    kept = Engine.resume(path, again, torch.optim.SGD(again.parameters(), lr=0.1))
    assert kept.prepare(batch_fn(4, generator=1), loss_fn).decisions == engine.plan.decisions
    # A plan given by hand cannot be planned again: say what to pass.
    hand, _, _ = build()
    given = Engine(
        hand,
        torch.optim.SGD(hand.parameters(), lr=0.1),
        precision="fp32",
        checkpoint=engine.plan,
        log_every=10**9,
    )
    hand_path = given.save(tmp_path / "b.pt")
    other, _, _ = build()
    with pytest.raises(ConfigError, match="pass checkpoint="):
        Engine.resume(
            hand_path, other, torch.optim.SGD(other.parameters(), lr=0.1), accumulation_steps=2
        )
