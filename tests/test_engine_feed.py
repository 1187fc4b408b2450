"""The Engine fed micro-batches as they come (backward ... step), short last batches, and its
small contracts: a budget implies planning, units= and find_units, Hugging Face's own
gradient checkpointing replaced."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_cases import assert_bitwise as _assert_bitwise
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.apply import applied_plan
from memfit.engine import Engine, split_batch
from memfit.errors import ConfigError, PlanError

pytestmark = pytest.mark.usefixtures("one_thread")

Batch = tuple[torch.Tensor, torch.Tensor]


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _engine(precision: str = "fp32", seed: int = 0, **kwargs: Any) -> Engine:
    torch.manual_seed(seed)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    kwargs.setdefault("accumulation_steps", 4)
    return Engine(model, opt, precision=precision, lr_scheduler=sched, **kwargs)


def _sgd_engine(**kwargs: Any) -> Engine:
    torch.manual_seed(0)
    model = _net()
    kwargs.setdefault("precision", "fp32")
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _dataset(n: int = 50) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def _state(engine: Engine) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(engine.model.state_dict()),
        "master": copy.deepcopy(engine.master.state_dict()) if engine.master else None,
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "counters": (engine.steps, engine.micro_steps, engine.applied_steps),
    }


def _grads_at_step(opt: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    record: list[list[torch.Tensor]] = []

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        record.append([p.grad.clone() for g in optimizer.param_groups for p in g["params"]])

    opt.register_step_pre_hook(hook)
    return record


def _reference_grads(batch: Batch) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _net()
    _loss(model, batch).backward()
    return [p.grad for p in model.parameters()]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6) -> None:
    scale = b.abs().max().clamp_min(1e-12)
    assert (a - b).abs().max() <= rtol * scale, ((a - b).abs().max() / scale).item()


# --- micro-batches as they come ---------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_ragged_loader_fed_micro_batch_by_micro_batch_equals_the_split_path(
    precision: str,
) -> None:
    # 50 samples in batches of 16: the last has 2, fewer than accumulation_steps=4, and runs
    # as two micro-batches of one. Fed by hand, the same micro-batches train bitwise the same.
    loader = DataLoader(_dataset(50), batch_size=16)
    split = _engine(precision, clip_grad_norm=0.5)
    fed = _engine(precision, clip_grad_norm=0.5)
    for batch in loader:
        expected = split.train_step(batch, _loss)
        parts = split_batch(batch, min(len(batch[0]), 4))
        micro_losses = [fed.backward(micro, _loss) for micro in parts]
        assert fed.pending_micro_batches == len(parts)
        got = fed.step()
        assert fed.pending_micro_batches == 0
        _assert_bitwise(got, expected)
        _assert_bitwise(_state(fed), _state(split))
        assert all(m.dim() == 0 and not m.requires_grad for m in micro_losses)
    assert split.steps == fed.steps == 4 and split.micro_steps == fed.micro_steps == 14


def test_a_loader_of_micro_batches_trains_as_one_batch_per_step() -> None:
    # DataLoader(batch_size=4) of 50 samples: twelve micro-batches of 4, then one of 2. Each
    # step of four equals train_step on their concatenation bitwise; the last, short step
    # (one micro-batch of 2) gives the gradient of its two samples.
    data = _dataset(50)
    fed, split = _sgd_engine(accumulation_steps=4), _sgd_engine(accumulation_steps=4)
    fed_grads, split_grads = _grads_at_step(fed.optimizer), _grads_at_step(split.optimizer)
    losses = []
    before_last: dict[str, torch.Tensor] = {}
    for i, micro in enumerate(DataLoader(data, batch_size=4)):
        fed.backward(micro, _loss)
        if i % 4 == 3:
            losses.append(fed.step())
            before_last = copy.deepcopy(fed.model.state_dict())
    assert fed.pending_micro_batches == 1
    losses.append(fed.step())
    for i, batch in enumerate(DataLoader(data, batch_size=16)):
        expected = split.train_step(batch, _loss)
        if i < 3:
            _assert_bitwise(losses[i], expected)
            _assert_bitwise(fed_grads[i], split_grads[i])
    # The short step, one micro-batch of 2 weighted 2 / (2 * 4) and rescaled by 4, has the
    # gradient and the loss of those two samples.
    reference = _net()
    reference.load_state_dict(before_last)
    last = data[48:50]
    loss = _loss(reference, last)
    loss.backward()
    for got, want in zip(fed_grads[3], [p.grad for p in reference.parameters()]):
        _close(got, want)
    torch.testing.assert_close(losses[3], loss.detach(), rtol=1e-6, atol=0)
    assert fed.steps == 4 and fed.micro_steps == 13


def test_micro_batches_of_different_sizes_give_the_gradient_of_their_concatenation() -> None:
    data = _dataset(12)
    sizes = [5, 4, 2, 1]
    engine = _sgd_engine(accumulation_steps=4)
    record = _grads_at_step(engine.optimizer)
    start = 0
    for size in sizes:
        engine.backward(data[start : start + size], _loss)
        start += size
    loss = engine.step()
    whole = data[0:12]
    for got, want in zip(record[0], _reference_grads(whole)):
        _close(got, want)
    torch.manual_seed(0)
    torch.testing.assert_close(loss, _loss(_net(), whole).detach(), rtol=1e-6, atol=0)
    # An unweighted mean of the four losses is measurably different on this data.
    torch.manual_seed(0)
    model, start = _net(), 0
    for size in sizes:
        (_loss(model, data[start : start + size]) / len(sizes)).backward()
        start += size
    unweighted = [p.grad for p in model.parameters()]
    assert max((u - r).abs().max() for u, r in zip(unweighted, _reference_grads(whole))) > 1e-3


def test_a_batch_smaller_than_accumulation_steps_is_one_micro_batch_per_sample() -> None:
    engine = _sgd_engine(accumulation_steps=4)
    record = _grads_at_step(engine.optimizer)
    sizes: list[int] = []
    batch = _dataset(3)[0:3]
    loss = engine.train_step(batch, lambda m, b: sizes.append(len(b[0])) or _loss(m, b))
    assert sizes == [1, 1, 1] and engine.micro_steps == 3 and engine.steps == 1
    for got, want in zip(record[0], _reference_grads(batch)):
        _close(got, want)
    torch.manual_seed(0)
    torch.testing.assert_close(loss, _loss(_net(), batch).detach(), rtol=1e-6, atol=0)


def test_empty_batches_are_refused() -> None:
    engine = _sgd_engine(accumulation_steps=2)
    empty = (torch.zeros(0, 8), torch.zeros(0, 4))
    with pytest.raises(ConfigError, match="empty"):
        engine.train_step(empty, _loss)
    with pytest.raises(ConfigError, match="empty"):
        engine.backward(empty, _loss)
    assert engine.steps == 0 and engine.pending_micro_batches == 0


def test_step_without_micro_batches_and_train_step_while_some_wait_are_refused() -> None:
    engine = _sgd_engine(accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"engine\.backward"):
        engine.step()
    batch = _dataset(4)[0:4]
    engine.backward(batch, _loss)
    with pytest.raises(ConfigError, match=r"call engine\.step\(\) first"):
        engine.train_step(batch, _loss)
    assert engine.pending_micro_batches == 1  # refusing train_step lost nothing
    engine.backward(batch, _loss)
    with pytest.raises(ConfigError, match="accumulation_steps=2"):
        engine.backward(batch, _loss)
    # Feeding too many discarded the step: nothing waits, nothing was applied.
    assert engine.pending_micro_batches == 0 and engine.steps == 0
    assert all(p.grad is None for p in engine.model.parameters())


def test_save_waits_for_step_and_load_drops_the_micro_batches_fed(tmp_path: Any) -> None:
    data = _dataset(8)
    engine, clean = _sgd_engine(accumulation_steps=2), _sgd_engine(accumulation_steps=2)
    path = engine.save(tmp_path / "start.pt")
    engine.backward(data[0:4], _loss)
    # Saving now would leave the fed gradients out of the checkpoint: refused, nothing lost.
    with pytest.raises(ConfigError, match=r"call engine\.step\(\) first"):
        engine.save(tmp_path / "mid.pt")
    assert engine.pending_micro_batches == 1 and not (tmp_path / "mid.pt").exists()
    # Loading replaces the step in progress: the next step is the saved run's next one.
    engine.load(path)
    assert engine.pending_micro_batches == 0
    assert all(p.grad is None for p in engine.model.parameters())
    for e in (engine, clean):
        e.backward(data[4:8], _loss)
        e.backward(data[0:4], _loss)
        e.step()
    _assert_bitwise(engine.model.state_dict(), clean.model.state_dict())


def test_a_failed_micro_batch_discards_the_step_fed_so_far() -> None:
    data = _dataset(8)

    def out_of_memory(model: nn.Module, batch: Batch) -> torch.Tensor:
        raise RuntimeError("out of memory")

    engine, clean = _sgd_engine(accumulation_steps=2), _sgd_engine(accumulation_steps=2)
    engine.backward(data[0:4], _loss)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.backward(data[4:8], out_of_memory)
    assert engine.pending_micro_batches == 0
    assert all(p.grad is None for p in engine.model.parameters())
    for e in (engine, clean):
        e.backward(data[4:8], _loss)
        e.backward(data[0:4], _loss)
        e.step()
    _assert_bitwise(engine.model.state_dict(), clean.model.state_dict())


@pytest.mark.filterwarnings("ignore:precision 'fp16-mixed' on CPU")
def test_an_overflowed_step_fed_by_hand_is_skipped() -> None:
    engine = _sgd_engine(accumulation_steps=2, precision="fp16-mixed")
    before = copy.deepcopy(engine.model.state_dict())
    data = _dataset(8)
    engine.backward(data[0:4], _loss)
    engine.backward(data[4:8], lambda m, b: _loss(m, b) * float("inf"))
    engine.step()
    assert engine.steps == 1 and engine.applied_steps == 0
    _assert_bitwise(engine.model.state_dict(), before)
    engine.backward(data[0:4], _loss)
    engine.step()
    assert engine.applied_steps == 1


def test_the_monitor_memory_step_fed_by_hand_keeps_the_highest_call() -> None:
    # The monitor measures its memory step (the second) call by call; the report kept is
    # the call with the highest peak, which holds the step's weights and gradients.
    engine = _sgd_engine(accumulation_steps=2)
    data = _dataset(8)
    for _ in range(2):
        assert engine.memory_report is None
        engine.backward(data[0:4], _loss)
        engine.backward(data[4:8], _loss)
        engine.step()
    report = engine.memory_report
    assert report is not None and report.peak_bytes > 0
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert report.peak_by_kind["params"] == weights
    assert report.peak_by_kind["grads"] == weights  # the first micro-batch's, held
    assert engine.monitor.memory


def test_the_first_planned_step_fed_by_hand_is_measured_with_the_optimizer_state() -> None:
    # The closed loop measures each call of the first planned step; AdamW makes its state
    # at that step, so it is counted as held through backward, as every later step holds
    # it. That is the peak of a later step, measured as a whole.
    from memfit.models import build_model

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=2, n_embd=64, n_head=4, block_size=32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = Engine(model, opt, precision="fp32", checkpoint="full", accumulation_steps=2)
    batch = batch_fn(8, generator=0)
    for micro in split_batch(batch, 2):
        engine.backward(micro, loss_fn)
    engine.step()
    check = engine.plan_check
    assert check is not None and not check.replanned
    scaler = [v for v in vars(engine.scaler).values() if isinstance(v, torch.Tensor)]
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), *scaler, batch]
    later = allocator_peak(lambda: engine.train_step(batch, loss_fn), live=live).peak_bytes
    assert abs(check.measured_peak_bytes - later) <= 0.001 * later
    state = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt)[1:])
    assert state > 0.1 * later  # without it the first step would read far below


# --- a budget implies planning ------------------------------------------------------------------


def test_a_budget_without_checkpoint_plans_and_checkpoint_none_with_one_is_refused() -> None:
    assert _sgd_engine().settings.checkpoint == "none"
    assert _sgd_engine(memory_budget="1GiB").settings.checkpoint == "auto"
    assert _sgd_engine(memory_budget="1GiB", checkpoint="full").settings.checkpoint == "full"
    with pytest.raises(ConfigError, match="would be ignored"):
        _sgd_engine(memory_budget="1GiB", checkpoint="none")


def test_a_checkpoint_that_ignored_its_budget_resumes_without_planning(tmp_path: Any) -> None:
    # Saved before a budget implied planning: checkpoint "none" with a budget.
    from memfit.savefile import atomic_save

    engine = _sgd_engine()
    engine.train_step(_dataset(4)[0:4], _loss)
    state = engine.state_dict()
    state["settings"]["memory_budget"] = 2**30
    path = atomic_save(state, tmp_path / "old.pt")
    torch.manual_seed(0)
    model = _net()
    resumed = Engine.resume(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert resumed.settings.checkpoint == "none" and resumed.settings.memory_budget is None
    assert resumed.steps == 1


def test_a_budget_alone_makes_and_applies_a_plan() -> None:
    from memfit.models import build_model

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=16
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, precision="fp32", memory_budget="1GiB")
    engine.train_step(batch_fn(4, generator=0), loss_fn)
    assert engine.plan is not None and applied_plan(model) is engine.plan
    assert engine.plan.budget_bytes == 2**30


# --- units= and find_units ----------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 32),
            nn.Linear(32, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Unlisted(nn.Module):
    """Blocks held as attributes, not in a ModuleList: memfit cannot find them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = _Block(16), _Block(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


def _unlisted_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("by", ["name", "module"])
def test_units_plan_the_blocks_memfit_cannot_find(by: str) -> None:
    torch.manual_seed(0)
    model = _Unlisted()
    with pytest.raises(PlanError, match="units="):
        memfit.checkpoint.find_units(model)
    reference = copy.deepcopy(model)
    units = ["first", "second"] if by == "name" else [model.first, model.second]
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", checkpoint="full", units=units
    )
    assert engine.units == ["first", "second"]
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    record = _grads_at_step(engine.optimizer)
    engine.train_step(batch, _unlisted_loss)
    recomputed = {name for name, d in engine.plan.decisions.items() if d != "keep"}
    assert {"first", "second"} <= recomputed
    assert applied_plan(model) is engine.plan
    # Checkpointing changes no gradient (fp32 on CPU: bitwise).
    _unlisted_loss(reference, batch).backward()
    for got, want in zip(record[0], [p.grad for p in reference.parameters()]):
        assert torch.equal(got, want)


