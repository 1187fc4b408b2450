"""The recompute-safety probe (memfit/checkpoint/probe.py) tells state from constants.

A unit whose rerun makes its constants again (``torch.tensor(...)``, a Python scalar cast,
a mask rebuilt), or finds them cached from the first run, does the same work on its data
and is recomputed. A unit that keeps state (a key/value cache, a counter, a list a forward
appends to) is not, whether the state changes the ops and shapes run or only the values.
Then the Hugging Face zoo of bench/zoo.py, on tiny configs with the newest transformers:
every model's blocks are recomputable, ``full`` measures clearly below the unplanned step,
an ``optimal`` plan at a half-way budget fits it, and gradients with and without a plan
are bitwise equal in fp32 under seeded dropout.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak
from memfit.checkpoint.apply import remove_plan
from memfit.checkpoint.costs import counted_times
from memfit.checkpoint.planner import RESERVE, solve_profile
from memfit.checkpoint.probe import probe_units, unstable_units
from memfit.checkpoint.profile_stage import profile_model
from memfit.precision.policy import PrecisionPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- constants


class _LazyMask(nn.Module):
    """Attention-like scores masked by a causal mask built on the first call and kept for
    later calls of the same length (as many attention layers cache theirs), scaled by a
    Python float cast to a tensor on every call, offset by a constant made with
    ``torch.tensor``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 0.5
        self._masks: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in self._masks:  # the rerun finds it: none of these ops run again
            ones = torch.ones(n, n, dtype=torch.bool)
            self._masks[n] = torch.tril(ones).logical_not()
        scores = self.linear(x) @ x.T * torch.tensor(self.scale, dtype=x.dtype)
        scores = scores.masked_fill(self._masks[n], float("-inf"))
        return scores.softmax(-1) @ x + torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_constants_made_again_or_found_cached_are_not_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _LazyMask(), nn.Dropout(0.5), _LazyMask())
    x = torch.randn(3, 4)
    assert unstable_units(model, lambda: model(x), ["0", "1", "2", "3"]) == {}
    # And recomputing them is right: the rebuild finds the mask cached, as the probe's
    # rerun did, and computes what forward saved.
    plan = memfit.plan(model, x, strategy="full", precision="fp32")
    # The masked units are recomputed; the Linear and the Dropout save no more than their
    # input, free nothing recomputed alone, and are kept.
    assert [plan.decisions[n] for n in ("0", "1", "2", "3")] == [
        "keep",
        "recompute",
        "keep",
        "recompute",
    ], plan.decisions
    planned = copy.deepcopy(model)
    memfit.apply_plan(planned, plan)
    grads = []
    for m in (model, planned):
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(0)
        m(leaf).sum().backward()
        grads.append([leaf.grad, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_constants_under_autocast_are_not_state() -> None:
    model = nn.Sequential(_LazyMask(), _LazyMask())
    x = torch.randn(3, 4)
    found = unstable_units(
        model, lambda: model(x), ["0", "1"], autocast=("cpu", torch.bfloat16, True)
    )
    assert found == {}


class _Counter(nn.Module):
    """Adds how many times it was called: the same ops on the same shapes every call,
    other values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) + torch.tensor(float(self.calls))


def test_a_counter_that_changes_only_the_values_is_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Counter(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    found = unstable_units(model, lambda: model(x), ["0", "1", "2"])
    assert set(found) == {"1"}
    assert "does other work when run again" in found["1"] and "output 0" in found["1"]


class _RunningSum(nn.Module):
    """Keeps a sum of its inputs in a tensor attribute (no buffer) and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total = self.total + x.sum(0)
        return x * self.total


def test_state_kept_in_a_tensor_attribute_is_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _RunningSum())
    found = unstable_units(model, lambda: model(torch.randn(3, 4)), ["0", "1"])
    assert set(found) == {"1"} and "does other work when run again" in found["1"]


class _ResidualNorm(nn.Module):
    """A dense layer, dropout and a post-norm residual, as BERT's output sublayer is written."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.dense(x))
        return self.norm(h + x)


def test_a_rebuilds_forward_is_measured_holding_the_outputs_nothing_saves() -> None:
    # Up to its last save (the LayerNorm's input), a rebuild holds two tensors of the
    # input's size that nothing saves: the dropout's output, which the forward's local name
    # keeps until it returns, and the LayerNorm's output, made before the norm saves what it
    # needs. Charged neither, a three-layer BERT's least plan ran 3.5% over its prediction.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _ResidualNorm(), _ResidualNorm()).train()
    x = torch.randn(8, 32, 64)
    found = probe_units(model, lambda: model(x), ["1", "2"], workspace=True)
    assert found.rebuild_forward == {"1": 2 * x.nbytes, "2": 2 * x.nbytes}
    assert probe_units(model, lambda: model(x), ["1", "2"]).rebuild_forward == {}


# --------------------------------------------------------------------------- Hugging Face


def _hf() -> Any:
    return pytest.importorskip("transformers")


def _ids(shape: tuple[int, int], vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _causal(vocab: int) -> dict[str, Any]:
    ids = _ids((4, 64), vocab, 0)
    # Without its key/value cache, as Hugging Face's own checkpointing trains a decoder.
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _masked(vocab: int) -> dict[str, Any]:
    ids = _ids((4, 64), vocab, 0)
    keep = torch.rand(4, 64, generator=torch.Generator().manual_seed(1)) < 0.15
    return {"input_ids": ids, "labels": torch.where(keep, ids, -100)}


def _images(size: int, labels: int, n: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "pixel_values": torch.randn(n, 3, size, size, generator=g),
        "labels": torch.randint(0, labels, (n,), generator=g),
    }


def _gpt2() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().GPT2Config(  # dropout 0.1 in embeddings, attention and residuals
        vocab_size=64,
        n_positions=64,
        n_embd=32,
        n_layer=3,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _hf().GPT2LMHeadModel(cfg), _causal(64)


def _llama() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attention_dropout=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _hf().LlamaForCausalLM(cfg), _causal(64)


def _bert() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().BertConfig(  # dropout 0.1 in attention and hidden states
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return _hf().BertForMaskedLM(cfg), _masked(64)


def _t5() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().T5Config(  # dropout_rate 0.1
        vocab_size=64,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    inputs = {"input_ids": _ids((4, 64), 64, 0), "labels": _ids((4, 32), 64, 1)}
    return _hf().T5ForConditionalGeneration(cfg), {**inputs, "use_cache": False}


def _vit() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=10,
    )
    return _hf().ViTForImageClassification(cfg), _images(32, 10)


def _resnet() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().ResNetConfig(  # no dropout: BatchNorm's statistics are compared
        embedding_size=8,
        hidden_sizes=[16, 32],
        depths=[3, 3],
        layer_type="basic",
        num_labels=10,
    )
    return _hf().ResNetForImageClassification(cfg), _images(64, 10, n=8)


def _convnext() -> tuple[nn.Module, dict[str, Any]]:
    cfg = _hf().ConvNextConfig(  # stochastic depth: a random draw per block
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[2, 2],
        image_size=64,
        drop_path_rate=0.1,
        num_labels=10,
    )
    return _hf().ConvNextForImageClassification(cfg), _images(64, 10)


ZOO: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
    "t5": _t5,
    "vit": _vit,
    "resnet": _resnet,
    "convnext": _convnext,
}
"""The models of bench/zoo.py, each on a tiny config, with one example batch."""


def _zoo_model(name: str) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    return model.train(), inputs


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def _step(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """One seeded forward and backward, as the Trainer writes it: the loss, every
    parameter's gradient and every buffer, copied."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(**inputs).loss
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _measured_peak(model: nn.Module, inputs: dict[str, Any]) -> int:
    """The allocator's peak of one forward and backward (after one to warm up)."""
    _step(model, inputs)
    live = [*model.parameters(), *model.buffers(), inputs]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    return allocator_peak(step, live=live).peak_bytes


@dataclasses.dataclass(frozen=True)
class ZooPlans:
    """A model's plans: none, full, optimal at the least budget it meets and optimal at a
    budget half-way from there to the unplanned peak."""

    none: memfit.Plan
    full: memfit.Plan
    least: memfit.Plan
    half: memfit.Plan


def _zoo_plans(model: nn.Module, inputs: dict[str, Any]) -> ZooPlans:
    """One profile (what ``memfit.plan`` makes first), four plans solved from it. Optimal
    is solved on counted costs (FLOPs and bytes) so that which plan it is does not depend
    on how fast this machine ran the profile."""
    policy = PrecisionPolicy.of("fp32")
    profiled = profile_model(model, inputs, _loss, policy, keep_output=False)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))

    def solve(strategy: str, budget: int | None = None) -> memfit.Plan:
        return solve_profile(model, profiled, policy, None, strategy, budget).plan

    peaks = [p.peak_bytes for p in solve("optimal").frontier]
    low, high = min(peaks), max(peaks)

    def budget(share: float) -> int:  # plans keep RESERVE of the budget free
        return int((low + share * (high - low)) / (1 - RESERVE)) + 1

    return ZooPlans(
        solve("none"), solve("full"), solve("optimal", budget(0.0)), solve("optimal", budget(0.5))
    )


