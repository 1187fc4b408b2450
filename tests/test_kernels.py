"""Layer kinds with no 16-bit kernel train as fp32 islands; ``precision="auto"`` everywhere.

Most verdicts are made from injected answers (``assumed_kernels``, ``assumed_speed``), so
they hold on every CPU. The tests marked "this machine" run the real probe: on an AVX2-only
CPU (or under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, which ``make test``
runs too) the LSTM has no bf16 kernel and they exercise the real island; on an AVX-512-BF16
CPU every kind has one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.models import build_model
from memfit.precision.kernels import (
    KINDS,
    assumed_kernels,
    kernel_support,
    missing_kernel_types,
)
from memfit.precision.policy import DEFAULT_FP32_ISLANDS
from memfit.precision.speed import (
    PREFILTER_BELOW,
    assumed_model_seconds,
    assumed_speed,
    matmul_speed,
)
from tests.engine_cases import assert_bitwise

pytestmark = pytest.mark.usefixtures("one_thread")

EMULATED = {torch.bfloat16: 0.013}  # an AVX2-only CPU's bf16 matmul, measured


class _Recurrent(nn.Module):
    """An embedding, an LSTM and a GRU (state passed between them), a LayerNorm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, (h, _) = self.lstm(self.embed(ids))
        x, _ = self.gru(x, h)
        return self.head(self.norm(x))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, 32), ids[:, 1:].reshape(-1))


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(i))


def _train(model: nn.Module, steps: int = 3, **engine_kwargs) -> memfit.Engine:
    engine = memfit.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), monitor=False, **engine_kwargs
    )
    for i in range(steps):
        engine.train_step(_batch(i), _loss)
    return engine


def test_a_kind_without_a_kernel_trains_as_an_fp32_island_named_in_a_warning() -> None:
    torch.manual_seed(0)
    model = _Recurrent()
    reference = _Recurrent()
    reference.load_state_dict(model.state_dict())
    with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM",)):
        with pytest.warns(UserWarning, match=r"LSTM: no bf16 kernel.*so lstm train as fp32"):
            engine = _train(model, precision="bf16-mixed")
    assert engine.settings.kernel_islands == ("lstm",)
    assert "lstm" in engine.islands and "gru" not in engine.islands
    # The same as declaring the island by hand: bitwise, weights and all.
    by_hand = memfit.PrecisionPolicy("bf16-mixed", fp32_islands=(*DEFAULT_FP32_ISLANDS, nn.LSTM))
    expected = _train(reference, precision=by_hand)
    assert expected.settings.kernel_islands == ()
    assert_bitwise(model.state_dict(), reference.state_dict())


def test_a_master_mode_keeps_the_island_weights_in_fp32() -> None:
    torch.manual_seed(0)
    model = _Recurrent()
    with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM", "GRU")):
        with pytest.warns(UserWarning, match="no bf16 kernel"):
            engine = _train(model, precision="bf16-master")
        assert engine.settings.kernel_islands == ("lstm", "gru")
    assert {p.dtype for p in model.lstm.parameters()} == {torch.float32}
    assert {p.dtype for p in model.gru.parameters()} == {torch.float32}
    assert model.head.weight.dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_islands_found_are_not_saved_as_a_setting_to_resume_with(tmp_path) -> None:
    torch.manual_seed(0)
    model = _Recurrent()
    with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM",)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = _train(model, steps=1, precision="bf16-mixed")
        engine.save(tmp_path / "c.pt")
    fresh = _Recurrent()
    with assumed_kernels("cpu", torch.bfloat16, missing=()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-bf16 warning, where bf16 is emulated
        # Resumed on a machine where the LSTM has its kernel.
        resumed = memfit.Engine.resume(
            tmp_path / "c.pt", fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), monitor=False
        )
        assert resumed.settings.kernel_islands == ()
        assert "lstm" not in resumed.islands


def test_injected_answers_name_known_kinds_only() -> None:
    with pytest.raises(memfit.errors.ConfigError, match="unknown layer kinds"):
        with assumed_kernels("cpu", torch.bfloat16, missing=("Lstm",)):
            pass


