"""An LSTM's CPU kernel (oneDNN) saves a workspace for backward that a step on fake tensors
does not see; the estimator puts the measured size back (memfit.checkpoint.profiler.rnn).
Bytes are compared, never times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.candidates import meta_clone, rank_candidates
from memfit.checkpoint.profiler.measure import profile
from memfit.checkpoint.profiler.rnn import lstm_workspaces, workspace_fit
from memfit.engine import Engine
from memfit.models import build_model
from memfit.precision.apply import precision_applied
from memfit.precision.kernels import assumed_kernels, kernel_device
from memfit.precision.policy import PrecisionPolicy

CFG = dict(n_embd=64, hidden_size=128, n_layer=2, seq_len=64)


def _lstm_parts():
    _, loss_fn, batch_fn = build_model("lstm", data="synthetic", **CFG)
    return (lambda: build_model("lstm", data="synthetic", **CFG).model), batch_fn, loss_fn


class _Recurrent(nn.Module):
    """Two recurrent layers of a kind given, then a linear head."""

    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.first = kind(32, 64, batch_first=True)
        self.second = kind(64, 64, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)[0])[0])


def _saved_by_unit(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, int], dict[str, int]]:
    """Each unit's saved bytes, profiled on real tensors and on fake ones (a meta copy)."""
    units = ["first", "second"]
    real = profile(model, x, loss_fn=lambda out: out.float().pow(2).mean(), units=units)
    fake = profile(
        meta_clone(model),
        x.to("meta"),
        loss_fn=lambda out: out.float().pow(2).mean(),
        units=units,
        fake_device="cpu",
    )
    return (
        {u.name: u.total_saved_bytes() for u in real.root.walk()},
        {u.name: u.total_saved_bytes() for u in fake.root.walk()},
    )


def test_a_fake_step_saves_what_the_lstm_kernel_saves() -> None:
    torch.manual_seed(0)
    model = _Recurrent(nn.LSTM)
    real, fake = _saved_by_unit(model, torch.randn(16, 64, 32))
    for name in ("first", "second"):
        # Without the measured workspace the fake step saved a seventh of it or less.
        assert fake[name] == pytest.approx(real[name], rel=0.03), name


def test_gru_saves_alike_on_fake_and_real_tensors_and_is_left_alone() -> None:
    torch.manual_seed(0)
    model = _Recurrent(nn.GRU)
    real, fake = _saved_by_unit(model, torch.randn(8, 16, 32))
    assert fake["first"] == real["first"] and fake["second"] == real["second"]


def test_the_workspace_grows_with_batch_times_steps_and_only_cpu_fakes_get_it() -> None:
    fit = workspace_fit(nn.LSTM(32, 64, batch_first=True))
    assert fit is not None and fit.b > 0
    assert fit.bytes(4096) > 3.9 * fit.bytes(1024) > 0
    model = _Recurrent(nn.LSTM)
    with lstm_workspaces(model, "cuda"):  # a GPU's kernel is not measured on the CPU
        assert not model.first._forward_hooks
    with lstm_workspaces(model, "cpu"):
        assert len(model.first._forward_hooks) == 1
    assert not model.first._forward_hooks  # removed afterwards


def test_the_tuners_search_predicts_an_lstm_steps_peak() -> None:
    model_fn, batch_fn, loss_fn = _lstm_parts()
    ranked = rank_candidates(
        model_fn,
        lambda n: batch_fn(n, generator=0),
        loss_fn,
        budget=2**40,
        global_batch=16,
        precisions=["fp32"],
        strategies=["none"],
    )
    predicted = next(c for c in ranked if c.micro_batch == 16).predicted_peak_bytes
    torch.manual_seed(0)
    model = model_fn()
    engine = Engine(model, torch.optim.AdamW(model.parameters()), precision="fp32", monitor=False)
    batch = batch_fn(16, generator=0)
    engine.train_step(batch, loss_fn)
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(engine.optimizer), batch]
    measured = allocator_peak(lambda: engine.train_step(batch, loss_fn), live).peak_bytes
    engine.close()
    # Before the workspace was put back: 8.55 MiB predicted, 24.58 MiB measured (-65%).
    assert predicted == pytest.approx(measured, rel=0.05)


def test_a_meta_lstm_is_the_island_the_cpu_will_train_and_keeps_its_workspace() -> None:
    """A CPU without a bf16 LSTM kernel trains the LSTM as an fp32 island; a meta model
    standing for that CPU is planned the same way, workspace included."""
    meta = meta_clone(_Recurrent(nn.LSTM))
    policy = PrecisionPolicy("bf16-mixed")
    if torch.cuda.is_available():
        pytest.skip("a meta model stands for the GPU here")
    with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM",)):
        assert policy.is_island(meta.first) and kernel_device(meta) == torch.device("cpu")
        with precision_applied(meta, policy):  # as the estimator profiles it
            prof = profile(
                meta,
                torch.empty(16, 64, 32, device="meta"),
                loss_fn=lambda out: out.float().pow(2).mean(),
                precision=policy,
                units=["first", "second"],
                fake_device="cpu",
            )
    fit = workspace_fit(nn.LSTM(32, 64, batch_first=True))  # the fp32 kernel's workspace
    assert fit is not None
    assert prof["first"].total_saved_bytes() >= fit.bytes(16 * 64)
    with assumed_kernels("cpu", torch.bfloat16):  # a CPU with the kernel: no island
        assert not policy.is_island(meta.first)
