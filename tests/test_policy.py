"""Precision policies: modes, aliases, fp32 islands, and that every mode trains."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.errors import ConfigError
from memfit.precision import (
    ALIASES,
    MODES,
    PrecisionPolicy,
    apply_precision,
    remove_precision,
    resolve_mode,
)
from memfit.precision.policy import DEFAULT_FP32_ISLANDS

pytestmark = pytest.mark.usefixtures("one_thread")


# --- modes and aliases ---------------------------------------------------------------------


def test_the_six_modes() -> None:
    assert MODES == ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-sr")


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_resolves_to_itself(mode: str) -> None:
    assert resolve_mode(mode) == mode
    assert PrecisionPolicy(mode).mode == mode


@pytest.mark.parametrize(
    ("alias", "mode"),
    [
        ("bf16", "bf16-mixed"),
        ("fp16", "fp16-mixed"),
        ("16-mixed", "fp16-mixed"),
        ("16", "fp16-mixed"),
        ("O1", "fp16-mixed"),
        ("O2", "fp16-master"),
        ("O0", "fp32"),
        ("32", "fp32"),
        ("32-true", "fp32"),
        ("float32", "fp32"),
        ("bfloat16", "bf16-mixed"),
        ("float16", "fp16-mixed"),
        ("bf16-true", "bf16-master"),
        ("16-true", "fp16-master"),
        # Case and surrounding spaces do not matter.
        ("BF16", "bf16-mixed"),
        ("  fp16  ", "fp16-mixed"),
        ("FP32", "fp32"),
        ("o1", "fp16-mixed"),
        ("o2", "fp16-master"),
        ("BF16-Master", "bf16-master"),
    ],
)
def test_aliases_resolve(alias: str, mode: str) -> None:
    # bf16-true means something else in Lightning: it still trains here, with a warning.
    deprecated = alias == "bf16-true"
    with pytest.warns(DeprecationWarning) if deprecated else contextlib.nullcontext():
        assert resolve_mode(alias) == mode
    with pytest.warns(DeprecationWarning) if deprecated else contextlib.nullcontext():
        policy = PrecisionPolicy(alias)
    assert policy.mode == mode  # stored resolved
    assert str(policy) == mode


def test_every_alias_maps_to_a_mode() -> None:
    assert set(ALIASES.values()) == set(MODES)
    for mode in MODES:
        assert ALIASES[mode] == mode


@pytest.mark.parametrize("bad", ["fp8", "bf32", "O3", "", "mixed", "fp16_mixed"])
def test_unknown_precision_lists_the_valid_modes_and_aliases(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrecisionPolicy(bad)
    message = str(info.value)
    assert repr(bad) in message
    for mode in MODES:
        assert mode in message
    for alias in ("bf16", "fp16", "16-mixed", "O1", "O2"):
        assert alias in message
    with pytest.raises(ConfigError):
        resolve_mode(bad)
    with pytest.raises(ConfigError):
        memfit.Engine(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters()), bad)


def test_policy_of() -> None:
    policy = PrecisionPolicy("bf16")
    assert PrecisionPolicy.of(policy) is policy
    assert PrecisionPolicy.of(None).mode == "fp32"
    assert PrecisionPolicy.of("O2").mode == "fp16-master"
    assert resolve_mode(policy) == "bf16-mixed"  # type: ignore[arg-type]
    assert PrecisionPolicy().mode == "bf16-mixed"


@pytest.mark.parametrize(
    ("mode", "compute", "param", "master", "scaling", "mixed"),
    [
        ("fp32", torch.float32, torch.float32, False, False, False),
        ("bf16-mixed", torch.bfloat16, torch.float32, False, False, True),
        ("fp16-mixed", torch.float16, torch.float32, False, True, True),
        ("bf16-master", torch.bfloat16, torch.bfloat16, True, False, True),
        ("fp16-master", torch.float16, torch.float16, True, True, True),
    ],
)
def test_mode_table(
    mode: str,
    compute: torch.dtype,
    param: torch.dtype,
    master: bool,
    scaling: bool,
    mixed: bool,
) -> None:
    policy = PrecisionPolicy(mode)
    assert policy.compute_dtype is compute
    assert policy.param_dtype is param
    assert policy.master_weights is master
    assert policy.loss_scaling is scaling
    assert policy.mixed is mixed


def test_policy_is_frozen() -> None:
    policy = PrecisionPolicy("bf16")
    with pytest.raises(AttributeError):
        policy.mode = "fp32"  # type: ignore[misc]


def test_fp32_islands_config() -> None:
    assert nn.LayerNorm in DEFAULT_FP32_ISLANDS
    assert PrecisionPolicy("bf16").is_island(nn.LayerNorm(4))
    assert PrecisionPolicy("bf16").is_island(nn.BatchNorm1d(4))
    assert not PrecisionPolicy("bf16").is_island(nn.Linear(4, 4))
    custom = PrecisionPolicy("bf16", fp32_islands=[nn.Linear])  # type: ignore[arg-type]
    assert custom.fp32_islands == (nn.Linear,)
    assert custom.is_island(nn.Linear(2, 2))
    assert not PrecisionPolicy("bf16", fp32_islands=()).is_island(nn.LayerNorm(4))
    for bad in ((int,), (nn.LayerNorm(4),), ("LayerNorm",)):
        with pytest.raises(ConfigError, match="nn.Module subclasses"):
            PrecisionPolicy("bf16", fp32_islands=bad)  # type: ignore[arg-type]


def test_autocast_contexts() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with PrecisionPolicy("fp32").autocast("cpu"):
        assert lin(x).dtype is torch.float32
        assert not torch.is_autocast_enabled("cpu")
    with PrecisionPolicy("bf16-mixed").autocast("cpu"):
        assert lin(x).dtype is torch.bfloat16
    with PrecisionPolicy("fp16-mixed").autocast("cpu"):
        assert lin(x).dtype is torch.float16


# --- device checks -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fp16-mixed", "fp16-master", "O1", "16"])
def test_fp16_on_cpu_warns_that_it_is_slow(mode: str) -> None:
    with pytest.warns(UserWarning, match="slow"):
        PrecisionPolicy(mode).check_device("cpu")
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="slow"):
        memfit.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=mode)


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master"])
def test_other_modes_on_cpu_do_not_warn(mode: str) -> None:
    from memfit.precision.speed import assumed_speed

    # A CPU with native bf16 (its measured ratio injected: no verdict from this machine).
    with assumed_speed("cpu", {torch.bfloat16: 2.7}), warnings.catch_warnings():
        warnings.simplefilter("error")
        PrecisionPolicy(mode).check_device("cpu")
        PrecisionPolicy(mode).check_device(torch.device("cpu"))


# --- fp32 islands ---------------------------------------------------------------------------


class ProbeNorm(nn.LayerNorm):
    """A LayerNorm that records what it sees inside its own forward."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return super().forward(x)


