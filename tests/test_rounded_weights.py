"""bf16 weights without fp32 masters (precision="bf16-sr"): stochastic rounding of the update.

The rounding is checked for its two neighbours and its mean; an update under the last bit
of a bf16 weight against torch's plain rounding, which loses it; the Engine's run (no
masters, fp32 or 8-bit state, islands updated as torch does), its memory predicted and
allocator-measured, its refusals, and a run saved and resumed bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.step_memory import static_bytes
from memfit.distributed.state_files import read_state
from memfit.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision.optimizer_state import low_bit_state, rounds_weights, state_bits
from memfit.precision.state_codes import draws, round_weight
from tests.engine_cases import assert_bitwise, saved_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rounding_takes_a_neighbour_and_is_unbiased() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 10.0
    low = x.to(torch.bfloat16)  # round to nearest: one of the two neighbours
    samples = torch.stack(
        [round_weight(x, torch.rand(draws(x.numel()), generator=g)).float() for _ in range(200)]
    )
    below = torch.where(low.float() <= x, low.float(), torch.nextafter(low, -low.abs() - 1).float())
    step = (x.abs() * 2.0**-7).clamp(min=1e-30)  # bf16 keeps 8 bits: 2**-7 of the value
    # Every sample is the bf16 number at or below the value or the next one above it.
    assert bool(((samples - below) >= 0).all())
    assert bool(((samples - below) <= 2 * step).all())
    # The mean of 200 roundings lands within a tenth of the gap (nearest: up to half).
    gap = (samples.max(0).values - samples.min(0).values).clamp(min=1e-30)
    assert ((samples.mean(0) - x).abs() / gap).median() < 0.1
    # Not a number or infinite: kept as it is.
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    kept = round_weight(special, torch.rand(draws(3), generator=g)).float()
    assert kept[0] == float("inf") and kept[1] == -float("inf") and kept[2].isnan()


def _tiny_updates(rounded: bool) -> torch.Tensor:
    """A bf16 weight of 1.0 moved 200 times by 1e-4, a 40th of its last bit (2**-7)."""
    weight = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = torch.optim.SGD([weight], lr=1e-4)
    if rounded:
        low_bit_state(opt, "fp32", rounded_weights=True)
    for _ in range(200):
        weight.grad = torch.ones_like(weight)
        opt.step()
    return weight.detach().float()


def test_an_update_under_the_last_bit_is_kept_on_average() -> None:
    # torch's own step rounds 1.0 - 1e-4 back to 1.0: two hundred updates are lost.
    assert bool((_tiny_updates(rounded=False) == 1.0).all())
    # Rounded stochastically, the weights move by 0.02 on average, as fp32 ones would.
    mean = float(_tiny_updates(rounded=True).mean())
    assert mean == pytest.approx(1.0 - 200 * 1e-4, abs=2e-3)


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
    return GPT(config), torch.randint(0, 128, (4, 33))


@pytest.mark.parametrize("bits", ["fp32", "8bit"])
def test_the_engine_trains_bf16_weights_without_masters(bits: str) -> None:
    model, batch = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = memfit.Engine(
        model, opt, precision="bf16-sr", optimizer_state=bits, checkpoint="none", monitor=False
    )
    assert engine.master is None and rounds_weights(opt) and state_bits(opt) == bits
    # The optimizer updates the model's own tensors: bf16, but for the fp32 islands.
    islands = {
        id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
    }
    for p in opt.param_groups[0]["params"]:
        assert any(p is q for q in model.parameters())
        assert p.dtype == (torch.float32 if id(p) in islands else torch.bfloat16)
    losses = [float(engine.train_step(batch, gpt_loss)) for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses
    moment = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    if bits == "fp32":  # torch's own layout, fp32 beside a bf16 weight
        assert (
            moment.dtype == torch.float32 and moment.shape == opt.param_groups[0]["params"][0].shape
        )
    else:
        assert moment["codes"].dtype == torch.int8


def test_fp32_islands_step_as_torch_does() -> None:
    # A LayerNorm's weights stay fp32 under bf16-sr and are updated in place, torch's
    # arithmetic: after one step, bitwise torch's foreach=False AdamW on the same gradients.
    torch.manual_seed(0)
    norm = nn.LayerNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
    grads = [torch.randn_like(p) for p in norm.parameters()]
    ours = nn.LayerNorm(64)
    ours.load_state_dict(norm.state_dict())
    theirs = torch.optim.AdamW(norm.parameters(), lr=1e-2, foreach=False)
    mine = low_bit_state(
        torch.optim.AdamW(ours.parameters(), lr=1e-2), "fp32", rounded_weights=True
    )
    for opt, module in ((theirs, norm), (mine, ours)):
        for p, g in zip(module.parameters(), grads):
            p.grad = g.clone()
        opt.step()
    assert_bitwise(ours.state_dict(), norm.state_dict())


def test_memory_predicted_and_measured() -> None:
    model, batch = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = memfit.Engine(model, opt, precision="bf16-sr", checkpoint="none", monitor=False)
    n = sum(p.numel() for p in model.parameters())
    islands = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
    )
    static = static_bytes(model, engine.policy, opt)
    # bf16 weights and gradients (fp32 in the islands), no masters, fp32 AdamW moments.
    assert static.params == 2 * n + 2 * islands and static.grads == static.params
    tensors = len(list(model.parameters()))
    assert static.masters == 0 and static.optimizer_state == 8 * n + 4 * tensors  # and steps
    step = lambda: engine.train_step(batch, gpt_loss)  # noqa: E731
    step()
    plan = memfit.plan(model, batch, gpt_loss, precision="bf16-sr", optimizer=opt)
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), batch]
    measured = allocator_peak(step, live=live).peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.10 * measured, (
        plan.predicted_peak_bytes,
        measured,
    )


def _run(path: Path, bits: str, steps: int, resume: bool = False) -> list[float]:
    model, batch = _gpt()
    kwargs = {"precision": "bf16-sr", "optimizer_state": bits, "checkpoint": "none"}
    return saved_run(path, model, batch, gpt_loss, steps, resume, **kwargs)


@pytest.mark.parametrize("bits", ["fp32", "8bit"])
def test_a_run_resumes_bitwise(tmp_path: Path, bits: str) -> None:
    path = tmp_path / "state.pt"
    whole = _run(path, bits, 3)
    resumed = _run(path, bits, 3, resume=True)
    assert resumed == whole[3:]
    saved = read_state(path)
    assert saved["settings"]["precision"] == "bf16-sr"
    if bits == "fp32":  # the fp32 moments of bf16 weights were not cast on load
        moments = [s["exp_avg"] for s in saved["optimizer"]["state"].values()]
        assert all(m.dtype == torch.float32 for m in moments)


@pytest.mark.parametrize(
    ("make", "settings", "match"),
    [
        (torch.optim.AdamW, {"accumulation_steps": 2}, "sum micro-batches in bf16"),
        (torch.optim.AdamW, {"micro_batch": "auto"}, "micro_batch='auto'"),
        (torch.optim.RMSprop, {}, "RMSprop is not one of them"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), {}, "amsgrad=True"),
    ],
    ids=["accumulation", "auto-micro-batch", "rmsprop", "amsgrad"],
)
def test_what_it_cannot_train_is_refused_before_anything_changes(make, settings, match) -> None:
    model, _ = _gpt()
    opt = make(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=match):
        memfit.Engine(model, opt, precision="bf16-sr", monitor=False, **settings)
    assert_bitwise(model.state_dict(), before)
    assert not rounds_weights(opt) and "step" not in opt.__dict__


def test_an_eight_bit_run_resumes_with_fp32_state(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    whole = _run(path, "8bit", 3)
    model, batch = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = memfit.Engine.resume(path, model, opt, optimizer_state="fp32", monitor=False)
    assert rounds_weights(opt) and state_bits(opt) == "fp32"
    # The codes decoded to fp32 moments beside the bf16 weights, not to bf16 ones.
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    losses = [float(engine.train_step(batch, gpt_loss)) for _ in range(3)]
    # The first step after it updates from the moments the 8-bit run read: the loss after
    # it is the 8-bit run's; the next ones round the moments no more (close).
    assert losses[:2] == whole[3:5]
    assert losses[2] == pytest.approx(whole[5], rel=1e-2)
