"""Gradients released in backward (Engine(release_gradients=), memfit.engine.release).

The updates are the usual step's, bitwise (torch's per-tensor optimizers, fp32 and
bf16-master); no moment holds every gradient (the tracker's peak of gradients is one
tensor's); the planned peak for ``zero_grad="in_backward"`` never under-predicts the
allocator's measurement; where releasing is not legal it is refused with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.errors import ConfigError
from memfit.memory import measure
from memfit.models.gpt import GPT, GPTConfig, chunked_gpt_loss, gpt_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt(batch: int = 4) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    return GPT(config), torch.randint(0, 256, (batch, 65))


_OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
}


@pytest.mark.parametrize("kind", list(_OPTIMIZERS))
@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_released_updates_are_the_usual_steps(kind: str, precision: str) -> None:
    trained = {}
    for release in (False, True):
        model, batch = _gpt()
        opt = _OPTIMIZERS[kind](model.parameters())
        engine = memfit.Engine(
            model, opt, precision=precision, release_gradients=release, monitor=False
        )
        losses = [float(engine.train_step(batch, gpt_loss)) for _ in range(3)]
        assert engine.settings.release_gradients is release
        trained[release] = (losses, [p.detach().clone() for p in model.parameters()])
    assert trained[True][0] == trained[False][0]
    assert all(torch.equal(a, b) for a, b in zip(trained[True][1], trained[False][1]))


def test_no_moment_holds_every_gradient() -> None:
    model, batch = _gpt(batch=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = memfit.Engine(model, opt, precision="fp32", release_gradients=True, monitor=False)
    engine.train_step(batch, gpt_loss)
    report = measure(lambda: engine.train_step(batch, gpt_loss), model=model, optimizer=opt)
    largest = max(p.numel() for p in model.parameters()) * 4
    every = sum(p.numel() for p in model.parameters()) * 4
    # About one tensor's gradient at a time (measured: the largest and a 2 KiB bias's,
    # made beside it), against all of them for a usual step.
    assert report.peak_by_kind["grads"] <= 1.05 * largest, (report.peak_by_kind["grads"], largest)
    assert largest < every / 4
    assert all(p.grad is None for p in model.parameters())


class _LSTMLanguageModel(torch.nn.Module):
    """Tokens through an embedding, two LSTM layers (the units) and a linear head over the
    vocabulary: the embedding and the head are trained outside every unit."""

    def __init__(self, vocab: int = 1024, width: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.LSTM(width, width, batch_first=True) for _ in range(2)
        )
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for lstm in self.layers:
            x = lstm(x)[0]
        return self.head(x)


def _lstm() -> tuple[_LSTMLanguageModel, torch.Tensor]:
    torch.manual_seed(0)
    return _LSTMLanguageModel(), torch.randint(0, 1024, (16, 65))


def _next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _chunked_gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=64)
    return GPT(config), torch.randint(0, 4096, (8, 65))


def _chunked_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return chunked_gpt_loss(model, batch, chunk_tokens=128)


#: The models of the measured steps, by name: a builder of the model and its batch, and
#: the loss.
_CASES = {
    "gpt": (_gpt, gpt_loss),
    "lstm": (_lstm, _next_token_loss),
    "chunked-gpt": (_chunked_gpt, _chunked_loss),
}


def _measured_step(
    release: bool, batch_size: int = 1, state: str = "fp32", case: str = "gpt"
) -> tuple[int, float]:
    """The allocator's peak of an Engine's step (after a warm-up step) and memfit.plan's
    prediction of it, for the Engine's optimizer (``state``: its optimizer state), on
    ``case`` (a name in ``_CASES``; the GPT at ``batch_size``), in a process of its own.

    In a test process that had run other tests, the 8-bit step at batch 4 once read 6,128
    bytes more than a fresh process reads it: 2,056 bytes above its prediction, which is
    4,080 bytes above the fresh reading. A fresh process reads the step as a user's first
    steps run it, and the same on every run."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch; torch.set_num_threads(1)\n"
        "from test_release import _step_here\n"
        f"print(json.dumps(_step_here({release!r}, {batch_size!r}, {state!r}, {case!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    measured, predicted = json.loads(out.stdout.strip().splitlines()[-1])
    return measured, predicted


def _step_here(release: bool, batch_size: int, state: str, case: str) -> tuple[int, float]:
    """:func:`_measured_step` in this process."""
    build, loss_fn = _CASES[case]
    model, batch = build(batch_size) if case == "gpt" else build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero_grad = "in_backward" if release else "before_forward"
    engine = memfit.Engine(
        model,
        opt,
        precision="fp32",
        release_gradients=release,
        optimizer_state=state,
        monitor=False,
        checkpoint="none",
    )
    opt = engine.optimizer
    plan = memfit.plan(model, batch, loss_fn, optimizer=opt, precision="fp32", zero_grad=zero_grad)
    # The warm-up runs under the allocator's profiler too: what it leaves for the measured
    # step to free (the last loss, the Engine's records) is freed at its own size, not at
    # the size of an older block at the same address (allocator_peak's notes).
    allocator_peak(lambda: engine.train_step(batch, loss_fn))
    opt.zero_grad(set_to_none=True)
    measured = allocator_peak(
        lambda: engine.train_step(batch, loss_fn),
        live=[*model.parameters(), *model.buffers(), *optimizer_tensors(opt), batch],
    ).peak_bytes
    return measured, plan.predicted_peak_bytes


