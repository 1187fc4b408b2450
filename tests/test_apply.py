"""The checkpoint executor: bitwise-equal gradients, BatchNorm statistics, reversibility."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.checkpoint.apply import (
    applied_plan,
    apply_plan,
    is_applied,
    planned,
    remove_plan,
    suspended,
)
from memfit.checkpoint.profiler import flop_counter, profile
from memfit.checkpoint.tree import find_units, structure_fingerprint
from memfit.errors import PlanError

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- test models


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TBlock(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MiniTransformer(nn.Module):
    def __init__(self, n_layer: int = 3, d: int = 16, vocab: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList([TBlock(d, 2, p) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class MiniCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU())
        self.stages = nn.Sequential(
            nn.Sequential(ConvBlock(4, 4), ConvBlock(4, 4)),
            nn.Sequential(ConvBlock(4, 8, 2), ConvBlock(8, 8)),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class MiniLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([nn.LSTM(8, 12, batch_first=True), nn.LSTM(12, 12)])
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(12, 20)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x, _ = self.layers[0](x)
        x = self.drop(x).transpose(0, 1)
        x, _ = self.layers[1](x)
        return self.head(x)


class KwBlock(nn.Module):
    """Takes keyword arguments, returns a tuple with a tensor, None and an int."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> tuple[torch.Tensor, None, int]:
        h = torch.tanh(self.fc(x)) * torch.sigmoid(self.gate(x)) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return F.dropout(h, 0.1, self.training) + x, None, 3