def _island_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), ProbeNorm(8), nn.ReLU(), nn.Linear(8, 4))


def test_island_runs_in_fp32_under_bf16_autocast() -> None:
    model = _island_model()
    norm = model[1]
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = norm(model[0](x))
    # Without the island, CPU autocast computes the LayerNorm in bf16 on bf16 inputs.
    assert norm.seen[-1] == (torch.bfloat16, True)
    assert plain.dtype is torch.bfloat16

    names = apply_precision(model, PrecisionPolicy("bf16-mixed"))
    assert names == ["1"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x)
        assert hidden.dtype is torch.bfloat16
        out = norm(hidden)
        final = model(x)
    assert norm.seen[-1] == (torch.float32, False)  # inputs cast up, autocast off inside
    assert out.dtype is torch.bfloat16  # and the output goes back to the dtype that came in
    assert final.dtype is torch.bfloat16  # the Linear after it is still under autocast
    assert norm.weight.dtype is torch.float32
    # The island's result is the fp32 LayerNorm of the (bf16) hidden state, rounded once.
    expected = F.layer_norm(hidden.float(), (8,), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)

    remove_precision(model)
    assert "forward" not in norm.__dict__
    assert not hasattr(norm, "_memfit_island_forward")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = norm(model[0](x))
    assert norm.seen[-1] == (torch.bfloat16, True)
    assert again.dtype is torch.bfloat16
    torch.testing.assert_close(again, plain, rtol=0, atol=0)


