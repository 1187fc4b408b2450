"""Device-side metrics: activation ranges, gradient underflow, norms, overflow window, throughput."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memfit
from memfit.errors import ConfigError
from memfit.monitor.metrics import (
    FP16_MAX,
    ActivationRanges,
    OverflowWindow,
    Throughput,
    activation_metrics,
    count_flops,
    first_nonfinite,
    grad_norm_stats,
    gradient_underflow,
    memory_metrics,
    near_fp16_limit,
    recompute_overhead_from_flops,
    recompute_overhead_from_time,
    suggest_initial_scale,
)


class Pair(nn.Module):
    """Returns a nested structure, to check outputs inside tuples and dicts are found."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = self.lin(x)
        return y, {"scaled": 3.0 * y, "index": torch.arange(3)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.pair = Pair()
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        y, extra = self.pair(h)
        return self.out(y + extra["scaled"])


def _direct(model: Net, x: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        inp = model.inp(x)
        y, extra = model.pair(torch.tanh(inp))
        out = model.out(y + extra["scaled"])
    return {
        "inp": inp.abs().max().item(),
        "pair": max(y.abs().max().item(), extra["scaled"].abs().max().item()),
        "out": out.abs().max().item(),
    }


def test_activation_max_equals_direct_computation() -> None:
    torch.manual_seed(0)
    model = Net()
    inputs = [torch.randn(5, 4) * (i + 1) for i in range(7)]
    ranges = ActivationRanges(model, ["inp", "pair", "out"], every=3)
    for x in inputs:
        model(x)
    # Calls 0, 3 and 6 are sampled: the running max over those three.
    expected = {
        k: max(_direct(model, inputs[i])[k] for i in (0, 3, 6)) for k in ("inp", "pair", "out")
    }
    values = ranges.read()
    assert values.keys() == expected.keys()
    for k in expected:
        assert values[k] == pytest.approx(expected[k], rel=1e-6)
    assert ranges.read() == {}  # reset by the first read
    model(inputs[0])  # call 7: not sampled
    assert ranges.read() == {}
    ranges.remove()
    for _ in range(3):
        model(inputs[0])
    assert ranges.read() == {}


def test_activation_read_without_reset_keeps_max() -> None:
    model = Net()
    ranges = ActivationRanges(model, ["out"], every=1)
    model(torch.randn(2, 4))
    first = ranges.read(reset=False)
    assert ranges.read(reset=False) == first
    ranges.remove()


def test_activation_hooks_leave_gradients_bitwise_equal() -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 4)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    with ActivationRanges(model, ["inp", "pair", "out"], every=1) as ranges:
        out_hooked = model(x)
        hooked = grads()
        assert ranges.read()
    assert torch.equal(out_hooked, model(x))
    for a, b in zip(plain, hooked):
        assert torch.equal(a, b)


def test_unknown_unit_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no module named"):
        ActivationRanges(Net(), ["nope"])
    with pytest.raises(ConfigError, match="every"):
        ActivationRanges(Net(), ["inp"], every=0)


def test_fp16_limit_names_the_unit_that_exceeds_it() -> None:
    model = nn.Sequential()
    model.add_module("small", nn.Linear(64, 64))
    model.add_module("big", nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model.small.weight.fill_(0.01)
        model.small.bias.fill_(1.0)
        model.big.weight.fill_(1000.0)  # 64 inputs of ~1.6 each: ~100k, past fp16's 65504
    ranges = ActivationRanges(model, ["small", "big"], every=1)
    model(torch.ones(2, 64))
    values = ranges.read()
    hits = near_fp16_limit(values)
    assert [name for name, _ in hits] == ["big"]
    assert hits[0][1] > FP16_MAX
    assert ActivationRanges.near_fp16_limit(values) == hits
    metrics = activation_metrics(values)
    assert metrics["act/max_fp16_fraction"] == pytest.approx(values["big"] / FP16_MAX)
    assert set(metrics) == {"act/max/small", "act/max/big", "act/max_fp16_fraction"}


def test_near_fp16_limit_margin_and_nonfinite() -> None:
    values = {"a": 40000.0, "b": 20000.0, "c": math.inf, "d": math.nan}
    names = [n for n, _ in near_fp16_limit(values)]
    assert names[0] == "d" and set(names) == {"a", "c", "d"}
    assert {n for n, _ in near_fp16_limit(values, margin=0.25)} == {"a", "b", "c", "d"}
    with pytest.raises(ConfigError):
        near_fp16_limit(values, margin=0)


def _direct_underflow(grads: list[torch.Tensor], scale: float) -> tuple[int, int, int]:
    nonzero = below_sub = below_norm = 0
    for g in grads:
        a = g.double().abs()
        nz = a > 0
        nonzero += int(nz.sum())
        below_sub += int((nz & (a * scale < 2.0**-24)).sum())
        below_norm += int((nz & (a * scale < 2.0**-14)).sum())
    return nonzero, below_sub, below_norm


@pytest.mark.parametrize("scale", [1.0, 1024.0, 65536.0])
def test_underflow_fraction_equals_direct_count(scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    grads = []
    for shape in [(50, 40), (300,), (7, 3, 5)]:
        magnitude = 10.0 ** (-14 * torch.rand(shape, generator=gen))  # 1e-14 .. 1
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        g = magnitude * sign
        g[torch.rand(shape, generator=gen) < 0.1] = 0.0
        grads.append(g)
    grads.append(grads[0].to(torch.bfloat16))
    stats = gradient_underflow([*grads, None], scale)
    nonzero, below_sub, below_norm = _direct_underflow(grads, scale)
    assert (stats.nonzero, stats.below_subnormal, stats.below_normal) == (
        nonzero,
        below_sub,
        below_norm,
    )
    assert stats.fraction == pytest.approx(below_sub / nonzero)
    assert stats.fraction_below_normal == pytest.approx(below_norm / nonzero)
    assert 0 < stats.fraction < stats.fraction_below_normal < 1
    assert stats.max_abs == pytest.approx(max(g.double().abs().max().item() for g in grads))
    # The scale may also be a device tensor, as the scaler keeps it.
    assert gradient_underflow(grads, torch.tensor(scale)) == stats
    metrics = stats.to_metrics()
    assert metrics["grad/underflow_fraction"] == stats.fraction


def test_underflow_of_no_gradients() -> None:
    stats = gradient_underflow([None, torch.zeros(3)], 8.0)
    assert stats.fraction == 0.0 and stats.nonzero == 0


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False))
def test_suggested_scale_rule(max_abs: float) -> None:
    s = suggest_initial_scale(max_abs)
    assert 1.0 <= s <= 2.0**24
    assert math.log2(s).is_integer()
    if 1.0 < s < 2.0**24:
        assert max_abs * s <= FP16_MAX / 8
        assert max_abs * 2 * s > FP16_MAX / 8  # the largest such power of two


def test_suggested_scale_edges() -> None:
    assert suggest_initial_scale(0.0) == 2.0**24
    assert suggest_initial_scale(math.inf) == 1.0
    assert suggest_initial_scale(0.5) == 8192.0
    assert suggest_initial_scale(1e6) == 1.0


def test_grad_norm_stats_matches_direct() -> None:
    torch.manual_seed(0)
    named = {
        "a": torch.randn(10),
        "b": torch.randn(3, 3) * 10,
        "c": torch.randn(4).to(torch.bfloat16),
        "d": torch.randn(5),
        "none": None,
    }
    stats = grad_norm_stats(named)
    present = [v for v in named.values() if v is not None]
    norms = torch.stack([v.float().norm() for v in present])
    assert stats.count == 4
    assert stats.total == pytest.approx(torch.linalg.vector_norm(norms).item(), rel=1e-5)
    assert stats.largest == "b"
    assert stats.max == pytest.approx(norms.max().item(), rel=1e-5)
    assert stats.min == pytest.approx(norms.min().item(), rel=1e-5)
    assert stats.median == pytest.approx(torch.quantile(norms, 0.5).item(), rel=1e-5)
    assert stats.p90 == pytest.approx(torch.quantile(norms, 0.9).item(), rel=1e-5)
    assert set(stats.to_metrics()) == {
        "grad/norm_total",
        "grad/norm_min",
        "grad/norm_median",
        "grad/norm_p90",
        "grad/norm_max",
    }
    with pytest.raises(ConfigError, match="no gradients"):
        grad_norm_stats({"x": None})


def test_first_nonfinite() -> None:
    named = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(3)}
    assert first_nonfinite(named) is None
    named["c"][1] = math.nan
    named["b"][0] = -math.inf
    assert first_nonfinite(named) == "b"
    assert grad_norm_stats(named).largest == "b"
    assert first_nonfinite({}) is None


