"""Activation storage: saved tensors coded per unit (bf16, fp8, offload), and the planner's
choice of it under a budget. Memory is the allocator's (torch.profiler on CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak, storage_bytes
from memfit.checkpoint import storage_stage
from memfit.checkpoint.api import make_plan
from memfit.checkpoint.costs import COUNTED_BANDWIDTH
from memfit.checkpoint.storage import (
    Codable,
    apply_storage,
    int8_decode,
    int8_encode,
    remove_storage,
    stored_units,
)
from memfit.errors import ConfigError, PlanError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.resnet import ResNet, ResNetConfig


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=128, dropout=0.1)
    return GPT(cfg), torch.randint(0, 256, (8, 64))


def _gpt_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ResNet(ResNetConfig()), torch.randn(16, 3, 32, 32)


def _resnet_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logsumexp(-1).mean()


def _blocks(model: nn.Module) -> list[str]:
    if isinstance(model, GPT):
        return [f"blocks.{i}" for i in range(len(model.blocks))]
    return [n for n, m in model.named_modules() if type(m).__name__ == "BasicBlock"]


def _grads(model: nn.Module, x: torch.Tensor, loss_fn) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every run
    loss_fn(model, x).backward()
    return [p.grad.clone() for p in model.parameters()]


def _relative_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(got, exact))
    return (diff / sum(float(b.pow(2).sum()) for b in exact)) ** 0.5


def _held_after_forward(model: nn.Module, x: torch.Tensor, loss_fn) -> int:
    """The allocator's bytes held by the end of forward (what is saved for backward,
    the loss), above the parameters and the batch."""

    def forward() -> torch.Tensor:
        torch.manual_seed(1)
        return loss_fn(model, x)

    forward()  # a first run allocates what later ones reuse
    peak = allocator_peak(forward, live=[*model.parameters(), x], live_complete=True)
    assert peak.end_bytes is not None
    return peak.end_bytes - peak.start_bytes


@pytest.mark.parametrize("family", ["gpt", "resnet"])
def test_stored_units_keep_or_offload_give_bitwise_gradients(family: str) -> None:
    model, x = _gpt() if family == "gpt" else _resnet()
    loss_fn = _gpt_loss if family == "gpt" else _resnet_loss
    exact = _grads(model, x, loss_fn)
    # Offload's code path on a CPU: the host is the device, the copies come back as sent.
    for kind in ("keep", "offload"):
        apply_storage(model, {u: kind for u in _blocks(model)})
        got = _grads(model, x, loss_fn)
        remove_storage(model)
        assert all(torch.equal(a, b) for a, b in zip(got, exact)), kind
    assert stored_units(model) == {}


@pytest.mark.parametrize("family", ["gpt", "resnet"])
def test_fp8_and_int8_storage_hold_far_less_at_the_same_recompute(
    family: str,
) -> None:
    model, x = _gpt() if family == "gpt" else _resnet()
    loss_fn = _gpt_loss if family == "gpt" else _resnet_loss
    exact = _grads(model, x, loss_fn)
    plain = _held_after_forward(model, x, loss_fn)
    held: dict[str, int] = {}
    errors: dict[str, float] = {}
    for kind in ("bf16", "int8", "fp8"):
        apply_storage(model, {u: kind for u in _blocks(model)})
        held[kind] = _held_after_forward(model, x, loss_fn)
        errors[kind] = _relative_error(_grads(model, x, loss_fn), exact)
        remove_storage(model)
    # Nothing is recomputed in any step; fp8 codes fp32 activations in a quarter, int8 in
    # a quarter and its blocks' scales (a sixteenth of that).
    assert held["fp8"] <= 0.6 * plain, (family, held, plain)
    assert held["fp8"] < held["int8"] < held["bf16"] < plain
    assert held["int8"] <= 0.62 * plain, (family, held, plain)
    # int8's 64-element blocks keep each block's range: less error than fp8's 3 mantissa
    # bits under one scale a tensor (about bf16's: 3.4e-3 against 3.6e-3 on a larger GPT).
    assert 0 < errors["bf16"] < errors["fp8"] < 0.05, errors
    assert 0 < errors["int8"] < errors["fp8"], errors


def test_int8_codes_round_each_block_to_its_own_range() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-3, 3, 1000)  # blocks 6 decades apart
    x[7] = 0.0
    codes, scales = int8_encode(x)
    back = int8_decode(codes, scales, x.shape, x.dtype)
    assert codes.dtype == torch.int8 and codes.numel() == 1024 and scales.numel() == 16
    # Within half a level of each block's own largest magnitude, but for a value under
    # half a level, which keeps its sign at one level: zeros and signs come back exact
    # (ReLU's backward reads its mask off its saved output).
    amax = torch.nn.functional.pad(x.abs(), (0, 24)).view(-1, 64).amax(dim=1)
    level = (amax / 127).repeat_interleave(64)[:1000]
    tiny = x.abs() < level / 2
    assert torch.all((back - x)[~tiny].abs() <= level[~tiny] / 2 * (1 + 1e-6))
    assert torch.all((back - x)[tiny].abs() <= level[tiny] * (1 + 1e-6))
    assert torch.equal(back.sign(), x.sign()) and back[7] == 0.0 and tiny.sum() > 0
    # A non-finite block comes back NaN (the loss scaler's check sees it); the others exact
    # to their bound.
    x[70] = float("inf")
    back = int8_decode(*int8_encode(x), x.shape, x.dtype)
    assert back[64:128].isnan().all() and back[:64].isfinite().all()
    bf = int8_decode(*int8_encode(x[:64].bfloat16()), torch.Size([64]), torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.shape == (64,)


def test_storage_leaves_tensors_held_elsewhere_uncoded() -> None:
    """A saved tensor the caller still holds (the unit's input) is not coded: coding it
    would add a copy."""

    class Unit(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.sin() * 2).cos()

    model = nn.Sequential(Unit())
    x = torch.randn(256, 256, requires_grad=True)
    plain = _held_after_forward(model, x, lambda m, b: m(b).sum())
    apply_storage(model, {"0": "fp8"})
    coded = _held_after_forward(model, x, lambda m, b: m(b).sum())
    remove_storage(model)
    # sin saves x (held by the caller: stays), cos saves x.sin() * 2 (coded to a quarter).
    quarter = 256 * 256 * 4 // 4
    assert plain - coded == pytest.approx(3 * quarter, rel=0.01)


def test_apply_storage_refuses_what_no_training_could_use() -> None:
    model, _ = _gpt()
    with pytest.raises(ValueError, match="'int4'.*is not one of"):
        apply_storage(model, {"blocks.0": "int4"})
    with pytest.raises(ValueError, match="'blocks.9', which the model does not have"):
        apply_storage(model, {"blocks.9": "fp8"})
    plan = memfit.Plan(
        {"": "keep", "blocks.0": "recompute"}, storage={"blocks.0": "fp8"}, structure=None
    )
    with pytest.raises(PlanError, match="stores unit 'blocks.0' as 'fp8' and recomputes"):
        memfit.apply_plan(model, plan)
    assert stored_units(model) == {} and not memfit.checkpoint.is_applied(model)


def test_plan_json_keeps_its_storage() -> None:
    plan = memfit.Plan({"": "keep", "blocks.0": "keep"}, storage={"blocks.0": "fp8"})
    back = memfit.Plan.from_json(plan.to_json())
    assert back.storage == {"blocks.0": "fp8"} and back == plan
    assert "stored fp8" in plan.summary()
    bad = plan.to_json().replace('"fp8"', '"int4"')
    with pytest.raises(PlanError, match="storage"):
        memfit.Plan.from_json(bad)


def _counted_planner(
    model: nn.Module, x: torch.Tensor, loss_fn
) -> tuple[Callable[..., memfit.Plan], int]:
    """Plans of ``loss_fn(model, x)`` (fp32, AdamW) with counted costs, the same in every
    run whatever the machine's timings, and a budget at 75% of the unplanned peak."""
    opt = torch.optim.AdamW(model.parameters())

    def plan(**settings) -> memfit.Plan:
        return make_plan(
            model, x, loss_fn, precision="fp32", optimizer=opt, costs="counted", **settings
        ).plan

    return plan, int(plan().predicted_peak_bytes * 0.75)


@pytest.mark.parametrize("family", ["gpt", "resnet"])
@pytest.mark.usefixtures("free_coding")
def test_planner_stores_instead_of_recomputing_where_the_budget_needs_it(family: str) -> None:
    """On the ResNet the plain plan recomputes a segment of stages: no stored unit may lie
    in it. Coding is free here (the fixture): the next test weighs its time."""
    model, x = _gpt() if family == "gpt" else _resnet()
    plan, budget = _counted_planner(model, x, _gpt_loss if family == "gpt" else _resnet_loss)
    plain = plan(budget=budget)
    stored = plan(budget=budget, activation_storage=("keep", "recompute", "bf16", "fp8"))
    assert plain.recompute_flops > 0 and not plain.storage
    assert stored.storage and set(stored.storage.values()) <= {"bf16", "fp8"}
    assert stored.recompute_flops < plain.recompute_flops
    # Measured by the allocator on the example batch: within the budget, and the
    # prediction within 10% of it.
    assert stored.measured_peak_bytes is not None and stored.measured_peak_bytes <= budget
    error = stored.predicted_peak_bytes / stored.measured_peak_bytes - 1
    assert abs(error) <= 0.10, error
    # Only the units the budget needs are stored; none inside a recomputed one.
    assert len(stored.storage) <= len(_blocks(model))
    assert all(stored.decisions[u] == "keep" for u in stored.storage)
    for container, ranges in stored.segments.items():
        inside = {f"{container}.{i}" for a, b in ranges for i in range(a, b + 1)}
        assert not inside & set(stored.storage), (stored.segments, stored.storage)
    # A tolerance below every storage's measured error offers none: the plain plan.
    strict = plan(
        budget=budget,
        activation_storage=("keep", "recompute", "bf16", "fp8"),
        storage_tolerance=0.0,
    )
    assert not strict.storage and strict.decisions == plain.decisions


def test_the_planner_weighs_coding_time_against_the_recompute_it_saves() -> None:
    """Counted, the small GPT's block costs less to recompute (its FLOPs and bytes) than to
    code in fp8 and back: 3.04 ms of recompute without storage, against 0.2 ms of
    recompute and 4.82 ms of coding with one block in fp8. The plan stays the plain one."""
    plan, budget = _counted_planner(*_gpt(), _gpt_loss)
    plain = plan(budget=budget)
    stored = plan(budget=budget, activation_storage=("keep", "recompute", "bf16", "fp8"))
    assert plain.recompute_flops > 0
    assert not stored.storage and stored.decisions == plain.decisions


def test_coding_rates_are_the_time_storage_added_per_byte_coded() -> None:
    codes = {"a": Codable({4: 1000}), "b": Codable({4: 3000, 2: 1000})}
    trials = storage_stage.StorageTrials(
        errors={"bf16": 0.0, "fp8": 0.0}, seconds={"bf16": 1.4, "fp8": 0.9}, exact_seconds=1.0
    )
    rates = storage_stage.coding_rates(["bf16", "fp8"], codes, ["a", "b"], trials)
    # bf16 codes only the fp32 tensors (4000 bytes); fp8 all (5000), and a step measured
    # faster than the exact one adds nothing.
    assert rates == {"bf16": pytest.approx(0.4 / 4000), "fp8": 0.0}
    counted = storage_stage.coding_rates(["bf16", "offload"], codes, ["a"], None)
    assert counted == {"bf16": 3.0 / COUNTED_BANDWIDTH, "offload": 32.0 / COUNTED_BANDWIDTH}


@pytest.mark.usefixtures("free_coding")
def test_engine_plans_storage_and_trains_under_it() -> None:
    model, x = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    unplanned = memfit.plan(model, x, _gpt_loss, precision="fp32", optimizer=opt)
    budget = int(unplanned.predicted_peak_bytes * 0.75)
    engine = memfit.Engine(
        model,
        opt,
        precision="fp32",
        memory_budget=budget,
        activation_storage=("keep", "recompute", "fp8"),
    )
    losses = [float(engine.train_step(x, _gpt_loss)) for _ in range(3)]
    assert engine.plan.storage and set(engine.plan.storage.values()) == {"fp8"}
    assert stored_units(model) == engine.plan.storage
    assert engine.plan_check is not None and engine.plan_check.measured_peak_bytes <= budget
    assert losses[-1] < losses[0]


def test_engine_refuses_storage_without_a_planner() -> None:
    model, _ = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="chosen by the planner"):
        memfit.Engine(model, opt, checkpoint="none", activation_storage=("keep", "fp8"))
    with pytest.raises(ConfigError, match="'int4'"):
        memfit.Engine(model, opt, memory_budget="1GiB", activation_storage=("keep", "int4"))


