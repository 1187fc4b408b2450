"""memfit.plan / Engine(checkpoint=...): plans are measured, not assumed.

For the three classic cases (the built-in GPT, ResNet and stacked LSTM), at several budgets,
the measured peak of a real training step stays within the budget and the predicted peak is
within 10% of it; recompute FLOPs counted by FlopCounterMode equal the plan's.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import pytest
import torch
from cpu_kind import native_bf16

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.apply import remove_plan
from memfit.checkpoint.costs import counted_times
from memfit.checkpoint.measured_fit import MEASURE_MARGIN
from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes
from memfit.checkpoint.planner import RESERVE, solve_profile
from memfit.checkpoint.profile_stage import profile_step
from memfit.checkpoint.profiler import flop_counter
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.models import build_model
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes

CASES = {
    "gpt": dict(n_layer=6, n_embd=64, n_head=4, block_size=128),
    "resnet": dict(widths=(16, 32), blocks_per_stage=(3, 3)),
    "lstm": dict(n_layer=4, n_embd=64, hidden_size=128, seq_len=64),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(name: str, precision: str = "fp32", batch_size: int = 16):
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(name, data="synthetic", **CASES[name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = memfit.Engine(model, optimizer, precision=precision, log_every=10**9)
    batch = batch_fn(batch_size, generator=0)
    return model, loss_fn, batch, engine


def _measured_peak(model, loss_fn, batch, engine) -> int:
    """The step's peak as the allocator saw it (kernels' own workspaces included)."""
    engine.train_step(batch, loss_fn)  # the optimizer state exists from here on
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(engine.optimizer), batch]
    return allocator_peak(lambda: engine.train_step(batch, loss_fn), live=live).peak_bytes


def _counted_plans(model, loss_fn, batch, engine, precision) -> list[memfit.Plan]:
    """Optimal plans at three budgets across the frontier, solved on counted costs (FLOPs
    and bytes, :func:`counted_times`) instead of measured times: which plans these are
    depends on the model alone, not on how fast this machine ran bf16 today."""
    policy = PrecisionPolicy.of(precision)
    profiled = profile_step(model, batch, loss_fn, policy)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))

    def solve(budget: int | None, strategy: str = "optimal") -> memfit.Plan:
        return solve_profile(model, profiled, policy, engine.optimizer, strategy, budget).plan

    # The frontier's least peak is the planner's bound for the smallest plan it can make;
    # it keeps RESERVE of the budget free.
    low = min(p.peak_bytes for p in solve(None).frontier) / (1 - RESERVE)
    high = solve(None, "none").predicted_peak_bytes
    assert low < high, "checkpointing must be able to save memory on these models"
    return [solve(int(low + f * (high - low)) + 1) for f in (0.0, 0.5, 0.9)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_optimal_plans_fit_their_budget_and_are_predicted_within_10_percent(
    name: str, precision: str, request: pytest.FixtureRequest
) -> None:
    # Mixed plans (some units kept, some recomputed) at three budgets, measured once each.
    if (name, precision) == ("lstm", "bf16-mixed"):
        # A known shortfall: the CPU LSTM kernel's backward scratch under bf16 autocast is
        # not placed by the model; measured 17.18 MiB at the 16.80 MiB least budget (+2.3%).
        # Not strict: which kernel runs (and so the scratch) depends on the CPU's bf16 support.
        request.applymarker(pytest.mark.xfail(reason="bf16 LSTM backward scratch, +2.3%"))
    model, loss_fn, batch, engine = _setup(name, precision)
    plans = _counted_plans(model, loss_fn, batch, engine, precision)
    assert any(p.recompute_seconds > 0 for p in plans), "the budgets must call for checkpointing"
    for plan in plans:
        budget = plan.budget_bytes
        memfit.apply_plan(model, plan)
        measured = _measured_peak(model, loss_fn, batch, engine)
        remove_plan(model)
        assert measured <= budget, (name, precision, budget, measured, plan.decisions)
        error = abs(plan.predicted_peak_bytes - measured) / measured
        assert error <= 0.10, (name, budget, plan.predicted_peak_bytes, measured)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("strategy", ["none", "full"])
def test_predicted_peak_within_10_percent(
    name: str, precision: str, strategy: str, request: pytest.FixtureRequest
) -> None:
    if (name, precision, strategy) == ("resnet", "bf16-mixed", "full") and not native_bf16():
        # A known shortfall where bf16 convolutions are emulated (AVX2 only, or emulated so):
        # a unit's rebuilt forward is measured holding ~3.7 MiB of scratch above what it
        # keeps, which the step's rebuild in backward does not show; predicted 14.19 MiB
        # against 11.82 MiB measured (+20%), an over-prediction (the plan is safe).
        request.applymarker(pytest.mark.xfail(reason="emulated bf16 conv scratch, +20%"))
    model, loss_fn, batch, engine = _setup(name, precision)
    plan = memfit.plan(
        model, batch, loss_fn, strategy=strategy, precision=precision, optimizer=engine.optimizer
    )
    memfit.apply_plan(model, plan)
    measured = _measured_peak(model, loss_fn, batch, engine)
    error = abs(plan.predicted_peak_bytes - measured) / measured
    assert error <= 0.10, (name, precision, strategy, plan.predicted_peak_bytes, measured)


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_flops_match_flop_counter(name: str) -> None:
    model, loss_fn, batch, engine = _setup(name)
    reference = copy.deepcopy(model)
    plan = memfit.plan(
        model, batch, loss_fn, strategy="full", precision="fp32", optimizer=engine.optimizer
    )
    if name != "lstm":  # torch's FLOP counter has no formula for the fused LSTM kernels
        assert plan.recompute_flops > 0

    def step_flops(m: torch.nn.Module) -> int:
        with flop_counter() as counter:
            loss_fn(m, batch).backward()
        return counter.get_total_flops()

    memfit.apply_plan(model, plan)
    extra = step_flops(model) - step_flops(reference)
    assert extra == plan.recompute_flops


@pytest.mark.parametrize("request_", ["full", "uniform:2", "sqrt", "optimal"])
def test_engine_checkpoint_gradients_bitwise_equal(request_: str) -> None:
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CASES["gpt"])
    reference = copy.deepcopy(model)
    batch = batch_fn(8, generator=0)
    budget = None
    if request_ == "optimal":
        full = memfit.plan(model, batch, loss_fn, strategy="full", precision="fp32")
        none = memfit.plan(model, batch, loss_fn, strategy="none", precision="fp32")
        budget = int((full.predicted_peak_bytes + none.predicted_peak_bytes) / 2)
    engines = [
        memfit.Engine(
            m,
            torch.optim.SGD(m.parameters(), lr=0.1),
            precision="fp32",
            checkpoint=c,
            memory_budget=budget if c != "none" else None,
        )
        for m, c in ((model, request_), (reference, "none"))
    ]
    for step in range(2):
        for engine in engines:
            engine.train_step(batch_fn(8, generator=step), loss_fn)
    assert engines[0].plan is not None
    assert any(d != "keep" for d in engines[0].plan.decisions.values()) or engines[0].plan.segments
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_budget_too_small_names_smallest_feasible() -> None:
    model, loss_fn, batch, engine = _setup("gpt")
    full = memfit.plan(
        model, batch, loss_fn, strategy="full", precision="fp32", optimizer=engine.optimizer
    )
    # Above what the optimizer step holds (a fifth of this peak here), below what any plan
    # can reach (every block recomputed is about the least).
    budget = int(0.8 * full.predicted_peak_bytes)
    assert budget > full.static_bytes
    with pytest.raises(BudgetError) as info:
        memfit.plan(
            model,
            batch,
            loss_fn,
            budget=budget,
            strategy="optimal",
            precision="fp32",
            optimizer=engine.optimizer,
        )
    message = str(info.value)
    assert "smallest peak" in message
    assert "at least" in message and "static" in message.lower()
    # The budget it names is one that fits, the planner's reserve included, to the byte.
    needed = int(re.search(r"at least [\d.]+ \w+ \((\d+) bytes\)", message).group(1))
    plan = memfit.plan(
        model,
        batch,
        loss_fn,
        budget=needed,
        strategy="optimal",
        precision="fp32",
        optimizer=engine.optimizer,
    )
    assert plan.predicted_peak_bytes <= needed
    assert not any("reserve" in note for note in plan.notes)
    least = int(re.search(r"plan reaches, [\d.]+ \w+ \((\d+) bytes\)", message).group(1))
    # Far below the least predicted peak no measurement is tried: refused.
    far = int(least / (1 + MEASURE_MARGIN)) - 1024
    with pytest.raises(BudgetError):
        memfit.plan(
            model,
            batch,
            loss_fn,
            budget=far,
            strategy="optimal",
            precision="fp32",
            optimizer=engine.optimizer,
        )


def test_budget_below_optimizer_step_says_what_dominates() -> None:
    model, loss_fn, batch, engine = _setup("gpt")
    with pytest.raises(BudgetError) as info:
        memfit.plan(
            model,
            batch,
            loss_fn,
            budget=1024,
            strategy="optimal",
            precision="fp32",
            optimizer=engine.optimizer,
        )
    assert "parameters, gradients, optimizer state and the step's temporaries" in str(info.value)


def test_budget_above_unplanned_peak_gives_none_plan_said_plainly() -> None:
    model, loss_fn, batch, engine = _setup("gpt")
    plan = memfit.plan(
        model,
        batch,
        loss_fn,
        budget="20GiB",
        strategy="optimal",
        precision="fp32",
        optimizer=engine.optimizer,
    )
    assert all(d == "keep" for d in plan.decisions.values()) and not plan.segments
    assert plan.recompute_flops == 0
    # The note names the step's predicted peak, which is the plan's.
    peak = format_bytes(plan.predicted_peak_bytes)
    assert any("nothing is recomputed" in note and peak in note for note in plan.notes)


def test_malformed_budget_and_strategy() -> None:
    model, loss_fn, batch, engine = _setup("gpt")
    with pytest.raises(ConfigError):
        memfit.plan(model, batch, loss_fn, budget="two gigs", strategy="optimal", precision="fp32")
    with pytest.raises(ConfigError):
        memfit.plan(model, batch, loss_fn, strategy="uniform:zero", precision="fp32")


def test_model_without_blocks_says_how_to_name_units() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(PlanError) as info:
        memfit.plan(model, torch.randn(2, 4), precision="fp32")
    assert "units" in str(info.value)


def test_plan_from_another_model_is_refused() -> None:
    model, loss_fn, batch, engine = _setup("gpt")
    plan = memfit.plan(model, batch, loss_fn, strategy="full", precision="fp32")
    other, _, _ = build_model("gpt", data="synthetic", **{**CASES["gpt"], "n_layer": 3})
    with pytest.raises(PlanError):
        memfit.apply_plan(other, memfit.Plan.from_json(plan.to_json()))


def test_resume_restores_the_plan(tmp_path) -> None:
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("gpt", data="synthetic", **CASES["gpt"])
    engine = memfit.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint="full",
        precision="bf16-mixed",
    )
    engine.train_step(batch_fn(8, generator=0), loss_fn)
    engine.save(tmp_path / "ckpt.pt")
    model2, _, _ = build_model("gpt", data="synthetic", **CASES["gpt"])
    resumed = memfit.Engine.resume(
        tmp_path / "ckpt.pt", model2, torch.optim.SGD(model2.parameters(), lr=0.1)
    )
    resumed.train_step(batch_fn(8, generator=1), loss_fn)
    assert resumed.plan is not None
    assert resumed.plan.decisions == engine.plan.decisions


def test_engine_rejects_a_misspelt_strategy_when_made() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unknown checkpoint strategy"):
        memfit.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            checkpoint="unifrom:4",
            precision="bf16-mixed",
        )
    with pytest.raises(ConfigError, match="takes a Plan"):
        memfit.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            checkpoint=42,
            precision="bf16-mixed",
        )


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.NAdam, {}),
        (torch.optim.RMSprop, {}),
        (torch.optim.Adadelta, {}),
        (torch.optim.SGD, {"momentum": 0.9}),
    ],
)
def test_optimizer_state_predicted_before_the_first_step_is_what_it_holds_after(
    optimizer_cls: type, kwargs: dict
) -> None:
    # The Engine plans on the first batch, before the optimizer has any state.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    optimizer = optimizer_cls(model.parameters(), lr=1e-3, **kwargs)
    predicted = optimizer_state_bytes(optimizer)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert optimizer.state, "the step must have made the state the prediction stands for"
    assert optimizer_state_bytes(optimizer) == predicted


@pytest.mark.parametrize("kind", ["llama", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_hf_models_computing_their_loss_inside_fit_their_budget(kind: str, precision: str) -> None:
    # With labels=, a Hugging Face model computes its loss in its own forward: its
    # backward starts with logits-sized gradients (the vocabulary is 32x the width here)
    # while everything kept is still held. The plan must count them.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=3)
    shape.update(num_attention_heads=4, max_position_embeddings=64)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**shape, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(cfg).train()
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(**shape)).train()
    ids = torch.randint(0, 2048, (8, 64), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "llama":  # a decoder's key/value cache makes its layers unsafe to recompute
        inputs["use_cache"] = False

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            out = model(**inputs)
        out.loss.backward()

    # No loss_fn: the loss is the output's first tensor (out.loss), and the plan counts the
    # output as held through backward, as step() holds it.
    whole = memfit.plan(model, inputs, precision=precision)
    peaks = [p.peak_bytes for p in whole.frontier]
    for share in (0.0, 0.5):
        budget = int((min(peaks) + share * (max(peaks) - min(peaks))) / (1 - RESERVE)) + 1
        plan = memfit.plan(model, inputs, budget=budget, precision=precision)
        # Selective recompute re-runs no matmuls, so its FLOPs may be 0: look at decisions.
        assert any(d != "keep" for d in plan.decisions.values()) or plan.segments
        memfit.apply_plan(model, plan)
        step()
        measured = allocator_peak(
            step, live=[*model.parameters(), *model.buffers(), inputs]
        ).peak_bytes
        remove_plan(model)
        assert measured <= budget, (kind, precision, budget, measured, plan.decisions)
        error = abs(plan.predicted_peak_bytes - measured) / measured
        assert error <= 0.10, (kind, precision, budget, plan.predicted_peak_bytes, measured)


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(4):
        layers += [
            torch.nn.Sequential(
                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU()
            )
        ]
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master"])
def test_plan_of_a_fresh_model_counts_the_precisions_islands_and_leaves_the_model_as_it_was(
    precision: str,
) -> None:
    # memfit.plan on a model no Engine has touched measures it as training will run it
    # (BatchNorm as an fp32 island, 16-bit weights in the master modes), then restores it.
    x = torch.randn(8, 3, 16, 16)
    fresh = _conv_net()
    before = {n: (p.dtype, p.data_ptr()) for n, p in fresh.named_parameters()}
    fresh_plan = memfit.plan(fresh, x, strategy="none", precision=precision)
    assert {n: (p.dtype, p.data_ptr()) for n, p in fresh.named_parameters()} == before
    assert all("forward" not in m.__dict__ for m in fresh.modules())
    prepared = _conv_net()
    memfit.precision.apply_precision(prepared, memfit.PrecisionPolicy(precision))
    prepared_plan = memfit.plan(prepared, x, strategy="none", precision=precision)
    assert fresh_plan.predicted_peak_bytes == prepared_plan.predicted_peak_bytes


def _gpt_with_grads() -> tuple[torch.nn.Module, torch.Tensor]:
    from memfit.models.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64))
    batch = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    gpt_loss(model, batch).backward()  # a micro-batch's gradients, not applied yet
    return model, batch


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("form", ["step", "output"])
def test_plan_leaves_the_gradients_the_user_holds_as_they_were(form: str, verify: bool) -> None:
    # Planning runs the model forward and backward many times (the profile, the probe, the
    # workspace, the measured step): none of it is summed into the user's gradients.
    from memfit.models.gpt import gpt_loss

    model, batch = _gpt_with_grads()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]
    opt = torch.optim.AdamW(model.parameters())
    if form == "step":
        memfit.plan(model, batch, gpt_loss, optimizer=opt, precision="fp32", verify=verify)
    else:
        memfit.plan(model, batch[:, :-1], optimizer=opt, precision="fp32", verify=verify)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, v) for g, v in zip(grads, values))


def test_an_engines_run_is_the_same_with_a_plan_made_between_its_steps() -> None:
    # In a '*-master' mode the working weights' hooks sum each gradient into the fp32
    # masters the optimizer steps: a plan made between two steps once added its own runs'
    # gradients there (the next update used 6x the gradient of the tied embedding).
    from memfit.models.gpt import gpt_loss

    def run(plan_between: bool) -> list[float]:
        model, batch = _gpt_with_grads()
        model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = memfit.Engine(model, opt, precision="bf16-master", monitor=False)
        losses = [float(engine.train_step(batch, gpt_loss))]
        if plan_between:
            memfit.plan(model, batch, gpt_loss, optimizer=opt, precision="bf16-master")
        losses += [float(engine.train_step(batch, gpt_loss)) for _ in range(2)]
        return losses

    assert run(plan_between=True) == run(plan_between=False)


def _cached_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    cfg = transformers.LlamaConfig(
        **shape, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
    )
    return transformers.LlamaForCausalLM(cfg).train()


def test_layers_that_keep_state_between_calls_are_never_recomputed_and_the_plan_says_why() -> None:
    # Called with its key/value cache on, a decoder appends each layer's keys to a cache
    # object: a rerun in backward appends again, and selective checkpointing then fails in
    # backward. The probe finds it; the plan leaves those layers out.
    model = _cached_llama()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": True}
    for strategy in ("full", "optimal"):
        plan = memfit.plan(
            model, inputs, strategy=strategy, loss_fn=lambda m, b: m(**b).loss, precision="fp32"
        )
        assert all(d == "keep" for d in plan.decisions.values()), plan.decisions
        notes = " ".join(plan.notes)
        assert "model.layers.0, model.layers.1" in notes and "use_cache=False" in notes
    plan = memfit.plan(
        model,
        {**inputs, "use_cache": False},
        strategy="full",
        loss_fn=lambda m, b: m(**b).loss,
        precision="fp32",
    )
    assert plan.decisions["model.layers.0"] == "recompute"
    assert not any("recomputed" in n and "layers" in n for n in plan.notes), plan.notes


def test_a_training_model_with_its_cache_on_by_default_is_planned_without_it() -> None:
    # The config's default (use_cache=True) builds a cache in training too; the planner
    # turns it off for training, as Hugging Face's own checkpointing does, and says so.
    model = _cached_llama()
    assert model.config.use_cache is True
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="use_cache=False for training"):
        plan = memfit.plan(
            model,
            {"input_ids": ids, "labels": ids},
            strategy="full",
            loss_fn=lambda m, b: m(**b).loss,
            precision="fp32",
        )
    assert model.config.use_cache is False
    assert plan.decisions["model.layers.0"] == "recompute"
    assert any("use_cache=False for training" in n for n in plan.notes), plan.notes
    eval_model = _cached_llama().eval()  # not training: left as it is
    memfit.plan(eval_model, {"input_ids": ids}, strategy="none", precision="fp32")
    assert eval_model.config.use_cache is True


def test_probe_finds_a_counter_kept_between_calls_and_leaves_stateless_units_alone() -> None:
    from memfit.checkpoint.probe import unstable_units

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.history: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.history.append(x)  # grows each call: the rerun concatenates one more
            return self.linear(torch.cat(self.history, dim=1)[:, -4:])

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Counting(), torch.nn.Dropout(0.5))
    x = torch.randn(3, 4)
    found = unstable_units(model, lambda: model(x), ["0", "1", "2"])
    assert set(found) == {"1"} and "does other work when run again" in found["1"]
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in model.buffers()]
    assert unstable_units(model, lambda: model(x), ["0", "2"]) == {}
    assert torch.equal(torch.get_rng_state(), rng)  # the probe leaves the random state alone
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))


def test_plan_summary_agrees_with_itself_when_the_optimizer_step_is_the_peak() -> None:
    # Wide layers, a tiny batch and no optimizer given: the step's peak is the parameters
    # and gradients, above every activation-phase point; the frontier must say so too.
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    x = torch.randn(2, 512)
    for strategy in ("none", "full", "optimal"):
        plan = memfit.plan(model, x, strategy=strategy, precision="fp32")
        peaks = [p.peak_bytes for p in plan.frontier]
        assert plan.predicted_peak_bytes in peaks, (strategy, plan.predicted_peak_bytes, peaks)
        assert min(peaks) >= plan.static_bytes
        starred = [line for line in plan.summary().splitlines() if line.lstrip().startswith("*")]
        assert starred and format_bytes(plan.predicted_peak_bytes) in starred[0]


def test_probe_does_not_take_another_pre_hooks_work_for_state() -> None:
    # weight_norm-style pre-hooks run ops before forward; a recompute re-runs forward only,
    # so those ops are not the unit's, and the unit is not reported as keeping state.
    from memfit.checkpoint.probe import unstable_units

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
    x = torch.randn(3, 4)
    assert unstable_units(model, lambda: model(x), ["0", "1"]) == {}


def test_plan_estimate_and_tune_take_the_step_the_engine_takes() -> None:
    # One contract: loss_fn(model, batch), third after the model (or its maker) and the
    # batch (or its maker), every setting by keyword; memfit.plan is make_plan's plan.
    from memfit.checkpoint import make_plan

    model, loss_fn, batch, engine = _setup("gpt")
    plan = memfit.plan(model, batch, loss_fn, strategy="full", precision="fp32")
    made = make_plan(model, batch, loss_fn, strategy="full", precision="fp32").plan
    assert (plan.decisions, plan.predicted_peak_bytes) == (
        made.decisions,
        made.predicted_peak_bytes,
    )

    def model_fn() -> torch.nn.Module:
        return build_model("gpt", data="synthetic", **CASES["gpt"]).model

    def inputs_fn(n: int) -> torch.Tensor:
        return torch.zeros(n, CASES["gpt"]["block_size"] + 1, dtype=torch.long)

    settings = dict(batch_size=2, precisions=["fp32"], strategies=["none", "full"])
    by_position = memfit.estimate(model_fn, inputs_fn, loss_fn, **settings)
    by_keyword = memfit.estimate(model_fn, inputs_fn, loss_fn=loss_fn, **settings)
    assert by_position.to_dict() == by_keyword.to_dict()
    for name in ("estimate", "tune"):
        parameters = list(inspect.signature(getattr(memfit, name)).parameters.values())
        assert parameters[2].name == "loss_fn" and parameters[2].default is None
        assert parameters[3].kind is inspect.Parameter.KEYWORD_ONLY