def test_overflow_window_from_scripted_flags() -> None:
    window = OverflowWindow(size=10)
    assert window.rate == 0.0
    flags = [True, False, False, False, True] + [False] * 10 + [True, True]
    for f in flags:
        window.push(f)
    assert window.steps == 10
    assert window.rate == pytest.approx(sum(flags[-10:]) / 10)
    assert window.metrics() == {"amp/overflow_rate_recent": window.rate}


def test_overflow_window_from_cumulative_counters() -> None:
    window = OverflowWindow(size=100)
    window.update(steps=50, skipped=5)
    assert window.rate == pytest.approx(0.1)
    window.update(steps=100, skipped=5)  # 50 clean steps
    assert window.rate == pytest.approx(0.05)
    window.update(steps=150, skipped=5)  # the 5 skips slide out of the last 100
    assert window.rate == 0.0
    window.update(steps=1150, skipped=105)  # 1000 steps, 100 skips: proportional fill
    assert window.rate == pytest.approx(0.1)
    window.update(steps=10, skipped=1)  # counters went back: a fresh window
    assert window.steps == 10 and window.rate == pytest.approx(0.1)
    with pytest.raises(ConfigError):
        window.update(steps=5, skipped=6)


def test_throughput_and_recompute_overhead() -> None:
    tp = Throughput(tokens_per_sample=128, flops_per_sample=1e9, peak_flops=1e12)
    assert tp.metrics() == {}
    tp.add(samples=16, seconds=0.5)
    tp.add(samples=16, seconds=0.5)
    m = tp.metrics()
    assert m["throughput/samples_per_second"] == pytest.approx(32.0)
    assert m["throughput/tokens_per_second"] == pytest.approx(32.0 * 128)
    assert m["throughput/flops_per_second"] == pytest.approx(32e9)
    assert m["throughput/mfu"] == pytest.approx(0.032)
    assert tp.metrics() == {}  # reset
    tp.start()
    tp.stop(samples=4)
    assert tp.samples == 4
    assert recompute_overhead_from_flops(30.0, 100.0) == pytest.approx(0.3)
    assert recompute_overhead_from_time(0.13, 0.10) == pytest.approx(0.3)
    with pytest.raises(ConfigError):
        recompute_overhead_from_flops(1.0, 0.0)
    with pytest.raises(ConfigError):
        Throughput(tokens_per_sample=0)