class KwModel(nn.Module):
    def __init__(self, n: int = 3, d: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([KwBlock(d) for _ in range(n)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, object]:
        h = self.inp(x)
        for block in self.blocks:
            h, nothing, three = block(h, mask=mask, scale=0.5)
            assert nothing is None and three == 3
        return {"out": h, "count": 3}


# --------------------------------------------------------------------------- helpers


def _call(model: nn.Module, inputs: object) -> object:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, dict):
        out = out["out"]
    return (out.float() ** 2).mean()


def _step(model: nn.Module, inputs: object, autocast: bool = False, seed: int = 0) -> dict:
    """One forward + backward from a fixed RNG state: grads, loss, buffers."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ctx = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = _loss(_call(model, inputs))
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    assert a["buffers"].keys() == b["buffers"].keys()
    for name in a["buffers"]:
        assert torch.equal(a["buffers"][name], b["buffers"][name]), name


def _check_plan(model: nn.Module, inputs: object, plan: object, autocast: bool = False) -> None:
    base, planned_model = copy.deepcopy(model), copy.deepcopy(model)
    keys = list(planned_model.state_dict())
    apply_plan(planned_model, plan)
    assert list(planned_model.state_dict()) == keys
    _assert_same(_step(base, inputs, autocast), _step(planned_model, inputs, autocast))


def _tokens(shape: tuple[int, ...] = (2, 8), vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def _images() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))


def _kw_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(2, 5, 12, generator=g),
        "mask": torch.rand(2, 5, 12, generator=g) < 0.2,
    }


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --------------------------------------------------------------------------- bitwise gradients

TRANSFORMER_PLANS = [
    {"blocks.0": "recompute"},
    {"blocks.1": "selective"},
    {"decisions": {}, "segments": {"blocks": [(0, 1)]}},
    {"decisions": {"blocks.2": "selective"}, "segments": {"blocks": [(0, 1)]}},
    {"decisions": {"blocks.0": "recompute", "blocks.1": "selective", "blocks.2": "recompute"}},
    {"": "recompute"},
]


@pytest.mark.parametrize("plan", TRANSFORMER_PLANS)
def test_transformer_with_dropout_bitwise(plan: dict) -> None:
    _check_plan(MiniTransformer(), _tokens(), plan)


@pytest.mark.parametrize("plan", TRANSFORMER_PLANS[:4])
def test_transformer_under_bf16_autocast_bitwise(plan: dict) -> None:
    _check_plan(MiniTransformer(), _tokens(), plan, autocast=True)


def test_transformer_with_bf16_weights_bitwise() -> None:
    model = MiniTransformer().to(torch.bfloat16)
    plan = {"decisions": {"blocks.2": "selective"}, "segments": {"blocks": [(0, 1)]}}
    _check_plan(model, _tokens(), plan, autocast=True)


CNN_PLANS = [
    {"stages.0.0": "recompute"},
    {"stages.1": "selective", "stages.0.1": "selective"},
    {"decisions": {}, "segments": {"stages.0": [(0, 1)]}},
    {"decisions": {"stages.1.1": "recompute"}, "segments": {"stages": [(0, 1)]}},
    {"decisions": {}, "segments": {"stages.0": [(0, 1)], "stages.1": [(0, 1)]}},
]


@pytest.mark.parametrize("plan", CNN_PLANS)
def test_cnn_with_batchnorm_bitwise_and_stats_updated_once(plan: dict) -> None:
    # _check_plan compares buffers too: running_mean/var and num_batches_tracked.
    model = MiniCNN()
    _check_plan(model, _images(), plan)


def test_batchnorm_stats_after_two_steps_and_in_eval() -> None:
    model = MiniCNN()
    base, cp = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(cp, {"stages.0.0": "recompute", "stages.1": "selective"})
    for seed in range(2):
        _assert_same(_step(base, _images(), seed=seed), _step(cp, _images(), seed=seed))
    base.eval(), cp.eval()
    _assert_same(_step(base, _images()), _step(cp, _images()))


def test_lstm_bitwise() -> None:
    _check_plan(MiniLSTM(), _tokens((3, 6), 20), {"layers.0": "recompute", "layers.1": "selective"})


@pytest.mark.parametrize(
    "plan",
    [
        {"blocks.0": "recompute", "blocks.2": "recompute"},
        {"blocks.0": "selective", "blocks.1": "recompute", "blocks.2": "selective"},
        {"": "recompute"},  # a dict output with a non-tensor value
    ],
)
def test_keyword_arguments_and_tuple_outputs_bitwise(plan: dict) -> None:
    _check_plan(KwModel(), _kw_inputs(), plan)


def test_frozen_parameters_and_inputs_without_grad() -> None:
    model = MiniCNN()
    for p in model.stem.parameters():
        p.requires_grad_(False)
    for p in model.stages[0].parameters():
        p.requires_grad_(False)
    plan = {"decisions": {"stages.1.0": "selective"}, "segments": {"stages.0": [(0, 1)]}}
    _check_plan(model, _images(), plan)
    # A recomputed unit none of whose inputs or parameters need grad.
    _check_plan(model, _images(), {"stages.0.0": "recompute", "stages.0.1": "selective"})


def test_no_grad_forward_is_unchanged() -> None:
    model = MiniTransformer().eval()
    x = _tokens()
    with torch.no_grad():
        ref = model(x)
        with planned(
            model, {"decisions": {"blocks.2": "recompute"}, "segments": {"blocks": [(0, 1)]}}
        ):
            assert torch.equal(model(x), ref)


def test_deepcopy_of_planned_model_runs_its_own_modules() -> None:
    model = MiniTransformer()
    apply_plan(model, {"decisions": {"blocks.2": "recompute"}, "segments": {"blocks": [(0, 1)]}})
    clone = copy.deepcopy(model)
    assert is_applied(clone)
    assert clone.blocks[2].forward.__self__ is clone.blocks[2]
    base = copy.deepcopy(model)
    remove_plan(base)
    _assert_same(_step(base, _tokens()), _step(clone, _tokens()))
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- FLOPs of recompute


def _flops(model: nn.Module, inputs: object) -> int:
    model.zero_grad(set_to_none=True)
    with flop_counter() as counter:
        _loss(_call(model, inputs)).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize(
    ("plan", "recomputed", "last", "selective"),
    [
        ({"blocks.0": "recompute"}, ["blocks.0"], ["blocks.0"], []),
        (
            {"blocks.0": "recompute", "blocks.2": "recompute"},
            ["blocks.0", "blocks.2"],
            ["blocks.0", "blocks.2"],
            [],
        ),
        (
            {"decisions": {}, "segments": {"blocks": [(0, 1)]}},
            ["blocks.0", "blocks.1"],
            ["blocks.1"],
            [],
        ),
        ({"blocks.1": "selective"}, [], [], ["blocks.1"]),
    ],
)
def test_recompute_flops_match_profile(
    plan: dict, recomputed: list, last: list, selective: list, early_stop: bool
) -> None:
    model = MiniTransformer(p=0.0)
    x = _tokens()
    prof = profile(model, x, loss_fn=_loss)
    base = _flops(model, x)
    with planned(model, plan, early_stop=early_stop):
        extra = _flops(model, x) - base
    expected = sum(prof[n].fwd_flops for n in recomputed)
    expected += sum(prof[n].non_matmul_fwd_flops for n in selective)
    if early_stop:
        # Each piece's tail (the block's output projection) is not run again.
        assert all(prof[n].tail_flops > 0 for n in last)
        expected -= sum(prof[n].tail_flops for n in last)
    assert extra == expected
    if recomputed:
        assert extra > 0


def test_recompute_flops_cnn() -> None:
    model = MiniCNN()
    x = _images()
    prof = profile(model, x, loss_fn=_loss)
    base = _flops(model, x)
    with planned(
        model,
        {"decisions": {"stages.1.1": "recompute"}, "segments": {"stages.0": [(0, 1)]}},
        early_stop=False,
    ):
        extra = _flops(model, x) - base
    assert extra == prof["stages.0"].fwd_flops + prof["stages.1.1"].fwd_flops > 0


def test_early_stop_recomputes_less() -> None:
    model = MiniTransformer(p=0.0)
    x = _tokens()
    base = _flops(model, x)
    with planned(model, {"blocks.0": "recompute"}, early_stop=False):
        full = _flops(model, x) - base
    with planned(model, {"blocks.0": "recompute"}):
        early = _flops(model, x) - base
    assert 0 < early < full


# --------------------------------------------------------------------------- apply / remove


def _snapshot(model: nn.Module) -> list:
    return [(n, type(m), "forward" in m.__dict__) for n, m in model.named_modules()]


def test_apply_twice_equals_once_and_remove_restores() -> None:
    model = MiniTransformer()
    before = _snapshot(model)
    keys = list(model.state_dict())
    ref = _step(copy.deepcopy(model), _tokens())
    plan = {"decisions": {"blocks.2": "recompute"}, "segments": {"blocks": [(0, 1)]}}

    apply_plan(model, plan)
    once = _snapshot(model)
    x = _tokens()
    with flop_counter() as c1:
        _loss(model(x)).backward()
    apply_plan(model, plan)
    assert _snapshot(model) == once
    with flop_counter() as c2:
        _loss(model(x)).backward()
    assert c1.get_total_flops() == c2.get_total_flops()
    assert list(model.state_dict()) == keys
    assert len(model.blocks) == 3 and isinstance(model.blocks[0], TBlock)
    assert type(model.blocks).__name__ == "ModuleList"
    assert structure_fingerprint(model, find_units(model))[1] == ("blocks", "ModuleList")
    _assert_same(ref, _step(model, _tokens()))

    remove_plan(model)
    assert not is_applied(model)
    assert _snapshot(model) == before
    assert type(model.blocks) is nn.ModuleList
    assert model.blocks[2].forward.__func__ is TBlock.forward
    assert list(model.state_dict()) == keys
    _assert_same(ref, _step(model, _tokens()))
    remove_plan(model)  # a no-op


def test_apply_another_plan_replaces_the_previous() -> None:
    model = MiniTransformer()
    apply_plan(model, {"decisions": {"blocks.0": "recompute"}, "segments": {"blocks": [(1, 2)]}})
    apply_plan(model, {"blocks.1": "selective"})
    assert "forward" not in model.blocks[0].__dict__
    assert "forward" in model.blocks[1].__dict__
    assert type(model.blocks) is nn.ModuleList
    assert [type(b) for b in model.blocks] == [TBlock] * 3


def test_sequential_segments_override_forward_and_iteration() -> None:
    # Called, a segmented Sequential walks its segments; iterated by its parent, it yields
    # them (its class is a same-named subclass meanwhile); removing the plan restores both.
    model = MiniCNN()
    apply_plan(model, {"decisions": {"stages.0": "recompute"}, "segments": {"stages.0": [(0, 1)]}})
    stage = model.stages[0]
    assert isinstance(stage, nn.Sequential) and type(stage).__name__ == "Sequential"
    assert "forward" in stage.__dict__
    assert len(list(stage)) == len(stage) - 1  # children 0..1 are one segment
    remove_plan(model)
    assert type(model.stages[0]) is nn.Sequential
    assert "forward" not in model.stages[0].__dict__


def test_instance_forward_is_restored() -> None:
    model = MiniTransformer()
    original = model.blocks[0].forward
    model.blocks[0].forward = lambda x: original(x)
    custom = model.blocks[0].forward
    apply_plan(model, {"blocks.0": "recompute"})
    assert model.blocks[0].forward is not custom
    remove_plan(model)
    assert model.blocks[0].forward is custom


def test_is_applied_applied_plan_and_context_manager() -> None:
    model = MiniTransformer()
    first = {"blocks.0": "recompute"}
    assert not is_applied(model) and applied_plan(model) is None
    apply_plan(model, first)
    assert is_applied(model) and applied_plan(model) is first
    with planned(model, {"blocks.1": "selective"}) as m:
        assert m is model
        assert "forward" in model.blocks[1].__dict__
        assert "forward" not in model.blocks[0].__dict__
    assert applied_plan(model) is first
    assert "forward" in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__


def test_suspended_takes_the_plan_off_and_puts_it_back() -> None:
    model = MiniTransformer()
    unplanned = _snapshot(model)
    x = _tokens()
    with flop_counter() as plain:
        _loss(model(x)).backward()
    plan = {"decisions": {"blocks.2": "recompute"}, "segments": {"blocks": [(0, 1)]}}
    apply_plan(model, plan, early_stop=False)
    applied = _snapshot(model)
    with flop_counter() as before:
        _loss(model(x)).backward()

    with suspended(model) as m:
        assert m is model
        assert not is_applied(model) and applied_plan(model) is None
        assert _snapshot(model) == unplanned and type(model.blocks) is nn.ModuleList
        with flop_counter() as inside:
            _loss(model(x)).backward()
        assert inside.get_total_flops() == plain.get_total_flops()
    assert applied_plan(model) is plan and _snapshot(model) == applied
    with flop_counter() as after:  # early_stop=False again: the same recompute
        _loss(model(x)).backward()
    assert after.get_total_flops() == before.get_total_flops() > plain.get_total_flops()

    # Put back when the block raises, too.
    with pytest.raises(RuntimeError, match="inside"):
        with suspended(model):
            assert not is_applied(model)
            raise RuntimeError("inside")
    assert applied_plan(model) is plan and _snapshot(model) == applied

    # A model without a plan: nothing to take off, nothing put on.
    remove_plan(model)
    with suspended(model):
        assert _snapshot(model) == unplanned
    assert not is_applied(model) and _snapshot(model) == unplanned


def test_accepts_plan_like_objects() -> None:
    model = MiniTransformer()
    sol = SimpleNamespace(decisions={"blocks.0": "keep", "blocks.1": "recompute"}, segments={})
    apply_plan(model, sol)
    assert "forward" in model.blocks[1].__dict__ and "forward" not in model.blocks[0].__dict__


# --------------------------------------------------------------------------- errors


class _Plan(SimpleNamespace):
    def check_structure(self, fingerprint: list) -> None:
        if [tuple(e) for e in self.structure] != fingerprint:
            raise PlanError("structure mismatch")


def test_structure_fingerprint_mismatch_is_refused() -> None:
    small, big = MiniTransformer(n_layer=2), MiniTransformer(n_layer=3)
    structure = structure_fingerprint(small, find_units(small))
    plan = SimpleNamespace(decisions={"blocks.0": "recompute"}, segments={}, structure=structure)
    apply_plan(small, plan)
    with pytest.raises(PlanError, match="another model"):
        apply_plan(big, plan)
    checked = _Plan(decisions={"blocks.0": "recompute"}, segments={}, structure=structure)
    apply_plan(small, checked)
    with pytest.raises(PlanError, match="mismatch"):
        apply_plan(big, checked)
    with pytest.raises(PlanError):
        apply_plan(MiniCNN(), plan)
    assert not is_applied(big)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        ({"blocks.7": "recompute"}, "no submodule named 'blocks.7'"),
        ({"blokcs.0": "recompute"}, "Did you mean 'blocks.0'"),
        ({"blocks.0": "offload"}, "unknown decision"),
        ({"blocks": "recompute"}, "no forward of its own"),
        ({"decisions": {}, "segments": {"blocks": [(1, 3)]}}, "out of range"),
        ({"decisions": {}, "segments": {"blocks": [(0, 1), (1, 2)]}}, "overlap"),
        ({"decisions": {}, "segments": {"blocks.0": [(0, 1)]}}, "ModuleList or nn.Sequential"),
        (42, "cannot apply"),
    ],
)
def test_bad_plans_raise_plan_error(plan: object, match: str) -> None:
    model = MiniTransformer()
    with pytest.raises(PlanError, match=match):
        apply_plan(model, plan)
    assert not is_applied(model)


def test_selective_on_a_matmul_output_changed_in_place_names_the_unit() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)), nn.Sequential(nn.Linear(8, 8))
    )
    x = torch.randn(4, 8)
    apply_plan(model, {"0": "selective"})
    with pytest.raises(PlanError, match="unit '0' is checkpointed 'selective'.*'recompute'"):
        model(x).sum().backward()
    # The same unit recomputed whole trains, with the unplanned model's gradients.
    apply_plan(model, {"0": "recompute"})
    model.zero_grad()  # the failed backward may have made some gradients
    model(x).sum().backward()
    planned_grads = [p.grad.clone() for p in model.parameters()]
    remove_plan(model)
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(planned_grads, model.parameters()))


# --------------------------------------------------------------------------- built-in models


def test_builtin_models_bitwise() -> None:
    models = pytest.importorskip("memfit.models")
    gpt = models.GPT(models.GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, dropout=0.1))
    tokens = _tokens((2, 16), 256)
    _check_plan(
        gpt, tokens, {"decisions": {"blocks.2": "selective"}, "segments": {"blocks": [(0, 1)]}}
    )
    resnet = models.ResNet(models.ResNetConfig(widths=(4, 8), blocks_per_stage=(2, 2)))
    plan = {"decisions": {"stages.1.0": "recompute"}, "segments": {"stages.0": [(0, 1)]}}
    _check_plan(resnet, torch.randn(4, 3, 8, 8), plan)
    lstm = models.LSTMLM(models.LSTMConfig(n_embd=8, hidden_size=12, n_layer=3, dropout=0.1))
    plan = {"decisions": {"layers.2": "selective"}, "segments": {"layers": [(0, 1)]}}
    _check_plan(lstm, _tokens((2, 6), 256), plan)


# --------------------------------------------------------------------------- Hugging Face


def test_hf_gpt2_blocks_with_kwargs_bitwise() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16, attn_implementation="eager"
    )
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = _tokens((2, 8), 64)
    names = find_units(model).names()
    assert {"transformer.h.0", "transformer.h.2"} <= set(names)
    base, cp = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(cp, {"transformer.h.0": "recompute", "transformer.h.1": "selective"})

    def step(m: nn.Module) -> dict:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return {
            "loss": out.loss.detach(),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in m.named_buffers()},
        }

    _assert_same(step(base), step(cp))


def _hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=3)
    shape.update(num_attention_heads=4, max_position_embeddings=16)
    if kind == "llama":  # blocks under model.layers, rotary embeddings passed by keyword
        cfg = transformers.LlamaConfig(**shape, num_key_value_heads=2, attention_dropout=0.1)
        return transformers.LlamaForCausalLM(cfg).train()
    cfg = transformers.BertConfig(**shape)  # blocks under bert.encoder.layer, dropout 0.1
    return transformers.BertForMaskedLM(cfg).train()


@pytest.mark.parametrize("kind", ["llama", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_hf_llama_and_bert_planned_under_a_budget_bitwise(kind: str, precision: str) -> None:
    import memfit
    from memfit.checkpoint.planner import RESERVE

    model = _hf_model(kind)
    ids = _tokens((4, 16), 64)
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "llama":  # trained without its key/value cache, as with HF's own checkpointing
        inputs["use_cache"] = False

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    whole = memfit.plan(model, inputs, loss_fn, precision=precision)
    peaks = [p.peak_bytes for p in whole.frontier]
    assert min(peaks) < max(peaks), "the blocks' activations must be worth checkpointing"
    budget = int((min(peaks) + max(peaks)) / 2 / (1 - RESERVE)) + 1  # plans keep RESERVE free
    # The plan as predicted (not verified): its gradients are what this test is about, and
    # a verified plan may recompute nothing where the prediction was high (bf16 BERT).
    plan = memfit.plan(model, inputs, loss_fn, budget=budget, precision=precision, verify=False)
    # Selective recompute re-runs no matmuls, so its FLOPs may be 0: look at decisions.
    assert any(d != "keep" for d in plan.decisions.values()) or plan.segments
    base, cp = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(cp, plan)

    def step(m: nn.Module) -> dict:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            out = m(**inputs)
        out.loss.backward()
        return {
            "loss": out.loss.detach(),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in m.named_buffers()},
        }

    _assert_same(step(base), step(cp))


# --------------------------------------------------------------------------- with the solvers


@pytest.mark.parametrize("strategy", ["full", "uniform:2", "sqrt", "optimal"])
def test_profile_solve_apply_pipeline(strategy: str) -> None:
    solve_mod = pytest.importorskip("memfit.checkpoint.solvers")
    model = MiniCNN()
    x = _images()
    prof = profile(model, x, loss_fn=_loss)
    static = prof.param_bytes + prof.grad_bytes
    budget = None
    if strategy == "optimal":
        # Half-way between the smallest peak a plan reaches and keeping everything.
        frontier = solve_mod.solve(prof.root, "optimal", None, static).frontier
        budget = (frontier[0].peak_bytes + frontier[-1].peak_bytes) / 2
    solution = solve_mod.solve(prof.root, strategy, budget, static)
    assert any(d != "keep" for d in solution.decisions.values()) or solution.segments
    _check_plan(model, x, solution)


# --------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _close(a: dict, b: dict) -> None:
    # CUDA backward kernels may accumulate in a different order from run to run (atomics),
    # so gradients are compared to rounding; a wrong dropout mask would be far off.
    torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=0)
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        torch.testing.assert_close(a["grads"][name], b["grads"][name], rtol=1e-5, atol=1e-6)
    for name in a["buffers"]:
        torch.testing.assert_close(a["buffers"][name], b["buffers"][name], rtol=0, atol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_dropout_replays_and_kwargs(autocast: bool) -> None:
    def step(m: nn.Module, inputs: object) -> dict:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        ctx = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = _loss(_call(m, inputs))
        loss.backward()
        return {
            "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in m.named_buffers()},
        }

    cases = [
        (MiniTransformer().cuda(), _tokens().cuda(), TRANSFORMER_PLANS[3]),
        (MiniCNN().cuda(), _images().cuda(), CNN_PLANS[3]),
        # Every tensor reaches the blocks by keyword: the CUDA RNG state must still be saved.
        (
            KwModel().cuda(),
            {k: v.cuda() for k, v in _kw_inputs().items()},
            {"blocks.1": "recompute"},
        ),
    ]
    for model, inputs, plan in cases:
        base, cp = copy.deepcopy(model), copy.deepcopy(model)
        apply_plan(cp, plan)
        _close(step(base, inputs), step(cp, inputs))


def test_segments_of_a_sequential_its_parent_iterates_are_recomputed() -> None:
    # Hugging Face's ResNet stages walk an nn.Sequential with `for layer in self.layers`
    # instead of calling it: a segment there must run, not only a called Sequential's.
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                *[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model, x = Stage(), torch.randn(32, 64)
    reference = copy.deepcopy(model)

    def flops(m: nn.Module) -> int:
        with flop_counter() as counter:
            m(x).sum().backward()
        return counter.get_total_flops()

    names = ["", "layers", *[f"layers.{i}" for i in range(4)]]
    apply_plan(model, {"decisions": dict.fromkeys(names, "keep"), "segments": {"layers": [(0, 3)]}})
    # The four layers run again (the last ReLU saves its output: no tail to skip).
    assert flops(model) - flops(reference) == 4 * 2 * 32 * 64 * 64
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert model.layers(x).shape == (32, 64)  # called, it still works, in segments too
    remove_plan(model)
    assert type(model.layers) is nn.Sequential


def test_selective_recomputes_an_attention_that_draws_random_numbers() -> None:
    # Saved, an attention with dropout would not run in the rebuild, and every random op
    # after it would draw from another generator state (on CUDA: other dropout masks).
    from torch.utils.checkpoint import CheckpointPolicy

    from memfit.checkpoint.recompute import save_matmul_outputs, saved_by_selective

    aten = torch.ops.aten
    q = torch.randn(1, 2, 4, 8)
    efficient = aten._scaled_dot_product_efficient_attention.default
    flash = aten._scaled_dot_product_flash_attention.default
    assert saved_by_selective(aten.mm.default, (q[0, 0], q[0, 0].T), {})
    assert saved_by_selective(efficient, (q, q, q, None, True), {})  # dropout_p defaults to 0
    assert not saved_by_selective(efficient, (q, q, q, None, True), {"dropout_p": 0.1})
    assert not saved_by_selective(efficient, (q, q, q, None, True, 0.1), {})
    assert not saved_by_selective(flash, (q, q, q, 0.1), {})
    assert saved_by_selective(flash, (q, q, q, 0.0), {})
    assert not saved_by_selective(aten.relu.default, (q,), {})
    assert save_matmul_outputs(None, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert save_matmul_outputs(None, flash, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