def test_gpt2_with_its_key_value_cache_is_refused_for_the_cache_not_for_a_constant() -> None:
    # Called with use_cache=True, GPT2Model passes one DynamicCache to every block. A
    # block's cache layer starts as torch.tensor([]) (aten.lift_fresh) on the first call
    # and concatenates each call's keys onto what it holds: the rerun concatenates onto
    # the first run's keys, twice as many. The reason names that op. (The config's own
    # default use_cache=True is turned off for training by the planner, with a note.)
    model, inputs = _zoo_model("gpt2")
    cached = {**inputs, "use_cache": True}
    plan = memfit.plan(
        model,
        cached,
        lambda model, batch: model(**batch).loss,
        strategy="full",
        precision="fp32",
    )
    assert all(d == "keep" for d in plan.decisions.values()), plan.decisions
    notes = " ".join(plan.notes)
    assert "never recomputed: transformer.h.0, transformer.h.1, transformer.h.2" in notes
    assert "aten.cat.default [((4, 2, 64, 16)" in notes and "((4, 2, 128, 16)" in notes, notes
    assert "lift_fresh" not in notes and "DynamicCache" in notes and "use_cache=False" in notes
    names = [f"transformer.h.{i}" for i in range(3)]
    assert unstable_units(model, lambda: model(**inputs), names) == {}  # use_cache=False