def test_bad_units_are_refused_with_valid_names() -> None:
    model = _Unlisted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"'frist'.*did you mean 'first'.*valid names include"):
        Engine(model, opt, "fp32", checkpoint="full", units=["frist"])
    with pytest.raises(ConfigError, match="not a submodule"):
        Engine(model, opt, "fp32", checkpoint="full", units=[nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="empty"):
        Engine(model, opt, "fp32", checkpoint="full", units=[])
    with pytest.raises(ConfigError, match="module names or modules"):
        Engine(model, opt, "fp32", checkpoint="full", units=[3])  # type: ignore[list-item]


def test_find_units_is_public() -> None:
    from memfit.models import build_model

    model, _, _ = build_model("gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2)
    tree = memfit.checkpoint.find_units(model)
    # Demoted from the top level: kept for one release, with a warning naming the module.
    with pytest.warns(DeprecationWarning, match=r"memfit\.checkpoint\.find_units"):
        assert memfit.find_units is memfit.checkpoint.find_units
    assert tree.names() == ["", "blocks", "blocks.0", "blocks.1"]
    assert tree["blocks.0"].module is model.blocks[0]


# --- Hugging Face's own gradient checkpointing --------------------------------------------------


@pytest.fixture
def quiet_transformers() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*use_cache=True.*")
        yield


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        use_cache=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()


def _gpt2_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.usefixtures("quiet_transformers", "op_clock")
def test_hugging_face_gradient_checkpointing_is_replaced_by_the_plan() -> None:
    pytest.importorskip("transformers")
    model = _gpt2()
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(0))
    unplanned = copy.deepcopy(model)
    whole = memfit.plan(
        unplanned,
        ids,
        _gpt2_loss,
        precision="fp32",
        optimizer=torch.optim.SGD(unplanned.parameters()),
    )
    peaks = [p.peak_bytes for p in whole.frontier]
    budget = int((min(peaks) + max(peaks)) / 2)  # some units must be recomputed
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = Engine(model, opt, precision="fp32", checkpoint="auto", memory_budget=budget)
    with pytest.warns(UserWarning, match="own gradient checkpointing"):
        engine.train_step(ids, _gpt2_loss)
    assert not model.is_gradient_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert applied_plan(model) is engine.plan
    assert any(d != "keep" for d in engine.plan.decisions.values())
    assert any("own gradient checkpointing" in note for note in engine.plan.notes)
    assert engine.plan_check is not None and engine.plan_check.measured_peak_bytes <= budget
    scaler = [v for v in vars(engine.scaler).values() if isinstance(v, torch.Tensor)]
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), *scaler, ids]
    later = allocator_peak(lambda: engine.train_step(ids, _gpt2_loss), live=live).peak_bytes
    assert later <= budget


