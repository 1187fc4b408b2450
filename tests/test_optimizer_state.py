"""Optimizer state in fewer bits (memfit.precision.optimizer_state, Engine(optimizer_state=)).

The 8-bit codes are checked against their levels exactly; the update against torch's own
optimizers on the first step (bitwise: the same formula on the same fp32 values) and over
a run (close); the memory allocator-measured on a GPT, a Hugging Face GPT-2 and a CNN
against the prediction; a run saved and resumed bitwise.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes
from memfit.distributed.state_files import read_state
from memfit.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.resnet import ResNet, ResNetConfig, resnet_loss
from memfit.precision.optimizer_state import (
    fp32_state_dict,
    low_bit_state,
    state_bits,
    step_temp_bytes,
)
from memfit.precision.state_codes import (
    BLOCK,
    CHUNK,
    FIRST_MOMENT_OCTAVES,
    dequantize,
    draws,
    quantize,
    read,
)
from tests.engine_cases import assert_bitwise, saved_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _values(n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_round_to_a_neighbouring_level(signed: bool) -> None:
    x = _values()
    x = x if signed else x.abs()
    q = quantize(x, signed, draw=None)
    assert q["codes"].dtype == (torch.int8 if signed else torch.uint8)
    assert q["codes"].numel() == -(-x.numel() // BLOCK) * BLOCK
    back = dequantize(q, x.shape)
    assert back.shape == x.shape
    # Two levels are 2**(octaves / (levels - 1)) apart, 11.6% (signed: 20 octaves over 126
    # steps; unsigned: 40 over 254): rounded to the nearer, within half of that.
    blocks = x.abs().view(-1, BLOCK) if x.numel() % BLOCK == 0 else None
    scale = x.abs().max()
    big = x.abs() >= scale * 2.0**-FIRST_MOMENT_OCTAVES
    relative = ((back - x).abs() / x.abs())[big]
    assert relative.max() < 0.06, relative.max()
    assert torch.equal(back.sign(), x.sign()) or blocks is None
    # The largest of each block is kept exactly (it is the scale).
    assert back.abs().max() == scale


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_stochastic_rounding_is_unbiased(signed: bool) -> None:
    x = _values(1024, seed=1)
    x = x if signed else x.abs()
    g = torch.Generator().manual_seed(0)
    samples = [
        dequantize(quantize(x, signed, torch.rand(draws(x.numel()), generator=g)), x.shape)
        for _ in range(400)
    ]
    stacked = torch.stack(samples)
    # Each draw is one of the two levels around the value, the mean close to it: after
    # 400 draws the error is a few tenths of a percent where one rounding errs by up to 6%.
    nearest = dequantize(quantize(x, signed, None), x.shape)
    mean_error = ((stacked.mean(0) - x).abs() / x.abs()).median()
    one_error = ((nearest - x).abs() / x.abs()).median()
    assert mean_error < one_error / 5, (mean_error, one_error)


def _regression(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 300), nn.GELU(), nn.Linear(300, 1))
    x = torch.randn(512, 32)
    return model, x, x[:, :4].sum(1, keepdim=True).sin()


_OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam-l2": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "adam-maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "sgd-dampened": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
}


def _train(kind: str, bits: str, steps: int) -> tuple[nn.Module, float]:
    model, x, y = _regression()
    opt = low_bit_state(_OPTIMIZERS[kind](model.parameters()), bits)
    sign = -1.0 if kind == "adam-maximize" else 1.0
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        (sign * loss).backward()
        opt.step()
    return model, float(loss.detach())


@pytest.mark.parametrize("kind", list(_OPTIMIZERS))
@pytest.mark.parametrize("bits", ["8bit", "bf16"])
def test_the_first_step_is_torchs_own(kind: str, bits: str) -> None:
    # The first update is made from fp32 moments, before they are stored: the same
    # arithmetic as torch's single-tensor implementation, so the same bits.
    ours, _ = _train(kind, bits, 1)
    model, x, y = _regression()
    opt = _OPTIMIZERS[kind](model.parameters())
    for group in opt.param_groups:
        group["foreach"] = False
    sign = -1.0 if kind == "adam-maximize" else 1.0
    opt.zero_grad()
    (sign * (model(x) - y).pow(2).mean()).backward()
    opt.step()
    assert_bitwise(ours.state_dict(), model.state_dict(), kind)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("kind", ["adamw", "adam-l2", "sgd-nesterov"])
@pytest.mark.parametrize(("bits", "apart"), [("8bit", 0.15), ("bf16", 0.02)])
def test_a_run_follows_torchs_own(kind: str, bits: str, apart: float) -> None:
    start = _flat(_regression()[0])
    fp32, fp32_loss = _train(kind, "fp32", 150)
    low, low_loss = _train(kind, bits, 150)
    _, first_loss = _train(kind, "fp32", 1)
    # After 150 steps the low-bit run's weights are within ``apart`` of the fp32 run's,
    # relative to how far that run moved them (measured: 8-bit 0.10-0.12, bf16 0.006-0.013;
    # the rounding is random, seeded), and both losses fell by over 90%.
    distance = (_flat(low) - _flat(fp32)).norm() / (_flat(fp32) - start).norm()
    assert distance <= apart, distance
    assert low_loss < 0.1 * first_loss and fp32_loss < 0.1 * first_loss


def test_the_state_is_what_it_says() -> None:
    model, x, y = _regression()
    opt = low_bit_state(torch.optim.AdamW(model.parameters()), "8bit")
    assert state_bits(opt) == "8bit"
    assert low_bit_state(opt, "8bit") is opt  # converting again changes nothing
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    weight = model[0].weight
    state = opt.state[weight]
    assert state["exp_avg"]["codes"].dtype == torch.int8
    assert state["exp_avg_sq"]["codes"].dtype == torch.uint8
    blocks = -(-weight.numel() // BLOCK)
    assert state["exp_avg"]["scale"].numel() == blocks


# Every kind of group the converted step treats apart: moments (Adam's two, SGD's one or
# none), Nesterov's separate step, the gradient copies of maximize and weight decay.
_GROUPS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam-l2-maximize": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, maximize=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-3),
    "sgd-decay-maximize": lambda p: torch.optim.SGD(p, lr=1e-3, weight_decay=0.1, maximize=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, dampening=0.1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("kind", list(_GROUPS))
@pytest.mark.parametrize(
    ("bits", "dtype"),
    [
        ("8bit", torch.float32),
        ("8bit", torch.bfloat16),
        ("bf16", torch.float32),
        ("fp32", torch.bfloat16),
    ],
    ids=["8bit", "8bit-rounded", "bf16", "fp32-rounded"],
)
@pytest.mark.parametrize(
    "sizes",
    [(BLOCK * 100,), (BLOCK * 100 + 17,), (BLOCK * 100, BLOCK * 99 + 17), (CHUNK * 2 + 300,)],
    ids=["blocks", "part-block", "two", "three-pieces"],
)
def test_the_steps_temporaries_are_counted_as_the_allocator_sees_them(
    kind: str, bits: str, dtype: torch.dtype, sizes: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]
    opt = low_bit_state(_GROUPS[kind](params), bits, rounded_weights=dtype != torch.float32)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state made: the next step holds only its temporaries above it
    measured = allocator_peak(
        opt.step, live=[*params, *(p.grad for p in params), *optimizer_tensors(opt)]
    )
    above = measured.peak_bytes - measured.start_bytes
    predicted = step_temp_bytes(opt)
    assert predicted is not None
    # Never below; exact for whole blocks; a part block is counted whole (at most its 255
    # missing elements, 37 bytes an element at the most).
    slack = 0 if all(n % BLOCK == 0 for n in sizes) else 37 * (BLOCK - 1)
    assert above <= predicted <= above + slack, (predicted, above)


def test_fp32_state_held_before_is_converted_and_a_saved_low_bit_state_read_back() -> None:
    model, x, y = _regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    before = opt.state[model[0].weight]["exp_avg"].clone()
    low_bit_state(opt, "8bit")
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()  # the fp32 moments are converted, not dropped: the step count goes on
    state = opt.state[model[0].weight]
    assert int(state["step"]) == 4
    assert isinstance(state["exp_avg"], dict)
    # Read back into an optimizer with torch's own state: fp32 moments again, those the
    # codes stand for (the 8-bit codes survive load_state_dict's cast to fp32).
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(fp32_state_dict(fresh, saved))
    moment = fresh.state[model[0].weight]["exp_avg"]
    assert moment.dtype == torch.float32 and moment.shape == before.shape
    assert torch.equal(moment.flatten(), read(state["exp_avg"], "8bit", 0, moment.numel()))
    fresh.step()  # torch's own step runs on it
    # And into a converted optimizer: the codes bitwise as saved.
    again = low_bit_state(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit")
    again.load_state_dict(saved)
    kept = again.state[model[0].weight]["exp_avg"]
    assert torch.equal(kept["codes"], state["exp_avg"]["codes"])
    assert torch.equal(kept["scale"], state["exp_avg"]["scale"])


def test_a_scheduler_made_before_keeps_working() -> None:
    model, x, y = _regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    low_bit_state(opt, "8bit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it sees no optimizer step
        for _ in range(2):
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: torch.optim.RMSprop(p), "a RMSprop is not one of them"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad=True"),
    ],
    ids=["rmsprop", "amsgrad"],
)
def test_what_it_cannot_keep_is_refused(make, match: str) -> None:
    model, _, _ = _regression()
    with pytest.raises(ConfigError, match=match):
        low_bit_state(make(model.parameters()), "8bit")
    with pytest.raises(ConfigError, match="optimizer_state must be one of"):
        low_bit_state(torch.optim.AdamW(model.parameters()), "4bit")
    with pytest.raises(ConfigError, match="FSDP2"):
        low_bit_state(torch.optim.AdamW(model.parameters()), "8bit", "fsdp")


def _gpt() -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    return GPT(config), torch.randint(0, 256, (4, 65)), gpt_loss


def _hf_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor], object]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, tie_word_embeddings=True
    )
    ids = torch.randint(0, 512, (4, 64))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}, None


def _resnet() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    torch.manual_seed(0)
    model = ResNet(ResNetConfig(widths=(32, 64, 128), blocks_per_stage=(1, 1, 1)))
    return model, (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))), resnet_loss


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@pytest.mark.parametrize("case", [_gpt, _hf_gpt2, _resnet], ids=["gpt", "hf-gpt2", "resnet"])
def test_eight_bit_state_measured_and_predicted(case) -> None:
    model, batch, loss_fn = case()
    loss_fn = loss_fn or _hf_loss
    opt = low_bit_state(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    predicted_state = optimizer_state_bytes(opt)
    plan = memfit.plan(model, batch, loss_fn, optimizer=opt, precision="fp32")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()

    step()
    state = optimizer_state_bytes(opt, predict=False, storages=True)
    # At most 2.5 bytes a parameter (fp32 AdamW: 8), and as predicted before the first step.
    assert state <= 2.5 * params, state / params
    assert abs(predicted_state - state) <= 0.01 * state
    # The whole step, the allocator's count from the weights, the state and the batch
    # (the last gradients freed before: the profiler sees no free of what it did not see
    # allocated), within 10% of the step predicted before it.
    opt.zero_grad(set_to_none=True)
    measured = allocator_peak(
        step, live=[*model.parameters(), *model.buffers(), *optimizer_tensors(opt), batch]
    ).peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
        plan.predicted_peak_bytes,
        measured,
    )


def _engine_run(path: Path, bits: str, steps: int, resume: bool = False) -> list[float]:
    model, batch, loss_fn = _gpt()
    kwargs = {"precision": "bf16-master", "optimizer_state": bits}
    return saved_run(path, model, batch, loss_fn, steps, resume, **kwargs)


@pytest.mark.parametrize("bits", ["8bit", "bf16"])
def test_an_engine_run_resumes_bitwise(tmp_path: Path, bits: str) -> None:
    path = tmp_path / "state.pt"
    whole = _engine_run(path, bits, 3)
    resumed = _engine_run(path, bits, 3, resume=True)
    assert resumed == whole[3:]
    assert read_state(path)["settings"]["optimizer_state"] == bits


def test_a_low_bit_run_resumes_with_torchs_own_state(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    whole = _engine_run(path, "8bit", 3)
    model, batch, loss_fn = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = memfit.Engine.resume(path, model, opt, optimizer_state="fp32", monitor=False)
    assert state_bits(opt) == "fp32"
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())
    losses = [float(engine.train_step(batch, loss_fn)) for _ in range(3)]
    # The moments go on from the saved codes: the first step after it updates from the
    # same fp32 moments as the 8-bit run did (the loss after it bitwise the same; from
    # fresh moments it read 4.25 against 4.17), the next rounds no more (within 0.1%).
    assert losses[:2] == whole[3:5]
    assert losses[2] == pytest.approx(whole[5], rel=1e-3)


def test_the_callbacks_refuse_what_they_cannot_keep() -> None:
    from memfit.integrations.common import check_optimizer_state, keep_optimizer_state

    with pytest.raises(ConfigError, match="optimizer_state must be one of"):
        check_optimizer_state("4bit")
    with pytest.raises(ConfigError, match="has none"):
        keep_optimizer_state(None, "8bit")
    keep_optimizer_state(None, "fp32")  # nothing to convert, nothing asked
    model, _, _ = _regression()
    opt = torch.optim.AdamW(model.parameters())
    keep_optimizer_state(opt, "bf16")
    assert state_bits(opt) == "bf16"


def test_the_estimate_counts_the_state_it_is_told() -> None:
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)

    def batch(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, 65))

    rows = {
        bits: memfit.estimate(
            lambda: GPT(config),
            batch,
            gpt_loss,
            batch_size=4,
            precisions=["fp32"],
            strategies=["none"],
            optimizer_state=bits,
        ).rows[0]
        for bits in ("fp32", "8bit")
    }
    params = sum(p.numel() for p in GPT(config).parameters())
    assert rows["fp32"].parts["optimizer"] >= 8 * params
    assert rows["8bit"].parts["optimizer"] <= 2.5 * params
    # The fake step's estimate against the real step, allocator-measured (the GPT case of
    # the test above): within 10%.
    model, data, _ = _gpt()
    opt = low_bit_state(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        gpt_loss(model, data).backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    measured = allocator_peak(
        step, live=[*model.parameters(), *model.buffers(), *optimizer_tensors(opt), data]
    ).peak_bytes
    assert abs(rows["8bit"].peak_bytes - measured) <= 0.10 * measured, (
        rows["8bit"].peak_bytes,
        measured,
    )