_TRANSFORMERS = ("gpt2", "llama", "bert", "t5", "vit")


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_are_checkpointable_and_bitwise_under_dropout(name: str) -> None:
    model, inputs = _zoo_model(name)
    plans = _zoo_plans(model, inputs)
    assert not any("never recomputed" in note for note in plans.full.notes), plans.full.notes
    assert any(d == "recompute" for d in plans.full.decisions.values()), plans.full.decisions
    assert any(d != "keep" for d in plans.half.decisions.values()) or plans.half.segments

    peaks = {}
    for kind in ("none", "full", "least", "half"):
        memfit.apply_plan(model, getattr(plans, kind))
        try:
            peaks[kind] = _measured_peak(model, inputs)
        finally:
            remove_plan(model)
    assert peaks["full"] < peaks["none"], peaks
    if name in _TRANSFORMERS:  # the blocks hold most activations: full leaves the rest
        assert peaks["full"] <= 0.8 * peaks["none"], peaks
    else:  # the stages are the outer units (a full rebuild holds a whole stage)
        assert peaks["least"] <= 0.8 * peaks["none"], peaks
    assert peaks["least"] <= plans.least.budget_bytes, (peaks, plans.least.decisions)
    assert peaks["half"] <= plans.half.budget_bytes, (peaks, plans.half.decisions)

    base = _step(copy.deepcopy(model), inputs)
    for plan in (plans.full, plans.least, plans.half):
        planned = copy.deepcopy(model)
        memfit.apply_plan(planned, plan)
        got = _step(planned, inputs)
        assert torch.equal(got["loss"], base["loss"]), plan.decisions
        assert got["grads"].keys() == base["grads"].keys()
        differ = [n for n in base["grads"] if not torch.equal(got["grads"][n], base["grads"][n])]
        assert not differ, (plan.decisions, plan.segments, differ)
        assert all(torch.equal(got["buffers"][n], b) for n, b in base["buffers"].items())