def test_the_probe_on_this_machine_agrees_with_running_each_kind() -> None:
    """Each kind the probe calls missing fails when run in bf16, each other one runs."""
    state = torch.get_rng_state()
    support = kernel_support("cpu", torch.bfloat16)
    assert torch.equal(state, torch.get_rng_state())  # the probe draws nothing of ours
    assert set(support.checks) == {k.name for k in KINDS}
    assert set(missing_kernel_types("cpu", torch.bfloat16)) == {
        k.module_type for k in KINDS if k.name in support.missing()
    }
    lstm, x = nn.LSTM(8, 8, batch_first=True), torch.randn(2, 3, 8)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(x)[0].float().sum().backward()
        ran = True
    except RuntimeError:
        ran = False
    assert ran == ("LSTM" not in support.missing())
    assert kernel_support("cpu", torch.float32).missing() == ()
    assert kernel_support("meta", torch.bfloat16).missing() == ()


@pytest.mark.parametrize("name", ["lstm", "gpt", "resnet"])
def test_bf16_mixed_asked_for_by_hand_trains_on_this_machine(name: str) -> None:
    """On an AVX2-only CPU the built-in LSTM's layers are islands here (the real probe);
    on any CPU every model trains to a finite loss, and the islands are those named."""
    overrides = {"gpt": {"n_layer": 1, "n_embd": 32, "block_size": 16}, "lstm": {}, "resnet": {}}
    model, loss_fn, batch_fn = build_model(name, data="synthetic", **overrides[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-bf16 warning, where bf16 is emulated
        engine = memfit.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.01), precision="bf16-mixed"
        )
        loss = engine.train_step(batch_fn(2, generator=0), loss_fn)
    assert torch.isfinite(loss)
    missing = missing_kernel_types("cpu", torch.bfloat16)
    expected = tuple(n for n, m in model.named_modules() if missing and isinstance(m, missing))
    assert engine.settings.kernel_islands == expected


@pytest.mark.parametrize("name", ["lstm", "gru", "gpt", "resnet"])
def test_auto_trains_in_fp32_where_bf16_is_emulated(name: str) -> None:
    if name == "gru":
        model: nn.Module = nn.Sequential(nn.Linear(8, 8), nn.GRU(8, 8, batch_first=True))
        batch = torch.randn(2, 4, 8)

        def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m(x)[0].float().pow(2).mean()
    else:
        model, loss_fn, batch_fn = build_model(
            name, data="synthetic", **({"n_layer": 1, "n_embd": 32} if name == "gpt" else {})
        )
        batch = batch_fn(2, generator=0)
    engine = memfit.Engine(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert engine.settings.precision == "auto"  # the default
    with assumed_speed("cpu", EMULATED):
        engine.train_step(batch, loss_fn)
    assert engine.settings.precision == "fp32"
    assert "below 0.5x" in engine.auto.precision_choice.note


def test_auto_on_this_machine_never_chooses_an_emulated_bf16() -> None:
    model, loss_fn, batch_fn = build_model("lstm", data="synthetic")
    engine = memfit.Engine(model, torch.optim.SGD(model.parameters(), lr=0.01))
    engine.train_step(batch_fn(2, generator=0), loss_fn)
    if matmul_speed("cpu").speedup(torch.bfloat16) < PREFILTER_BELOW:
        assert engine.settings.precision == "fp32"
    else:
        assert engine.settings.precision in ("fp32", "bf16-mixed")


def test_plan_takes_and_defaults_to_auto() -> None:
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", n_layer=2, n_embd=32)
    batch = batch_fn(2, generator=0)
    with assumed_speed("cpu", EMULATED):
        plan = memfit.plan(model, batch, loss_fn, strategy="full")
    assert plan.precision == "fp32"
    assert any("precision auto: fp32" in n for n in plan.notes), plan.notes
    with assumed_speed("cpu", {torch.bfloat16: 2.7}):
        with assumed_model_seconds("cpu", {"fp32": 1.0, "bf16-mixed": 0.5}):
            plan = memfit.plan(model, batch[:, :-1], strategy="full")
    assert plan.precision == "bf16-mixed"
    assert any("precision auto: bf16-mixed" in n for n in plan.notes), plan.notes


def test_estimate_and_tune_take_auto_as_the_modes_it_chooses_between() -> None:
    from memfit.precision.speed import expand_precisions

    assert expand_precisions(["auto"]) == ["fp32", "bf16-mixed"]
    assert expand_precisions(["bf16", "AUTO", "fp32"]) == ["bf16-mixed", "fp32"]
    with pytest.raises(memfit.errors.ConfigError, match="unknown precision"):
        expand_precisions(["bf17"])