def test_count_flops_of_a_linear() -> None:
    lin = nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 32)
    assert count_flops(lambda: lin(x)) == 2 * 8 * 32 * 16


def test_memory_metrics_from_a_measured_step() -> None:
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()

    report = memfit.measure(step, model=model, optimizer=opt)
    m = memory_metrics(report)
    assert m["memory/peak_bytes"] == report.peak_bytes
    kinds = {k for k in m if k.startswith("memory/kind/")}
    assert kinds == {f"memory/kind/{k}" for k in report.by_kind}
    assert sum(m[k] for k in kinds) == report.peak_bytes
    assert "memory/dtype/float32" in m
    assert not any(k.startswith("memory/dtype/torch.") for k in m)
    assert m["memory/low_precision_share"] == report.low_precision_share
    assert memory_metrics(report.to_dict()) == m
    with pytest.raises(ConfigError):
        memory_metrics(object())


def test_engine_recompute_overhead_counts_every_micro_batch_of_a_step() -> None:
    """The plan's recompute FLOPs are one micro-batch's; a step of four micro-batches runs
    them four times, so its overhead equals that of one micro-batch of the same size."""
    from memfit.models import build_model

    overheads = {}
    for accumulation in (1, 4):
        torch.manual_seed(0)
        model, loss_fn, batch_fn = build_model(
            "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=16
        )
        engine = memfit.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            precision="fp32",
            checkpoint="full",
            accumulation_steps=accumulation,
            flops_per_sample=1e6,
            log_every=1,
        )
        engine.train_step(batch_fn(2 * accumulation, generator=0), loss_fn)
        assert engine.plan.recompute_flops > 0
        overheads[accumulation] = engine.metrics["recompute/overhead"]
        expected = engine.plan.recompute_flops * accumulation / (1e6 * 2 * accumulation)
        assert overheads[accumulation] == pytest.approx(expected, rel=1e-12)
    assert overheads[4] == pytest.approx(overheads[1], rel=1e-12)
