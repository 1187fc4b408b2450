"""The reference models (GPT, ResNet, LSTM) and the registry that builds them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.data import TextCorpus
from memfit.errors import ConfigError
from memfit.models import (
    GPT,
    LSTMLM,
    MODELS,
    BasicBlock,
    Block,
    BuiltModel,
    GPTConfig,
    LSTMConfig,
    LSTMLayer,
    ResNet,
    ResNetConfig,
    build_model,
    gpt_loss,
    lstm_loss,
    make_config,
    model_names,
    resnet_loss,
)
from memfit.precision import PrecisionPolicy, precision_applied

TINY_GPT = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
TINY_LSTM = LSTMConfig(n_embd=16, hidden_size=32, n_layer=2)
TINY_RESNET = ResNetConfig(widths=(8, 16), blocks_per_stage=(1, 2))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-corpus-cache")


@pytest.fixture(scope="module")
def corpus(cache_dir: Path) -> TextCorpus:
    return TextCorpus.load(max_bytes=200_000, cache_dir=cache_dir)


def _bytes_batch(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, t + 1), generator=torch.Generator().manual_seed(seed))


# --- GPT ---------------------------------------------------------------------------------


def test_gpt_shapes_and_structure() -> None:
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    logits = model(_bytes_batch(3, 20)[:, :-1])
    assert logits.shape == (3, 20, 256) and logits.dtype == torch.float32
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    assert all(isinstance(b, Block) for b in model.blocks)
    assert isinstance(model.ln_f, nn.LayerNorm)
    assert GPT().config == GPTConfig()


def test_gpt_head_is_tied_to_the_embedding() -> None:
    model = GPT(TINY_GPT)
    assert model.lm_head.weight is model.tok_emb.weight
    gpt_loss(model, _bytes_batch(2, 16)).backward()
    assert model.tok_emb.weight.grad is not None
    c = TINY_GPT
    per_block = 12 * c.n_embd**2 + 13 * c.n_embd  # qkv, out, fc, proj weights+biases, 2 LNs
    expected = (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert model.num_params() == expected
    assert model.num_params(exclude_embeddings=True) == expected - c.block_size * c.n_embd


def test_gpt_forward_iterates_the_block_list() -> None:
    # The checkpoint executor swaps in its own iteration of `blocks`; that only works if
    # forward walks the ModuleList through __iter__ rather than indexing it.
    calls = []

    class CountingList(nn.ModuleList):
        def __iter__(self):  # type: ignore[override]
            calls.append(1)
            return super().__iter__()

    model = GPT(TINY_GPT)
    model.blocks.__class__ = CountingList
    model(_bytes_batch(1, 8)[:, :-1])
    assert calls == [1]


def test_gpt_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=128))
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.out_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.attn.qkv.bias.abs().max() == 0


def test_gpt_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    batch = _bytes_batch(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
        loss = GPT.loss(logits, batch[:, 1:])
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # the loss is always computed in fp32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
    fp32 = gpt_loss(model, batch)
    assert abs(loss.item() - fp32.item()) < 0.05


def test_gpt_loss_matches_staticmethod() -> None:
    model = GPT(TINY_GPT)
    batch = _bytes_batch(2, 16)
    assert torch.equal(gpt_loss(model, batch), GPT.loss(model(batch[:, :-1]), batch[:, 1:]))
    # Untrained: close to uniform over the 256 bytes.
    assert abs(gpt_loss(model, batch).item() - math.log(256)) < 0.5


def test_gpt_learns_on_the_corpus(corpus: TextCorpus) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64))
    batch = corpus.batch("train", 8, 64, generator=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = gpt_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5, losses


def test_gpt_flops_per_token() -> None:
    model = GPT(TINY_GPT)
    c = TINY_GPT
    n = model.num_params(exclude_embeddings=True)
    assert model.flops_per_token() == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
    assert model.flops_per_token(seq_len=8) == 6 * n + 12 * c.n_layer * c.n_embd * 8


def test_gpt_rejects_long_sequences_and_bad_configs() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        GPT(TINY_GPT)(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError):
        GPTConfig(n_layer=0)
    with pytest.raises(ConfigError):
        GPTConfig(dropout=1.0)


def test_gpt_without_bias_and_with_dropout() -> None:
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False, dropout=0.1))
    assert model.blocks[0].attn.qkv.bias is None and model.ln_f.bias is None
    batch = _bytes_batch(2, 16)
    gpt_loss(model, batch).backward()
    model.eval()
    assert torch.equal(model(batch[:, :-1]), model(batch[:, :-1]))


def test_blocks_are_checkpointable_units() -> None:
    # Each block maps a tensor to a tensor, so torch's checkpoint over it must give the same
    # gradients as the plain forward.
    torch.manual_seed(0)
    ref = GPT(TINY_GPT)
    batch = _bytes_batch(2, 16)
    gpt_loss(ref, batch).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    for block in ref.blocks:
        orig = block.forward
        block.forward = lambda x, f=orig: checkpoint(f, x, use_reentrant=False)  # type: ignore[method-assign]
    gpt_loss(ref, batch).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


# --- ResNet ------------------------------------------------------------------------------


def test_resnet_shapes_and_structure() -> None:
    model = ResNet(TINY_RESNET)
    assert isinstance(model.stages, nn.Sequential) and len(model.stages) == 2
    assert all(isinstance(s, nn.Sequential) for s in model.stages)
    assert [len(s) for s in model.stages] == [1, 2]
    assert all(isinstance(b, BasicBlock) for s in model.stages for b in s)
    x = torch.randn(4, 3, 32, 32)
    assert model(x).shape == (4, 10)
    assert model.stages(model.stem(x)).shape == (4, 16, 16, 16)  # second stage halves H, W
    assert ResNet().num_params() > model.num_params()


def test_resnet_trains_on_synthetic_images() -> None:
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("resnet", config=TINY_RESNET)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        loss = loss_fn(model, batch_fn(32, generator=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 0.4, losses


def test_resnet_under_bf16_autocast() -> None:
    model = ResNet(TINY_RESNET)
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = resnet_loss(model, (images, labels))
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_resnet_config_validation() -> None:
    with pytest.raises(ConfigError, match="equal length"):
        ResNetConfig(widths=(8, 16), blocks_per_stage=(1,))
    with pytest.raises(ConfigError):
        ResNetConfig(num_classes=0)
    assert ResNetConfig(widths=[8], blocks_per_stage=[1]).widths == (8,)  # type: ignore[arg-type]


# --- LSTM --------------------------------------------------------------------------------


def test_lstm_shapes_and_structure() -> None:
    model = LSTMLM(TINY_LSTM)
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 2
    assert all(isinstance(layer, LSTMLayer) for layer in model.layers)
    assert all(layer.lstm.num_layers == 1 for layer in model.layers)
    x = torch.randn(3, 7, 16)
    out = model.layers[0](x)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 7, 32)  # tensor in, tensor out
    assert model(_bytes_batch(3, 10)[:, :-1]).shape == (3, 10, 256)


def test_lstm_loss_and_bf16_autocast() -> None:
    torch.manual_seed(0)
    model = LSTMLM(TINY_LSTM)
    batch = _bytes_batch(2, 12)
    assert abs(lstm_loss(model, batch).item() - math.log(256)) < 0.2
    # Under memfit's bf16-mixed policy, as training runs it: where this CPU has no bf16
    # LSTM kernel (AVX2 only), the LSTM layers run as fp32 islands instead of failing.
    with (
        precision_applied(model, PrecisionPolicy("bf16-mixed")),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        loss = lstm_loss(model, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_lstm_forget_bias_and_checkpointing() -> None:
    torch.manual_seed(0)
    model = LSTMLM(TINY_LSTM)
    h = TINY_LSTM.hidden_size
    bias = model.layers[0].lstm.bias_ih_l0
    assert torch.all(bias[h : 2 * h] == 0.5) and torch.all(bias[:h] == 0)
    batch = _bytes_batch(2, 12)
    lstm_loss(model, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for layer in model.layers:
        orig = layer.forward
        layer.forward = lambda x, f=orig: checkpoint(f, x, use_reentrant=False)  # type: ignore[method-assign]
    lstm_loss(model, batch).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


# --- registry ----------------------------------------------------------------------------


def test_registry_names() -> None:
    assert model_names() == ["gpt", "resnet", "lstm"]
    assert set(MODELS) == set(model_names())


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="gpt, resnet, lstm"):
        build_model("bert")


def test_unknown_override_lists_valid_fields() -> None:
    with pytest.raises(ConfigError, match=r"n_layers.*Valid settings:.*n_layer"):
        build_model("gpt", n_layers=3)


def test_bad_data_kind() -> None:
    with pytest.raises(ConfigError, match="synthetic"):
        build_model("resnet", data="corpus")
    with pytest.raises(ConfigError, match="vocab_size"):
        build_model("gpt", vocab_size=100)  # the byte corpus needs 256 ids


def test_build_gpt_with_corpus(cache_dir: Path) -> None:
    built = build_model("GPT", n_layer=1, block_size=16, cache_dir=cache_dir, max_bytes=200_000)
    assert isinstance(built, BuiltModel)
    model, loss_fn, batch_fn = built
    assert isinstance(model, GPT) and built.config.n_layer == 1 and built.config.block_size == 16
    batch = batch_fn(4, generator=0)
    assert batch.shape == (4, 17) and batch.dtype == torch.long
    assert torch.equal(batch, batch_fn(4, generator=torch.Generator().manual_seed(0)))
    assert batch_fn(2, generator=0, split="val").shape == (2, 17)
    assert loss_fn(model, batch).ndim == 0


@pytest.mark.parametrize("name", ["gpt", "lstm"])
def test_build_text_models_with_synthetic_data(name: str) -> None:
    model, loss_fn, batch_fn = build_model(name, data="synthetic", vocab_size=64, n_layer=1)
    batch = batch_fn(3, generator=1)
    seq = 128  # the default block_size / seq_len
    assert batch.shape == (3, seq + 1) and int(batch.max()) < 64
    assert torch.equal(batch, batch_fn(3, generator=1))
    assert torch.isfinite(loss_fn(model, batch))


def test_build_resnet_and_start_config() -> None:
    model, loss_fn, batch_fn = build_model("resnet", config=TINY_RESNET, num_classes=5)
    images, labels = batch_fn(6, generator=0)
    assert torch.equal(batch_fn(6, generator=0, split="val")[0], images)
    assert images.shape == (6, 3, 32, 32) and int(labels.max()) < 5
    assert model(images).shape == (6, 5)
    assert TINY_RESNET.num_classes == 10  # the given config is not modified
    with pytest.raises(ConfigError, match="ResNetConfig"):
        make_config("resnet", config=TINY_GPT)


def test_build_model_device_meta() -> None:
    model, _, batch_fn = build_model("lstm", data="synthetic", device="meta", n_layer=1)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert batch_fn(2, generator=0).device.type == "meta"


def _chunk_case() -> tuple[GPT, torch.Tensor]:
    # A vocabulary large beside the width: the logits are most of the activations.
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=64)
    return GPT(cfg), torch.randint(0, 4096, (8, 65))


def test_chunked_gpt_loss_is_the_loss_without_the_whole_logits() -> None:
    from memfit.allocator import allocator_peak
    from memfit.models.gpt import chunked_gpt_loss

    model, batch = _chunk_case()

    def grads(loss_fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = grads(gpt_loss)
    chunked, chunked_grads = grads(lambda m, b: chunked_gpt_loss(m, b, 100))  # a ragged end
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)

    def peak(loss_fn) -> int:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()

        step()
        return allocator_peak(step, live=[*model.parameters(), batch]).peak_bytes

    # 8 x 64 tokens of 4096 fp32 logits (8 MiB, and the loss's copy) held no more, one
    # piece of 100 tokens at a time instead.
    assert peak(lambda m, b: chunked_gpt_loss(m, b, 100)) < 0.5 * peak(gpt_loss)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunked_gpt_loss(model, batch, 0)
    with pytest.raises(ConfigError, match="memfit's GPT itself"):  # a wrapper's forward
        chunked_gpt_loss(nn.Sequential(model), batch)


def test_the_planner_predicts_a_step_with_the_chunked_loss() -> None:
    import functools

    from memfit import apply_plan, remove_plan
    from memfit.checkpoint.api import make_plan
    from memfit.models.gpt import chunked_gpt_loss
    from tests.measured_steps import training_state_peak

    model, batch = _chunk_case()
    loss = functools.partial(chunked_gpt_loss, chunk_tokens=128)
    opt = torch.optim.AdamW(model.parameters())
    whole = make_plan(model, batch, loss, precision="fp32", optimizer=opt, costs="counted").plan
    least = min(p.peak_bytes for p in whole.frontier)
    for budget in (None, int(least / 0.98) + 1):
        plan = make_plan(
            model, batch, loss, precision="fp32", optimizer=opt, costs="counted", budget=budget
        ).plan

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss(model, batch).backward()

        apply_plan(model, plan)
        step()
        opt.step()  # the optimizer's state exists, as the plan counts it
        # Forward and backward, where the loss's pieces run (the optimizer's step is the
        # same with either loss); the first measured run sees the gradients made that the
        # second frees (memfit.allocator: a profiler sizes the frees of what it saw made).
        training_state_peak(step, model, opt, batch)
        measured = training_state_peak(step, model, opt, batch).peak_bytes
        remove_plan(model)
        assert abs(plan.predicted_peak_bytes / measured - 1) < 0.03, (budget, measured)
