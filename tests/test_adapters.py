"""Adapter-wrapped models, as users fine-tune them: memfit plans a PEFT LoRA model.

``peft.get_peft_model`` wraps a tiny Llama (built from its config, no weights downloaded) in
LoRA adapters on the attention's query and value projections: the base weights are frozen
and the adapters alone train, so the optimizer's state is the adapters' alone, whichever
parameters it is given. At the least and a middle point of memfit's frontier, the verified
plan's whole training step, measured here by the allocator, stays within the budget and is
predicted within 5%, and the adapters' gradients are bitwise those of the step without a
plan.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes
from memfit.checkpoint.planner import RESERVE
from memfit.precision.policy import PrecisionPolicy

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 1024
LAYERS = 4


def _loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def _llama_lora() -> tuple[torch.nn.Module, dict[str, Any]]:
    """The Llama in LoRA adapters (no dropout: the gradient check runs two steps), one batch."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    lora = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
    )
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).train()
    ids = torch.randint(0, VOCAB, (8, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _measured_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, Any],
    plan: memfit.Plan,
    precision: str,
) -> int:
    """The allocator's peak of a whole training step (zero_grad, forward, backward, the
    optimizer's step) under ``plan``, as memfit trains it (bf16-mixed: autocast around
    forward, memfit's fp32 islands), from the parameters, the optimizer's state and the
    batch; after a warm-up step."""
    mixed = precision != "fp32"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = _loss(model, batch)
        loss.backward()
        opt.step()

    if mixed:
        memfit.precision.apply_precision(model, PrecisionPolicy(precision))
    memfit.apply_plan(model, plan)
    try:
        step()
        live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), batch]
        return allocator_peak(step, live=live).peak_bytes
    finally:
        memfit.remove_plan(model)
        if mixed:
            memfit.precision.remove_precision(model)


@pytest.fixture(scope="module")
def lora() -> tuple[torch.nn.Module, dict[str, Any], torch.optim.Optimizer]:
    model, batch = _llama_lora()
    opt = torch.optim.AdamW(_trainable(model), lr=1e-4)
    return model, batch, opt


def test_an_optimizer_given_the_frozen_weights_too_is_predicted_the_adapters_state(lora) -> None:
    # A loop may hand AdamW all of model.parameters(): the frozen base weights get no
    # gradient, so AdamW keeps no state for them, and memfit must predict none.
    model, batch, _ = lora
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # q_proj and v_proj of each layer, lora_A and lora_B each.
    assert len(trainable) == 4 * LAYERS and all(".lora_" in n for n in trainable), trainable
    elements = sum(p.numel() for p in _trainable(model))
    twin = copy.deepcopy(model)
    everything = torch.optim.AdamW(twin.parameters(), lr=1e-4)
    predicted = optimizer_state_bytes(everything)
    # Two fp32 buffers per adapter element and a step count per adapter.
    assert predicted == 2 * 4 * elements + 4 * len(trainable), predicted
    everything.zero_grad(set_to_none=True)
    _loss(twin, batch).backward()
    everything.step()
    assert optimizer_state_bytes(everything, predict=False) == predicted


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_lora_plans_at_the_least_and_a_middle_point_fit_their_budgets(lora, precision) -> None:
    model, batch, opt = lora
    whole = memfit.plan(model, batch, _loss, precision=precision, optimizer=opt)
    peaks = [p.peak_bytes for p in whole.frontier]
    assert len(peaks) >= 3 and peaks == sorted(peaks), whole.frontier
    assert whole.frontier[-1].recompute_flops == 0 and whole.frontier[0].recompute_flops > 0
    assert whole.measured_peak_bytes is not None
    unplanned = whole.measured_peak_bytes
    # The layers hold most of the step: recomputing them all saves a quarter of it at least.
    assert peaks[0] <= 0.75 * peaks[-1], peaks

    for index in (0, len(peaks) // 2):
        point = whole.frontier[index]
        budget = int(point.peak_bytes / (1 - RESERVE)) + 1
        plan = memfit.plan(model, batch, _loss, budget=budget, precision=precision, optimizer=opt)
        where = (precision, index, budget, plan.decisions, plan.segments)
        assert plan.predicted_peak_bytes <= budget, where
        assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget, where
        measured = _measured_step(model, opt, batch, plan, precision)
        assert measured <= budget, (measured, *where)
        assert measured < unplanned, (measured, unplanned, *where)
        error = abs(plan.predicted_peak_bytes - measured) / measured
        assert error <= 0.05, (plan.predicted_peak_bytes, measured, *where)
        if index == 0:  # the least point recomputes every layer
            recomputed = [n for n, d in plan.decisions.items() if d != "keep"]
            assert plan.recompute_flops > 0 and len(recomputed) >= LAYERS, where
            assert all(n.startswith("base_model.model.model.layers.") for n in recomputed)


def test_lora_gradients_are_bitwise_those_of_the_step_without_a_plan(lora) -> None:
    model, batch, opt = lora
    whole = memfit.plan(model, batch, _loss, precision="fp32", optimizer=opt)

    def grads(plan: memfit.Plan | None) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        twin = copy.deepcopy(model)
        if plan is not None:
            memfit.apply_plan(twin, plan)
        twin.zero_grad(set_to_none=True)
        loss = _loss(twin, batch)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in twin.named_parameters()}

    loss, base = grads(None)
    with_grad = sorted(n for n, g in base.items() if g is not None)
    assert with_grad == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    for index in (0, len(whole.frontier) // 2):
        budget = int(whole.frontier[index].peak_bytes / (1 - RESERVE)) + 1
        plan = memfit.plan(model, batch, _loss, budget=budget, precision="fp32", optimizer=opt)
        assert plan.recompute_flops > 0, (index, plan.decisions)
        got_loss, got = grads(plan)
        assert torch.equal(got_loss, loss), (index, plan.decisions)
        assert sorted(n for n, g in got.items() if g is not None) == with_grad
        differ = [n for n in with_grad if not torch.equal(got[n], base[n])]
        assert not differ, (index, plan.decisions, differ)
