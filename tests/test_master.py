"""fp32 master weights: casting, fp32 gradient accumulation, copies back, state, Engine use."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.errors import ConfigError
from memfit.precision import MasterWeights, PrecisionPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm)


def test_casts_the_model_and_points_the_optimizer_at_fp32_copies() -> None:
    model = _model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    master = MasterWeights(model, opt, torch.bfloat16, keep_fp32=_is_norm)

    assert master.names == ["0.weight", "0.bias", "3.weight", "3.bias"]
    for name, work, m in zip(master.names, master.working, master.masters):
        assert work is model.get_parameter(name)
        assert work.dtype is torch.bfloat16
        assert m.dtype is torch.float32 and m.requires_grad
        assert torch.equal(m, reference[name])  # the exact fp32 values, not the rounded ones
        assert torch.equal(work, reference[name].to(torch.bfloat16))
    # The island's weights stay fp32 and the optimizer updates them directly.
    opt_params = opt.param_groups[0]["params"]
    assert model[1].weight.dtype is torch.float32
    assert any(p is model[1].weight for p in opt_params)
    assert all(p.dtype is torch.float32 for p in opt_params)
    assert not any(p is w for p in opt_params for w in master.working)
    assert len(opt_params) == len(list(model.parameters()))


def test_grads_accumulate_in_fp32_and_low_precision_grads_are_freed() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    master = MasterWeights(model, opt, torch.bfloat16, keep_fp32=_is_norm)
    work, m = master.working[0], master.masters[0]
    seen: list[torch.Tensor] = []
    work.register_hook(lambda g: seen.append(g.detach().clone()))

    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean() * 1e-3
        loss.backward()
        assert work.grad is None  # freed into the master's fp32 grad
        assert m.grad is not None and m.grad.dtype is torch.float32
    assert all(s.dtype is torch.bfloat16 for s in seen)
    want = seen[0].float() + seen[1].float() + seen[2].float()
    assert torch.equal(m.grad, want)  # fp32 sum of the bf16 micro-batch gradients
    # Summing in bf16 would have rounded: the fp32 accumulation keeps the low bits.
    in_bf16 = (seen[0] + seen[1] + seen[2]).float()
    assert not torch.equal(m.grad, in_bf16)
    assert all(w.grad is None for w in master.working)


def test_copy_to_model_rounds_the_masters() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    master = MasterWeights(model, opt, torch.bfloat16)
    with torch.no_grad():
        for m in master.masters:
            m.add_(torch.randn_like(m) * 1e-3)
    master.copy_to_model()
    for w, m in zip(master.working, master.masters):
        assert w.dtype is torch.bfloat16
        assert torch.equal(w, m.to(torch.bfloat16))


def test_small_updates_accumulate_in_the_master() -> None:
    # 1 + 1e-4 rounds back to 1 in bf16; a hundred such updates still move the master.
    w = nn.Parameter(torch.ones(4))
    model = nn.ParameterList([w])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    master = MasterWeights(model, opt, torch.bfloat16)
    for _ in range(100):
        master.masters[0].grad = -torch.ones(4)
        opt.step()
        master.copy_to_model()
        opt.zero_grad()
    assert torch.allclose(master.masters[0], torch.full((4,), 1.01), atol=1e-5)
    assert torch.equal(model[0], torch.full((4,), 1.0078125, dtype=torch.bfloat16))


def test_existing_optimizer_state_moves_to_the_master() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = {id(opt.state[p]["exp_avg"]) for p in model.parameters()}
    master = MasterWeights(model, opt, torch.bfloat16, keep_fp32=_is_norm)
    for m in master.masters:
        assert m in opt.state
        assert id(opt.state[m]["exp_avg"]) in before
    assert not any(w in opt.state for w in master.working)


def test_frozen_parameters_are_cast_but_not_mastered() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    master = MasterWeights(model, opt, torch.float16, keep_fp32=_is_norm)
    assert "0.weight" not in master.names
    assert model[0].weight.dtype is torch.float16


def test_state_dict_round_trip_and_errors() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    master = MasterWeights(model, opt, torch.bfloat16)
    state = master.state_dict()
    assert set(state) == set(master.names)
    assert all(v.dtype is torch.float32 for v in state.values())

    other = _model(seed=5)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1)
    master2 = MasterWeights(other, opt2, torch.bfloat16)
    master2.load_state_dict(state)
    for w, m, ref in zip(master2.working, master2.masters, master.masters):
        assert torch.equal(m, ref)
        assert torch.equal(w, ref.to(torch.bfloat16))

    missing = dict(state)
    del missing["3.bias"]
    with pytest.raises(ConfigError, match="'3.bias'"):
        master2.load_state_dict(missing)
    wrong = dict(state)
    wrong["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ConfigError, match="shape"):
        master2.load_state_dict(wrong)


def test_refuses_a_second_wrap_and_foreign_tensors() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    MasterWeights(model, opt, torch.bfloat16)
    with pytest.raises(ConfigError, match="already holds memfit master weights"):
        MasterWeights(model, opt, torch.bfloat16)
    stranger = nn.Parameter(torch.zeros(3))
    opt2 = torch.optim.SGD([*_model().parameters(), stranger], lr=0.1)
    with pytest.raises(ConfigError, match="not parameters of the model"):
        MasterWeights(_model(), opt2, torch.bfloat16)


def test_remove_stops_accumulation() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    master = MasterWeights(model, opt, torch.bfloat16)
    master.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8)).float().sum().backward()
    assert all(m.grad is None for m in master.masters)
    assert all(w.grad is not None for w in master.working)


# --- in the Engine -------------------------------------------------------------------------


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master"])
@pytest.mark.parametrize("fused", [False, True])
def test_engine_keeps_working_weights_equal_to_the_rounded_masters(mode: str, fused: bool) -> None:
    model = _model()
    opt = torch.optim.Adam(
        model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False
    )
    checks: list[bool] = []

    def at_step(optimizer, args, kwargs) -> None:  # type: ignore[no-untyped-def]
        # Right before the update: no low-precision grads anywhere, fp32 grads on the masters.
        checks.append(all(w.grad is None for w in engine.master.working))
        checks.append(
            all(m.grad is not None and m.grad.dtype is torch.float32 for m in engine.master.masters)
        )

    opt.register_step_pre_hook(at_step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fp16 matmul is very slow")
        engine = memfit.Engine(model, opt, precision=mode, accumulation_steps=2)
    dtype = PrecisionPolicy(mode).compute_dtype
    for step in range(5):
        engine.train_step(_batch(step), _loss)
        for w, m in zip(engine.master.working, engine.master.masters):
            assert w.dtype is dtype
            assert torch.equal(w, m.detach().to(dtype)), (step, w)
            assert w.grad is None
        for state in opt.state.values():
            assert state["exp_avg"].dtype is torch.float32
            assert state["exp_avg_sq"].dtype is torch.float32
    assert checks and all(checks)
    assert engine.applied_steps == 5
    assert len(opt.state) == len(list(model.parameters()))
    assert all(p.dtype is torch.float32 for p in engine.params)


def test_parameters_anywhere_inside_an_island_stay_fp32_and_unmastered() -> None:
    class Island(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.gain = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * self.gain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Island(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy = PrecisionPolicy("bf16-master", fp32_islands=(Island,))
    engine = memfit.Engine(model, opt, policy)
    assert engine.master.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in ("1.gain", "1.inner.weight", "1.inner.bias"):
        param = model.get_parameter(name)
        assert param.dtype is torch.float32
        assert any(p is param for p in engine.params)  # updated in place, no copy
    before = model[1].inner.weight.detach().clone()
    engine.train_step(_batch(0), _loss)
    assert not torch.equal(model[1].inner.weight, before)
    for w, m in zip(engine.master.working, engine.master.masters):
        assert torch.equal(w, m.detach().to(torch.bfloat16))