@pytest.mark.usefixtures("quiet_transformers")
def test_memfit_plan_also_turns_hugging_face_checkpointing_off() -> None:
    pytest.importorskip("transformers")
    model = _gpt2()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="own gradient checkpointing"):
        plan = memfit.plan(model, ids, _gpt2_loss, strategy="full", precision="fp32")
    assert not model.is_gradient_checkpointing
    assert any("own gradient checkpointing" in note for note in plan.notes)


@pytest.mark.usefixtures("quiet_transformers")
def test_a_given_plan_also_turns_hugging_face_checkpointing_off() -> None:
    # A resumed run applies its saved plan to a model built again, maybe with Hugging
    # Face's checkpointing on as the user's code enables it.
    pytest.importorskip("transformers")
    model = _gpt2()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = memfit.plan(copy.deepcopy(model), ids, _gpt2_loss, strategy="full", precision="fp32")
    model.gradient_checkpointing_enable()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", checkpoint=plan)
    with pytest.warns(UserWarning, match="own gradient checkpointing"):
        engine.train_step(ids, _gpt2_loss)
    assert not model.is_gradient_checkpointing and applied_plan(model) is plan


def test_a_short_last_step_weights_sparse_gradients_too() -> None:
    # Three samples in two micro-batches: the step's gradients are rescaled to the true
    # total; an nn.Embedding(sparse=True) gradient must be rescaled with the dense ones.
    x, y = torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.ones(3, 1)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    weights = {}
    for sparse in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Flatten(), nn.Linear(8, 1))
        engine = Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            precision="fp32",
            accumulation_steps=2,
            monitor=False,
        )
        engine.train_step((x, y), loss)
        weights[sparse] = model[0].weight.detach().clone()
    torch.testing.assert_close(weights[True], weights[False], rtol=0, atol=1e-6)