def test_island_backward_gives_fp32_grads() -> None:
    model = _island_model()
    apply_precision(model, PrecisionPolicy("bf16-mixed"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(3, 8)).float().pow(2).mean()
    loss.backward()
    assert model[1].weight.grad is not None and model[1].weight.grad.dtype is torch.float32
    assert torch.isfinite(model[1].weight.grad).all()


def test_apply_precision_is_idempotent() -> None:
    model = _island_model()
    policy = PrecisionPolicy("bf16-mixed")
    first = apply_precision(model, policy)
    original = model[1].__dict__["_memfit_island_forward"]
    assert apply_precision(model, policy) == first
    assert model[1].__dict__["_memfit_island_forward"] is original  # not wrapped twice
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8))
    assert len(model[1].seen) == 1
    remove_precision(model)
    assert "forward" not in model[1].__dict__
    remove_precision(model)  # removing twice is harmless


def test_fp32_policy_changes_nothing() -> None:
    model = _island_model()
    assert apply_precision(model, PrecisionPolicy("fp32")) == []
    assert "forward" not in model[1].__dict__
    assert all(p.dtype is torch.float32 for p in model.parameters())


@pytest.mark.parametrize(
    ("mode", "dtype"), [("bf16-master", torch.bfloat16), ("O2", torch.float16)]
)
def test_master_modes_cast_everything_but_islands(mode: str, dtype: torch.dtype) -> None:
    model = _island_model()
    apply_precision(model, PrecisionPolicy(mode))
    assert model[0].weight.dtype is dtype and model[3].bias.dtype is dtype
    assert model[1].weight.dtype is torch.float32 and model[1].bias.dtype is torch.float32


def test_island_casts_tuple_and_keyword_inputs() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[torch.dtype, ...]] = []

        def forward(self, xs: tuple[torch.Tensor, torch.Tensor], *, extra: dict) -> torch.Tensor:
            self.seen.append((xs[0].dtype, xs[1].dtype, extra["t"].dtype, extra["i"].dtype))
            return xs[0] + xs[1] + extra["t"]

    module = Pair()
    apply_precision(module, PrecisionPolicy("bf16", fp32_islands=(Pair,)))
    half = torch.ones(2, dtype=torch.bfloat16)
    index = torch.arange(2)
    out = module((half, half), extra={"t": half, "i": index})
    assert module.seen[-1] == (torch.float32, torch.float32, torch.float32, torch.int64)
    assert out.dtype is torch.bfloat16  # the dtype of the first floating input


def test_no_islands_means_no_wrapping() -> None:
    model = _island_model()
    assert apply_precision(model, PrecisionPolicy("bf16", fp32_islands=())) == []
    assert "forward" not in model[1].__dict__


# --- every mode trains ----------------------------------------------------------------------


def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, x @ w + 0.01 * torch.randn(64, 1, generator=g)


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True])
def test_every_mode_trains(mode: str, fused: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-2, fused=fused, foreach=False if not fused else None
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fp16 matmul is very slow")
        # bf16-sr keeps bf16 gradients: it refuses to sum micro-batches in them.
        accumulation = 1 if mode == "bf16-sr" else 2
        engine = memfit.Engine(model, opt, precision=mode, accumulation_steps=accumulation)
    batch = _regression()
    losses = [float(engine.train_step(batch, _mse)) for _ in range(40)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.2 * losses[0], (mode, losses[0], losses[-1])
    assert engine.applied_steps == 40
    assert engine.scaler.stats.skipped == 0
    dtype = PrecisionPolicy(mode).param_dtype
    assert model[0].weight.dtype is dtype
    assert model[1].weight.dtype is torch.float32  # island