def test_estimates_count_codes_on_fakes_and_fit_a_larger_batch() -> None:
    """On the meta device the codes are counted on fake tensors: never more than the real
    model codes (a projection that under-promises), and enough to fit a larger batch."""
    from memfit.checkpoint.profiler.runner import fake_run
    from memfit.checkpoint.storage import codable

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
    units = [f"blocks.{i}" for i in range(4)]
    counted = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        x = torch.randint(0, 256, (8, 129)).to(device)

        def loss(model: nn.Module = model, x: torch.Tensor = x) -> torch.Tensor:
            with fake_run(model, x, "cpu") as (fakes, _, _):
                return gpt_loss(model, fakes)

        counted[device] = codable(model, units, loss)
    for unit in units:
        real, fake = counted["cpu"][unit].total_bytes(), counted["meta"][unit].total_bytes()
        assert 0 < fake <= real

    def rows(storage: tuple[str, ...]) -> list:
        return memfit.estimate(
            lambda: GPT(cfg),
            lambda b: torch.randint(0, 256, (b, 129)),
            gpt_loss,
            batch_size=3,
            precisions=["fp32"],
            strategies=["optimal"],
            device_memory="58MB",
            activation_storage=storage,
        ).rows

    plain, stored = rows(("keep", "recompute")), rows(("keep", "recompute", "fp8"))
    assert stored[0].max_micro_batch > plain[0].max_micro_batch
    # At batch 3 no plan without storage fits; with it, one does.
    assert plain[0].plan is None and stored[0].plan is not None and stored[0].fits
    assert set(stored[0].plan.storage.values()) == {"fp8"}
    assert any("fp8 not measured" in note for note in stored[0].plan.notes)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach."""
    import gc

    gc.collect()
    return storage_bytes(
        o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"
    )


def test_a_forward_without_backward_under_storage_leaves_nothing_alive() -> None:
    # An evaluation with gradients on never reaches backward: its graph must go with its
    # loss. A packed object holding an op's saved output (or a code made with gradients on)
    # holds that graph through autograd's C++ nodes, a cycle gc cannot free.
    model, x = _gpt()
    before = _live_tensor_bytes()
    for kind in ("keep", "bf16", "fp8", "offload"):
        apply_storage(model, {b: kind for b in _blocks(model)})
        loss = _gpt_loss(model, x)
        del loss
        remove_storage(model)
        assert _live_tensor_bytes() == before, kind


def test_planning_with_storage_leaves_nothing_alive() -> None:
    # The planner counts each unit's codes on a forward it never takes backward.
    model, x = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    whole = make_plan(model, x, _gpt_loss, precision="fp32", optimizer=opt, costs="counted")
    before = _live_tensor_bytes()
    planned = make_plan(
        model,
        x,
        _gpt_loss,
        precision="fp32",
        optimizer=opt,
        costs="counted",
        budget=int(whole.plan.predicted_peak_bytes * 0.8),
        activation_storage=("keep", "recompute", "bf16", "fp8"),
    )
    assert planned.plan.storage  # the case the leak was in
    del planned
    assert _live_tensor_bytes() == before
