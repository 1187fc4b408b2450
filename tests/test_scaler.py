"""LossScaler: equivalence with torch.amp.GradScaler, hysteresis, bounds, state machine, syncs."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memfit.errors import ConfigError, ScalerStateError
from memfit.precision import LossScaler, ScalerStats

pytestmark = pytest.mark.usefixtures("one_thread")


X = torch.tensor([0.5, -1.25, 2.0, 0.75])


def _drive(scaler, param: nn.Parameter, opt: torch.optim.Optimizer, overflow: bool) -> None:
    """One step of the documented loop, with inf written into the grad on overflow steps."""
    loss = (param * X).sum()
    scaler.scale(loss).backward()
    if overflow:
        with torch.no_grad():
            param.grad[1] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _param() -> nn.Parameter:
    return nn.Parameter(torch.tensor([1.0, 2.0, -3.0, 0.5]))


def _scales(scaler: LossScaler, overflows: list[bool], fused: bool = False) -> list[float]:
    p = _param()
    opt = torch.optim.SGD([p], lr=1e-3, **({"fused": True} if fused else {"foreach": False}))
    out = []
    for overflow in overflows:
        _drive(scaler, p, opt, overflow)
        out.append(scaler.get_scale())
    return out


# --- equivalence with torch.amp.GradScaler --------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    init_scale=st.one_of(
        st.sampled_from([1.0, 2.0**10, 2.0**16, 65536.0 * 3]),
        st.floats(min_value=1.0, max_value=2.0**20, allow_nan=False, allow_infinity=False),
    ),
    growth_factor=st.one_of(
        st.sampled_from([2.0, 1.5, 4.0]), st.floats(min_value=1.001, max_value=8.0)
    ),
    backoff_factor=st.one_of(
        st.sampled_from([0.5, 0.25, 0.9]), st.floats(min_value=0.1, max_value=0.999)
    ),
    growth_interval=st.integers(min_value=1, max_value=5),
    overflows=st.lists(st.booleans(), min_size=1, max_size=24),
)
def test_scale_sequence_equals_grad_scaler(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    overflows: list[bool],
) -> None:
    # Within these ranges the scale stays in [1e-24, 1e28]: the clamps never bind.
    ours = LossScaler(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=1,
        min_scale=1e-30,
        max_scale=3e38,
    )
    theirs = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    p_ours, p_theirs = _param(), _param()
    opt_ours = torch.optim.SGD([p_ours], lr=1e-3, foreach=False)
    opt_theirs = torch.optim.SGD([p_theirs], lr=1e-3, foreach=False)
    for i, overflow in enumerate(overflows):
        _drive(ours, p_ours, opt_ours, overflow)
        _drive(theirs, p_theirs, opt_theirs, overflow)
        assert ours.get_scale() == theirs.get_scale(), (i, overflows[: i + 1])
        # Same unscaling, same skipping: the parameters agree bitwise too.
        assert torch.equal(p_ours, p_theirs), i
    stats = ours.stats
    assert stats.steps == len(overflows)
    assert stats.skipped == sum(overflows)


def test_growth_to_infinity_keeps_the_scale_like_grad_scaler() -> None:
    kwargs = dict(init_scale=2.0**126, growth_factor=4.0, backoff_factor=0.5, growth_interval=1)
    ours = LossScaler(**kwargs, max_scale=math.inf)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    seq = [False, False, True, False, False]
    got = _scales(ours, seq)
    want = []
    p = _param()
    opt = torch.optim.SGD([p], lr=1e-3)
    for overflow in seq:
        _drive(theirs, p, opt, overflow)
        want.append(theirs.get_scale())
    assert got == want
    assert got[0] == 2.0**126  # 2**128 is not finite in fp32: unchanged


# --- growth, hysteresis, bounds -------------------------------------------------------------


def test_defaults() -> None:
    s = LossScaler()
    assert (s.init_scale, s.growth_factor, s.backoff_factor) == (8192.0, 2.0, 0.5)
    assert (s.growth_interval, s.hysteresis, s.min_scale, s.max_scale) == (2000, 1, 1.0, 2.0**24)
    assert s.get_scale() == 8192.0
    assert s.scale_tensor is None


def test_grows_after_growth_interval_clean_steps() -> None:
    s = LossScaler(init_scale=16.0, growth_interval=3)
    assert _scales(s, [False] * 7) == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0]
    # An overflow restarts the count of clean steps.
    s = LossScaler(init_scale=16.0, growth_interval=3)
    assert _scales(s, [False, False, True, False, False, False]) == [16, 16, 8, 8, 8, 16]


def test_hysteresis_backs_off_only_after_consecutive_overflows() -> None:
    s = LossScaler(init_scale=1024.0, hysteresis=3, growth_interval=100)
    # Two overflows, a clean step (hysteresis restored), then three in a row: one back-off.
    seq = [True, True, False, True, True, True]
    assert _scales(s, seq) == [1024, 1024, 1024, 1024, 1024, 512]
    assert s.stats.skipped == 5
    # Every overflow is still skipped and counted; after a back-off hysteresis restarts.
    more = _scales(s, [True, True, True, True])
    assert more == [512, 512, 256, 256]
    assert s.stats.consecutive_skips == 7


def test_min_and_max_clamps() -> None:
    s = LossScaler(init_scale=4.0, min_scale=1.0, growth_interval=1000)
    assert _scales(s, [True] * 4) == [2.0, 1.0, 1.0, 1.0]
    s = LossScaler(init_scale=4.0, max_scale=16.0, growth_interval=1)
    assert _scales(s, [False] * 4) == [8.0, 16.0, 16.0, 16.0]
    s = LossScaler(init_scale=4.0, max_scale=10.0, growth_interval=1)
    assert _scales(s, [False] * 3) == [8.0, 10.0, 10.0]
    s = LossScaler(init_scale=3.0, min_scale=2.0, growth_interval=1000)
    assert _scales(s, [True, True]) == [2.0, 2.0]


def _reference(
    overflows: list[bool],
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> list[float]:
    """The documented schedule, written out on the host in fp32 arithmetic."""

    def f32(v: float) -> float:
        return torch.tensor(v, dtype=torch.float32).item()

    scale, tracker, left, out = f32(init_scale), 0, hysteresis, []
    for found in overflows:
        new = scale
        if found:
            tracker, left = 0, left - 1
            if left <= 0:
                new, left = f32(scale * backoff_factor), hysteresis
        else:
            left, tracker = hysteresis, tracker + 1
            if tracker >= growth_interval:
                new, tracker = f32(scale * growth_factor), 0
        if not math.isfinite(new):
            new = scale
        scale = f32(min(max(new, f32(min_scale)), f32(max_scale)))
        out.append(scale)
    return out


@settings(max_examples=100, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=20),
    hysteresis=st.integers(min_value=1, max_value=4),
    growth_interval=st.integers(min_value=1, max_value=4),
    min_exp=st.integers(min_value=-4, max_value=8),
    span=st.integers(min_value=0, max_value=8),
    start=st.integers(min_value=-4, max_value=16),
)
def test_hysteresis_and_bounds_follow_the_documented_schedule(
    overflows: list[bool],
    hysteresis: int,
    growth_interval: int,
    min_exp: int,
    span: int,
    start: int,
) -> None:
    min_scale, max_scale = 2.0**min_exp, 2.0 ** (min_exp + span)
    init = min(max(2.0**start, min_scale), max_scale)
    kwargs = dict(
        init_scale=init,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    got = _scales(LossScaler(**kwargs), overflows)
    assert got == _reference(overflows, **kwargs)
    assert all(min_scale <= v <= max_scale for v in got)


def test_static_scaler_keeps_its_scale_and_still_skips() -> None:
    s = LossScaler(init_scale=1.0, dynamic=False)
    loss = torch.tensor(3.0, requires_grad=True)
    assert s.scale(loss) is loss  # no multiply at all for a unit static scale
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    before = p.detach().clone()
    _drive(s, p, opt, overflow=True)
    assert torch.equal(p, before)
    _drive(s, p, opt, overflow=False)
    assert not torch.equal(p, before)
    assert s.get_scale() == 1.0
    assert s.stats == ScalerStats(steps=2, skipped=1, consecutive_skips=0, scale=1.0)
    # A static scale other than 1 is applied and never changes.
    s = LossScaler(init_scale=128.0, dynamic=False)
    assert _scales(s, [True, False, True]) == [128.0, 128.0, 128.0]


def test_update_with_new_scale() -> None:
    s = LossScaler(init_scale=64.0)
    _scales(s, [False])
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale((p * X).sum()).backward()
    s.step(opt)
    s.update(new_scale=5.0)
    assert s.get_scale() == 5.0
    s.scale((p * X).sum()).backward()
    s.step(opt)
    s.update(torch.tensor(7.0))
    assert s.get_scale() == 7.0


# --- what a step does -----------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_unscale_divides_and_step_applies_or_skips(fused: bool) -> None:
    s = LossScaler(init_scale=1024.0)
    p = _param()
    kw = {"fused": True} if fused else {"foreach": False}
    opt = torch.optim.SGD([p], lr=0.5, **kw)
    s.scale((p * X).sum()).backward()
    assert torch.equal(p.grad, X * 1024.0)
    s.unscale_(opt)
    assert torch.equal(p.grad, X)  # unscaled gradients: clip them here
    before = p.detach().clone()
    applied = s.step(opt)
    assert applied.dtype is torch.bool and applied.dim() == 0 and bool(applied)
    assert torch.equal(p, before - 0.5 * X)
    s.update()
    opt.zero_grad()

    s.scale((p * X).sum()).backward()
    p.grad[0] = float("nan")
    before = p.detach().clone()
    applied = s.step(opt)
    assert not bool(applied)
    assert torch.equal(p, before)  # skipped
    s.update()
    assert s.get_scale() == 512.0
    assert s.stats == ScalerStats(steps=2, skipped=1, consecutive_skips=1, scale=512.0)
    assert s.stats.overflow_rate == 0.5


def test_stats_before_any_step() -> None:
    stats = LossScaler(init_scale=4.0).stats
    assert stats == ScalerStats(steps=0, skipped=0, consecutive_skips=0, scale=4.0)
    assert stats.overflow_rate == 0.0


def test_consecutive_skips_counts_and_resets() -> None:
    s = LossScaler(init_scale=2.0**20, growth_interval=100)
    _scales(s, [True, True, True])
    assert s.stats.consecutive_skips == 3
    assert int(s.consecutive_skips_tensor) == 3
    _scales(s, [False])
    assert s.stats.consecutive_skips == 0
    assert s.stats.skipped == 3 and s.stats.steps == 4


def test_found_inf_hook_sees_and_can_set_the_flag() -> None:
    seen: list[float] = []

    def hook(flag: torch.Tensor) -> None:
        seen.append(float(flag))
        flag.fill_(1.0)  # e.g. another rank overflowed

    s = LossScaler(init_scale=8.0, found_inf_hook=hook)
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    before = p.detach().clone()
    _drive(s, p, opt, overflow=False)
    assert seen == [0.0]
    assert torch.equal(p, before) and s.stats.skipped == 1
    s.register_found_inf_hook(None)
    _drive(s, p, opt, overflow=False)
    assert not torch.equal(p, before)


def test_fp16_gradients_are_refused_when_dynamic() -> None:
    s = LossScaler()
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale((p.float() * X).sum()).backward()
    with pytest.raises(ConfigError, match="fp16-master"):
        s.unscale_(opt)


def test_parameters_without_grads_are_ignored() -> None:
    s = LossScaler(init_scale=4.0)
    p, unused = _param(), _param()
    opt = torch.optim.SGD([p, unused], lr=0.1)
    before = unused.detach().clone()
    _drive(s, p, opt, overflow=False)
    assert unused.grad is None and torch.equal(unused, before)
    assert s.stats.skipped == 0


def test_two_optimizers_share_one_update() -> None:
    s = LossScaler(init_scale=16.0, growth_interval=1000)
    a, b = _param(), _param()
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    before_a = a.detach().clone()
    s.scale((a * X).sum() + (b * X).sum()).backward()
    b.grad[0] = float("inf")
    assert bool(s.step(opt_a))
    assert not bool(s.step(opt_b))
    s.update()
    assert not torch.equal(a, before_a)
    assert s.get_scale() == 8.0  # one overflow anywhere backs off once
    assert s.stats.skipped == 1


# --- configuration errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=0.0),
        dict(init_scale=-1.0),
        dict(init_scale=math.inf),
        dict(init_scale=math.nan),
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(backoff_factor=0.0),
        dict(growth_interval=0),
        dict(growth_interval=2.5),
        dict(hysteresis=0),
        dict(min_scale=0.0),
        dict(min_scale=4.0, max_scale=2.0),
    ],
)
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        LossScaler(**kwargs)


# --- the state machine ----------------------------------------------------------------------


def _scaled_backward(s: LossScaler) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale((p * X).sum()).backward()
    return p, opt


def test_unscale_twice_raises() -> None:
    s = LossScaler()
    _, opt = _scaled_backward(s)
    s.unscale_(opt)
    with pytest.raises(ScalerStateError, match=r"unscale_\(\) was already called"):
        s.unscale_(opt)


def test_unscale_after_step_raises() -> None:
    s = LossScaler()
    _, opt = _scaled_backward(s)
    s.step(opt)
    with pytest.raises(ScalerStateError, match=r"after step\(\)"):
        s.unscale_(opt)


def test_step_twice_raises() -> None:
    s = LossScaler()
    _, opt = _scaled_backward(s)
    s.step(opt)
    with pytest.raises(ScalerStateError, match=r"update\(\)"):
        s.step(opt)


def test_step_before_scale_raises() -> None:
    s = LossScaler()
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    (p * X).sum().backward()
    with pytest.raises(ScalerStateError, match=r"before scale\(loss\)"):
        s.step(opt)
    with pytest.raises(ScalerStateError, match=r"before scale\(loss\)"):
        s.unscale_(opt)
    # After a complete step, the next one needs a new scale() too.
    s.scale((p * X).sum()).backward()
    s.step(opt)
    s.update()
    with pytest.raises(ScalerStateError, match=r"before scale\(loss\)"):
        s.step(opt)


def test_update_before_step_raises() -> None:
    s = LossScaler()
    with pytest.raises(ScalerStateError, match=r"step\(optimizer\)"):
        s.update()
    _, opt = _scaled_backward(s)
    with pytest.raises(ScalerStateError, match=r"step\(optimizer\)"):
        s.update()
    # Unscaled but not stepped: updating now would count a step that never happened.
    s.unscale_(opt)
    with pytest.raises(ScalerStateError, match=r"step\(optimizer\)"):
        s.update()
    s.step(opt)
    s.update()
    assert s.stats.steps == 1


def test_state_machine_recovers_after_update() -> None:
    s = LossScaler(init_scale=4.0)
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(3):
        s.scale((p * X).sum()).backward()
        s.unscale_(opt)
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert s.stats.steps == 3


def test_scale_needs_a_tensor() -> None:
    with pytest.raises(ScalerStateError, match="loss tensor"):
        LossScaler().scale(1.5)  # type: ignore[arg-type]


def test_state_dict_in_the_middle_of_a_step_raises() -> None:
    s = LossScaler()
    _, opt = _scaled_backward(s)
    s.unscale_(opt)
    with pytest.raises(ScalerStateError, match="after update"):
        s.state_dict()


# --- host syncs -----------------------------------------------------------------------------

_SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def _count_syncs(monkeypatch: pytest.MonkeyPatch, forbid: bool) -> Iterator[list[str]]:
    calls: list[str] = []
    with monkeypatch.context() as m:
        for name in _SYNC_METHODS:
            original = getattr(torch.Tensor, name)

            def patched(self, *args, __name=name, __original=original):  # type: ignore[no-untyped-def]
                calls.append(__name)
                if forbid:
                    raise AssertionError(f"host sync: Tensor.{__name}() called")
                return __original(self, *args)

            m.setattr(torch.Tensor, name, patched)
        yield calls


@pytest.mark.parametrize("overflow", [False, True])
def test_no_host_sync_with_a_fused_optimizer(
    monkeypatch: pytest.MonkeyPatch, overflow: bool
) -> None:
    s = LossScaler(init_scale=256.0, growth_interval=1)
    p = _param()
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    for _ in range(2):
        loss = (p * X).sum()
        with _count_syncs(monkeypatch, forbid=True):
            scaled = s.scale(loss)
        scaled.backward()
        if overflow:
            p.grad[2] = float("inf")
        with _count_syncs(monkeypatch, forbid=True):
            s.unscale_(opt)
            applied = s.step(opt)
            s.update()
        opt.zero_grad()
    assert bool(applied) is (not overflow)
    assert s.get_scale() == (64.0 if overflow else 1024.0)


def test_one_host_sync_in_step_with_a_non_fused_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = LossScaler(init_scale=256.0)
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1, foreach=False)
    loss = (p * X).sum()
    with _count_syncs(monkeypatch, forbid=True):
        scaled = s.scale(loss)
    scaled.backward()
    with _count_syncs(monkeypatch, forbid=True):
        s.unscale_(opt)
    with _count_syncs(monkeypatch, forbid=False) as calls:
        s.step(opt)
    assert calls == ["item"]
    with _count_syncs(monkeypatch, forbid=True):
        s.update()


# --- state_dict / load_state_dict -----------------------------------------------------------


@pytest.mark.parametrize("initialized", [False, True])
def test_resumed_scaler_continues_exactly(initialized: bool) -> None:
    kwargs = dict(
        init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=2.0, max_scale=2.0**15
    )
    head = [False, True, False, False, True, True, False]
    tail = [False, False, True, True, False, False, False, True, False, False, False, False]
    whole = LossScaler(**kwargs)
    want = _scales(whole, head + tail)

    first = LossScaler(**kwargs)
    assert _scales(first, head) == want[: len(head)]
    state = first.state_dict()
    assert state["steps"] == len(head) and state["skipped"] == sum(head)
    # A differently configured scaler takes the saved settings with the state.
    resumed = LossScaler(init_scale=1.0, growth_interval=99, hysteresis=1)
    if initialized:
        _scales(resumed, [True, False])  # already on its device, with state of its own
    resumed.load_state_dict(state)
    assert resumed.get_scale() == want[len(head) - 1]
    assert _scales(resumed, tail) == want[len(head) :]
    assert resumed.state_dict() == whole.state_dict()


def test_state_dict_round_trips_through_torch_save(tmp_path) -> None:
    s = LossScaler(init_scale=1000.0, growth_interval=2)
    _scales(s, [False, True, False])
    path = tmp_path / "scaler.pt"
    torch.save(s.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    fresh = LossScaler()
    fresh.load_state_dict(loaded)
    assert fresh.stats == s.stats
    assert _scales(fresh, [False, False]) == _scales(s, [False, False])


def test_load_state_dict_rejects_other_dicts() -> None:
    with pytest.raises(ConfigError, match="LossScaler.state_dict"):
        LossScaler().load_state_dict({"scale": 1.0})


def test_repr_mentions_the_kind() -> None:
    assert "dynamic" in repr(LossScaler())
    assert "static" in repr(LossScaler(init_scale=1.0, dynamic=False))


_FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.5, nesterov=False, fused=True
    ),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


def _train(make, overflows: list[bool]) -> tuple[torch.Tensor, dict]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64))
    opt = make([p])
    s = LossScaler(init_scale=4.0, growth_interval=1000)
    for overflow in overflows:
        # Leave non-zero garbage in freed memory, as a long run would.
        junk = torch.full((64,), 12345.0)
        del junk
        s.scale((p * p).sum()).backward()
        if overflow:
            p.grad[0] = float("inf")
        s.step(opt)
        s.update()
        opt.zero_grad()
    return p.detach().clone(), opt.state_dict()["state"]


@pytest.mark.parametrize("name", sorted(_FUSED))
@pytest.mark.parametrize(
    "overflows", [[True, False, False], [False, True, False], [True, True, True, False, False]]
)
def test_a_skipped_step_of_a_fused_optimizer_is_as_if_it_never_happened(
    name: str, overflows: list[bool]
) -> None:
    # Including the very first step, before the optimizer has any state.
    weights, state = _train(_FUSED[name], overflows)
    clean_weights, clean_state = _train(_FUSED[name], [False] * overflows.count(False))
    assert torch.equal(weights, clean_weights)
    assert state.keys() == clean_state.keys()
    for index in state:
        assert state[index].keys() == clean_state[index].keys()
        for key, value in state[index].items():
            assert torch.equal(value, clean_state[index][key]), (name, key)


def test_fused_sgd_with_momentum_syncs_only_until_its_buffers_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = LossScaler(init_scale=4.0)
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    for step in range(3):
        s.scale((p * X).sum()).backward()
        s.unscale_(opt)
        with _count_syncs(monkeypatch, forbid=False) as calls:
            s.step(opt)
        assert len(calls) == (1 if step == 0 else 0), (step, calls)
        s.update()
        opt.zero_grad()