def test_the_released_step_is_lower_and_never_under_predicted() -> None:
    usual, usual_predicted = _measured_step(False)
    released, predicted = _measured_step(True)
    # A small batch, whose usual peak is the optimizer step with every gradient: lower.
    assert released < usual, (released, usual)
    assert abs(usual_predicted - usual) <= 0.03 * usual
    # Each moment of backward is charged the update the profiled step made there: over,
    # never under (measured +0.06% here).
    assert released <= predicted <= 1.05 * released, (released, predicted)


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_a_released_step_whose_peak_is_activations_is_predicted_within_ten_percent(
    state: str,
) -> None:
    # Batch 4: the updates run while activations are held. Measured +0.0% (fp32 state)
    # and +2.2% (8-bit); +7.5% and +10.6% when every moment of backward was charged the
    # largest tensor's update, the head of backward's too, which updates none of them.
    released, predicted = _measured_step(True, batch_size=4, state=state)
    assert released <= predicted <= 1.10 * released, (released, predicted)


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_an_update_outside_the_units_is_charged_at_its_own_moment(state: str) -> None:
    # The LM head's weight is updated once the logits' gradient is freed, the embedding's
    # at the end of backward: the head of backward's peak holds neither update. Charged
    # there as well, the step was predicted +14.0% over with 8-bit state (+4.3% with
    # fp32 state); at the moments the profile noted, +0.05%.
    released, predicted = _measured_step(True, state=state, case="lstm")
    assert released <= predicted <= 1.01 * released, (released, predicted)


def test_updates_a_chunked_loss_makes_outside_the_models_forward_are_charged_at_their_moments() -> (
    None
):
    # chunked_gpt_loss runs the head and the embedding itself: their gradients are
    # accumulated under the loss's ops, whose moments the step notes for the model. Charged
    # at the head of backward instead (no moment), the 8-bit step was predicted +67% over.
    released, predicted = _measured_step(True, state="8bit", case="chunked-gpt")
    # Measured 28 bytes under: the update's few scalars at the end of backward.
    assert abs(predicted / released - 1) <= 0.01, (released, predicted)


def test_a_non_finite_gradient_leaves_its_parameter_and_counts_as_skipped() -> None:
    model, batch = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = memfit.Engine(
        model, opt, precision="fp32", release_gradients=True, monitor=False, log_every=1
    )
    before = [p.detach().clone() for p in model.parameters()]
    engine.train_step(batch, lambda m, b: gpt_loss(m, b) * float("inf"))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.scaler.stats.skipped == 1
    assert not opt.state  # no update made any state


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"accumulation_steps": 2}, "gradient accumulation"),
        ({"clip_grad_norm": 1.0}, "clip_grad_norm"),
        ({"precision": "fp16-mixed"}, "loss scaling"),
    ],
    ids=["accumulation", "clip", "fp16"],
)
def test_where_it_is_not_legal_it_says_why(settings: dict, why: str) -> None:
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    arguments = {"precision": "fp32", "monitor": False, **settings}
    with pytest.raises(ConfigError, match=why):
        memfit.Engine(model, opt, release_gradients=True, **arguments)
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    engine = memfit.Engine(model, torch.optim.AdamW(model.parameters()), **arguments)
    assert engine.settings.release_gradients is False
    auto = memfit.Engine(*_gpt()[:1], opt, release_gradients="auto", **arguments)
    assert auto.settings.release_gradients is False  # "auto": on only where legal
    with pytest.raises(ConfigError, match="release_gradients must be"):
        memfit.Engine(*_gpt()[:1], opt, release_gradients="yes", precision="fp32")


def test_a_refused_engine_leaves_the_model_and_the_optimizer_as_they_were() -> None:
    model, _ = _gpt()
    before = [p.dtype for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="gradient accumulation"):
        memfit.Engine(
            model, adamw, precision="bf16-master", release_gradients=True, accumulation_steps=2
        )
    rmsprop = torch.optim.RMSprop(model.parameters())
    with pytest.raises(ConfigError, match="a RMSprop is not one of them"):
        memfit.Engine(model, rmsprop, precision="bf16-master", optimizer_state="8bit")
    # No fp32 masters were made, no weight was cast, no step was replaced.
    for opt in (adamw, rmsprop):
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
        assert "step" not in vars(opt)
    assert [p.dtype for p in model.parameters()] == before
