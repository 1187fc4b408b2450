"""Cost profiling: hand-checked bytes and FLOPs, flags, state left alone, meta/fake tensors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from memfit.checkpoint import apply as apply_module
from memfit.checkpoint.apply import applied_plan, apply_plan, is_applied, planned
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.profiler import Profile, flop_counter, profile
from memfit.errors import ConfigError, PlanError

pytestmark = pytest.mark.usefixtures("one_thread")


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


X = torch.randn(5, 8)


# --------------------------------------------------------------------------- hand-checked


def test_linear_relu_chain_fp32_by_hand() -> None:
    prof = profile(_chain(), X)
    assert isinstance(prof, Profile) and isinstance(prof.root, UnitCost)
    assert [c.name for c in prof.root.children] == ["0", "1", "2", "3", "4"]
    # addmm saves its input (resident for unit 0: the example input; for units 2 and 4 the
    # ReLU output, already counted) and W^T (a parameter); ReLU saves its 5x16 fp32 output.
    saved = {u.name: u.own_saved_bytes for u in prof.root.walk()}
    assert saved == {"": 0, "0": 0, "1": 320, "2": 0, "3": 320, "4": 0}
    assert prof.activation_bytes == 640 and prof.loss_saved_bytes == 0
    inputs = {u.name: u.input_bytes for u in prof.root.walk()}
    assert inputs == {"": 0, "0": 0, "1": 320, "2": 320, "3": 320, "4": 320}
    outputs = {u.name: u.output_bytes for u in prof.root.walk()}
    assert outputs == {"": 80, "0": 320, "1": 320, "2": 320, "3": 320, "4": 80}
    matmul = {u.name: u.matmul_saved_bytes for u in prof.root.walk()}
    assert matmul == {"": 720, "0": 320, "1": 0, "2": 320, "3": 0, "4": 80}
    flops = {u.name: u.fwd_flops for u in prof.root.walk()}
    assert flops == {"": 4480, "0": 1280, "1": 0, "2": 2560, "3": 0, "4": 640}
    assert all(u.non_matmul_fwd_flops == 0 for u in prof.root.walk())
    # A rebuild stops once the last saved tensor is back: addmm saves its inputs before it
    # runs, so a Linear's whole forward is its tail; ReLU saves its output after it runs.
    tails = {u.name: u.tail_flops for u in prof.root.walk()}
    assert tails == {"": 640, "0": 1280, "1": 0, "2": 2560, "3": 0, "4": 640}
    # The two ReLUs do the same work: they get the same (median) time.
    assert prof["1"].fwd_seconds == prof["3"].fwd_seconds > 0
    params = (8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4) * 4
    assert prof.param_bytes == prof.grad_bytes == params
    assert prof.input_bytes == 5 * 8 * 4 and prof.output_bytes == 80
    assert prof.root.sequential and all(u.can_recompute for u in prof.root.walk())
    assert prof.measured and prof.precision == "fp32" and prof.device == "cpu"
    assert prof.fwd_flops == 4480
    assert prof.structure[0] == ("", "Sequential")


def test_linear_relu_chain_bf16_by_hand() -> None:
    prof = profile(_chain(), X, precision="bf16-mixed")
    saved = {u.name: u.own_saved_bytes for u in prof.root.walk()}
    # unit 0 saves the bf16 copy of the input; the ReLUs their bf16 outputs; units 2 and 4
    # the bf16 copies of their weights (their inputs need grad, so W^T is saved).
    assert saved == {"": 0, "0": 80, "1": 160, "2": 512, "3": 160, "4": 128}
    matmul = {u.name: u.matmul_saved_bytes for u in prof.root.walk()}
    assert matmul == {"": 360, "0": 160, "1": 0, "2": 160, "3": 0, "4": 40}
    assert prof.precision == "bf16-mixed"


def test_loss_saved_bytes_and_custom_loss() -> None:
    prof = profile(_chain(), X, loss_fn=lambda out: (out**2).sum())
    assert prof.loss_saved_bytes == 80  # pow saves the 5x4 fp32 output


def test_fwd_flops_match_flop_counter() -> None:
    models = pytest.importorskip("memfit.models")
    gpt = models.GPT(models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    x = torch.randint(0, 256, (2, 16))
    prof = profile(gpt, x)
    with flop_counter() as fc:
        gpt(x)
    assert prof.fwd_flops == fc.get_total_flops() > 0
    assert prof["blocks.0"].fwd_flops == prof["blocks.1"].fwd_flops > 0
    assert prof["blocks"].fwd_flops == 2 * prof["blocks.0"].fwd_flops
    assert prof["blocks.0"].matmul_saved_bytes > 0
    assert prof.root.sequential is False and prof["blocks"].sequential
    assert not prof["blocks"].can_recompute and "no forward" in prof.reasons["blocks"][0]


def test_times(op_clock: None) -> None:
    prof = profile(_chain(), X)
    for unit in prof.root.walk():
        assert unit.fwd_seconds > 0 and unit.bwd_seconds >= 0
        assert unit.non_matmul_fwd_seconds >= 0
    assert prof.root.fwd_seconds >= sum(c.fwd_seconds for c in prof.root.children) * 0.5
    assert prof.bwd_seconds > 0 and prof.fwd_seconds > 0
    # No matmul: a selective rebuild re-runs all of it, and pays the selective machinery.
    relu = prof["1"]
    assert relu.non_matmul_fwd_seconds >= relu.fwd_seconds * (1 - 1e-12)
    assert "sequential" in prof.summary()
    # The checkpoint machinery's cost per piece is measured (about 0.15 ms on a CPU; here
    # in ops, op_clock) and carried by every unit, so that each piece of a plan is charged it.
    assert 0 < prof.piece_seconds
    assert {u.piece_seconds for u in prof.root.walk()} == {prof.piece_seconds}
    assert "a piece" in prof.summary()
    # Times are medians over the timed steps; one step is allowed, none is not.
    once = profile(_chain(), X, timed_steps=1)
    assert once.fwd_seconds > 0 and once.bwd_seconds > 0
    for bad in (0, 2.5, "3", True):
        with pytest.raises(ConfigError, match="timed_steps"):
            profile(_chain(), X, timed_steps=bad)


def test_selective_machinery_is_timed_and_charged_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    timing_module = importlib.import_module("memfit.checkpoint.profiler.timing")
    measure_module = importlib.import_module("memfit.checkpoint.profiler.measure")
    passes: list[bool] = []
    run_step = timing_module.run_step

    def counting_run_step(*args: object, **kwargs: object) -> object:
        if kwargs.get("forward_only"):
            passes.append(kwargs["wrap"] is not None)
        return run_step(*args, **kwargs)

    monkeypatch.setattr(timing_module, "run_step", counting_run_step)
    base = profile(_chain(), X)
    # A warm-up, then timed_steps forwards of each kind, all of them as checkpointed pieces.
    assert passes == [True] * 7

    # What the timing leaves is charged twice (forward and rebuild) on top of the share.
    def fixed(rounds: int, timing: object, stats: dict) -> None:
        for st in stats.values():
            st.selective_overhead_seconds = 0.25

    monkeypatch.setattr(measure_module, "selective_overheads", fixed)
    charged = profile(_chain(), X)
    for unit in charged.root.walk():
        assert unit.non_matmul_fwd_seconds >= 0.5 * (1 - 1e-9)
        assert base[unit.name].non_matmul_fwd_seconds < 0.5  # tiny ops: far below that
    # No matmul, nothing to time: a model of elementwise ops is not timed selectively.
    passes.clear()
    monkeypatch.setattr(measure_module, "selective_overheads", measure_module.selective_overheads)
    profile(
        nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(5, 8, requires_grad=True), units=["0", "1"]
    )
    assert passes == []


def test_selective_left_out_when_it_cannot_be_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    measure_module = importlib.import_module("memfit.checkpoint.profiler.measure")

    def failing(*args: object) -> None:
        raise RuntimeError("this forward does not run as one piece")

    monkeypatch.setattr(measure_module, "selective_overheads", failing)
    prof = profile(_chain(), X)
    assert not any(u.can_select for u in prof.root.walk())
    assert "could not be timed: RuntimeError: this forward" in prof.no_selective["0"]
    assert all(u.can_recompute for u in prof.root.walk() if u.name)


class _Thrice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.relu(self.a(x))
        return self.b(x)


def test_a_unit_called_three_times_pays_the_machinery_three_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Thrice()
    prof = profile(model, torch.randn(4, 8), units=["a", "b"])
    assert prof["a"].piece_seconds == 3 * prof.piece_seconds
    assert prof["b"].piece_seconds == prof.piece_seconds
    # As the executor runs it: recomputing `a` checkpoints each of its three calls.
    calls = []
    real = apply_module.run_checkpointed

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_module, "run_checkpointed", counting)
    with planned(model, {"a": "recompute"}):
        model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 3


class _SlowTail(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)  # saves its output: the last saved tensor
        for _ in range(40):
            y = y + 1.0  # saves nothing: a rebuild that stops early skips all of these
        return y


class _NoTail(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            x = x + 1.0
        return torch.relu(x)  # the last op saves its output: nothing to skip


def test_tail_time_is_what_follows_the_last_saved_tensor(op_clock: None) -> None:
    model = nn.Sequential(_SlowTail(), _NoTail())
    prof = profile(model, torch.randn(512, 512, requires_grad=True), units=["0", "1"])
    slow, none = prof["0"], prof["1"]
    # Attribution, not speed (op_clock: time is the ops run): forty of the forty-one ops
    # are the first unit's tail, none of the second's.
    assert slow.tail_seconds > 0.5 * slow.fwd_seconds
    assert none.tail_seconds < 0.5 * none.fwd_seconds
    assert slow.tail_flops == none.tail_flops == 0


# --------------------------------------------------------------------------- flags


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Looped(nn.Module):
    def __init__(self, indexed: bool = False, kwargs: bool = False) -> None:
        super().__init__()
        self.indexed, self.kwargs = indexed, kwargs
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.indexed:
            for i in range(len(self.blocks)):
                x = self.blocks[i](x)
        elif self.kwargs:
            for block in self.blocks:
                x = block(x=x)
        else:
            for block in self.blocks:
                x = block(x)
        return x


class Parallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(head(x) for head in self.heads)


@pytest.mark.parametrize(
    ("model", "sequential"),
    [
        (Looped(), True),
        (Looped(indexed=True), False),
        (Looped(kwargs=True), False),
        (Parallel(), False),
    ],
)
def test_sequential_needs_iteration_and_chained_tensors(model: nn.Module, sequential: bool) -> None:
    prof = profile(model, torch.randn(2, 8))
    container = prof.root.children[0]
    assert container.sequential is sequential
    assert type(next(model.children())) is nn.ModuleList  # the probe class is gone


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) - self.ema
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.rand(x.shape, generator=self.gen)


class WithBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([InPlace(), Counter(), Noisy(), WithBN(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(x)  # not the example input, so the in-place change is allowed
        for block in self.blocks[:4]:
            x = block(x)
        return x  # blocks.4 is never called


def test_can_recompute_reasons() -> None:
    model = Mixed()
    prof = profile(model, torch.randn(4, 8))
    ok = {u.name: u.can_recompute for u in prof.root.walk()}
    assert ok == {
        "": False,
        "blocks": False,
        "blocks.0": False,
        "blocks.1": False,
        "blocks.2": False,
        "blocks.3": True,  # BatchNorm statistics are handled by the executor
        "blocks.4": False,
    }
    assert "modifies an input" in prof.reasons["blocks.0"][0]
    assert "updates buffer Counter.ema" in prof.reasons["blocks.1"][0]
    assert "torch.Generator" in prof.reasons["blocks.2"][0]
    assert "not called" in prof.reasons["blocks.4"][0]
    assert any("updates buffer" in r for r in prof.reasons[""])
    assert not prof["blocks"].sequential  # blocks.4 is never reached


class InPlaceAfterLinear(nn.Module):
    """A matmul output changed in place: selective recompute's cached copy goes stale."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=inplace)) for _ in range(2)]
        )
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        y = self.head(x)
        y.add_(1.0)  # outside the blocks, on a matmul output made outside them too
        return y


@pytest.mark.parametrize("inplace", [True, False])
def test_matmul_output_changed_in_place_rules_out_selective(inplace: bool) -> None:
    model = InPlaceAfterLinear(inplace)
    prof = profile(model, torch.randn(4, 8), units=["blocks.0", "blocks.1", "head"])
    blocked = {u.name for u in prof.root.walk() if not u.can_select}
    # "head" makes the output that add_ changes; the blocks only where ReLU is in place.
    assert blocked == ({"", "blocks.0", "blocks.1", "head"} if inplace else {"", "head"})
    assert "changed in place later (aten.add_)" in prof.no_selective["head"]
    if inplace:
        assert "aten.relu_" in prof.no_selective["blocks.0"]
        assert "no-selective" in prof.summary()
    assert all(u.can_recompute for u in prof.root.walk() if u.name.startswith("blocks."))


def test_children_in_forward_order() -> None:
    class Swapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    prof = profile(Swapped(), torch.randn(2, 4), units=["a", "b", "c"])
    assert [c.name for c in prof.root.children] == ["b", "a", "c"]
    assert prof["b"].input_bytes == 0 and prof["a"].input_bytes == 32


def test_units_argument_and_errors() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    with pytest.raises(PlanError, match="units="):
        profile(Plain(), torch.randn(2, 4))
    prof = profile(Plain(), torch.randn(2, 4), units=["fc1"])
    assert list(prof.units()) == ["", "fc1"]
    prof = profile(Plain(), torch.randn(2, 4), units=["fc1"], extra=["fc2"])
    assert list(prof.units()) == ["", "fc1", "fc2"] and "fc2" in prof
    with pytest.raises(PlanError, match="no submodule"):
        profile(Plain(), torch.randn(2, 4), units=["fc3"])
    with pytest.raises(PlanError, match="loss_fn"):
        profile(Plain().requires_grad_(False), torch.randn(2, 4), units=["fc1"])


def test_dict_inputs_and_kwargs() -> None:
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[None, torch.Tensor]:
            for b in self.blocks:
                x = b(x) * scale
            return None, x

    prof = profile(KW(), {"x": torch.randn(2, 8), "scale": 0.5})
    assert prof["blocks"].sequential is False  # a multiply between the blocks
    assert prof["blocks.1"].input_bytes == 64


# --------------------------------------------------------------------------- state left alone


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Dropout(0.5)),
        )
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


def test_profile_leaves_model_state_unchanged() -> None:
    model = CNN()
    model.eval()
    model.blocks[1].train()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    grad = model.head.weight.grad
    plan = {"blocks.0": "recompute"}
    apply_plan(model, plan)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    x = torch.randn(4, 3, 6, 6)
    rng = torch.get_rng_state()

    prof = profile(model, x)

    assert prof["blocks.0"].own_saved_bytes > 0  # profiled without the plan
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.blocks[0][1].num_batches_tracked.item() == 0
    assert [m.training for m in model.modules()] == modes
    assert model.head.weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "head.weight")
    assert torch.equal(torch.get_rng_state(), rng)
    assert is_applied(model) and applied_plan(model) is plan
    assert prof["blocks"].sequential and prof["blocks"].can_recompute


# --------------------------------------------------------------------------- meta and fake


def _same_bytes(a: Profile, b: Profile) -> None:
    fields = (
        "own_saved_bytes",
        "input_bytes",
        "output_bytes",
        "matmul_saved_bytes",
        "fwd_flops",
        "tail_flops",
        "sequential",
        "can_recompute",
    )
    assert list(a.units()) == list(b.units())
    for name, unit in a.units().items():
        for f in fields:
            assert getattr(unit, f) == getattr(b[name], f), (name, f)
    for f in ("param_bytes", "grad_bytes", "activation_bytes", "input_bytes", "output_bytes"):
        assert getattr(a, f) == getattr(b, f), f


def test_the_cycle_collector_rests_during_a_fake_step_only(monkeypatch) -> None:
    import gc

    from memfit.checkpoint.profiler import measure

    enabled: list[bool] = []
    run_step = measure.run_step

    def watched(*args, **kwargs):
        enabled.append(gc.isenabled())
        return run_step(*args, **kwargs)

    monkeypatch.setattr(measure, "run_step", watched)
    profile(_chain(), X)
    with torch.device("meta"):
        meta = _chain()
    profile(meta, X.to("meta"), fake_device="cpu")
    assert enabled == [True, False] and gc.isenabled()


def test_what_the_recorder_keeps_between_ops_changes_no_profile(monkeypatch) -> None:
    # The recorder looks each op up once a step, and in backward keeps what every unit's
    # subtree still holds while one autograd node runs. Looked up again for every op, the
    # profile is the same, number for number.
    from memfit.checkpoint.profiler.recorder import Recorder

    models = pytest.importorskip("memfit.models")
    cfg = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
    with torch.device("meta"):
        meta = models.GPT(cfg)
    x = torch.zeros(3, 16, dtype=torch.long, device="meta")
    kept = profile(meta, x, precision="bf16-mixed", fake_device="cpu")
    on_op, alive_around = Recorder.on_op, Recorder.alive_around
    calls = [0]

    def fresh_op(self, *args):
        calls[0] += 1
        self.ops.clear()
        return on_op(self, *args)

    def fresh_alive(self, unit):
        self.alive_of = None
        return alive_around(self, unit)

    monkeypatch.setattr(Recorder, "on_op", fresh_op)
    monkeypatch.setattr(Recorder, "alive_around", fresh_alive)
    again = profile(meta, x, precision="bf16-mixed", fake_device="cpu")
    assert calls[0] > 100
    assert repr(again) == repr(kept)
    assert any(u.backward_peak_bytes > 0 for u in kept.root.walk())


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_meta_device_gpt_matches_real(precision: str) -> None:
    models = pytest.importorskip("memfit.models")
    cfg = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=0.1)
    torch.manual_seed(0)
    real = models.GPT(cfg)
    with torch.device("meta"):
        meta = models.GPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    prof_real = profile(real, x, precision=precision)
    prof_meta = profile(meta, x.to("meta"), precision=precision, fake_device="cpu")
    _same_bytes(prof_real, prof_meta)
    assert prof_real.measured and not prof_meta.measured
    # No device ran the step: the checkpoint machinery's cost is not known, and not charged.
    assert prof_real.piece_seconds > 0 and prof_meta.piece_seconds == 0
    # Nor the selective machinery's: a selective rebuild is the non-matmul ops' share of
    # the estimated forward, below the whole forward (the matmuls are not re-run).
    block = prof_meta["blocks.0"]
    assert 0 < block.non_matmul_fwd_seconds < block.fwd_seconds
    assert prof_meta.fwd_seconds > 0 and prof_meta.bwd_seconds > 0
    assert prof_meta["blocks.0"].fwd_seconds > 0
    # With dropout, the block's last saved tensor is the dropout mask after its output
    # projection: the tail is the residual add alone (no FLOPs, some time).
    assert prof_meta["blocks.0"].tail_flops == prof_real["blocks.0"].tail_flops == 0
    assert 0 < prof_meta["blocks.0"].tail_seconds < prof_meta["blocks.0"].fwd_seconds
    # The model is left on the meta device, untouched.
    assert all(p.is_meta and p.grad is None for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())


def test_meta_device_large_gpt() -> None:
    models = pytest.importorskip("memfit.models")
    cfg = models.GPTConfig(n_layer=4, n_embd=2048, n_head=16, block_size=1024, vocab_size=50304)
    with torch.device("meta"):
        model = models.GPT(cfg)
    x = torch.empty(8, 1024, dtype=torch.long, device="meta")
    prof = profile(model, x, precision="bf16-mixed", fake_device="cpu", flop_rate=1e15)
    assert prof.param_bytes == sum(p.numel() for p in model.parameters()) * 4
    assert prof.activation_bytes > 1e9 and prof["blocks.3"].fwd_flops > 1e11
    assert prof.flop_rate == 1e15


def test_fake_tensor_model() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = _chain()
        x = mode.from_tensor(X)
    prof = profile(fake, x)
    assert not prof.measured
    _same_bytes(profile(_chain(), X), prof)
    assert all(p.grad is None for p in fake.parameters())


# --------------------------------------------------------------------------- Hugging Face


def test_hf_gpt2_profile_with_kwargs() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    prof = profile(
        model,
        {"input_ids": ids, "labels": ids, "use_cache": False},
        loss_fn=lambda out: out.loss,
    )
    block = prof["transformer.h.0"]
    assert block.fwd_flops > 0 and block.own_saved_bytes > 0 and block.can_recompute
    assert block.input_bytes >= 2 * 8 * 32 * 4
    assert not prof["transformer.h"].sequential  # the blocks take keyword arguments


def test_summary_mentions_units() -> None:
    text = profile(_chain(), X).summary()
    assert "<model>" in text and "params" in text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_and_meta_default_device() -> None:
    models = pytest.importorskip("memfit.models")
    cfg = models.GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32, dropout=0.1)
    real = models.GPT(cfg).cuda()
    x = torch.randint(0, 256, (2, 32), device="cuda")
    prof = profile(real, x, precision="bf16-mixed")
    assert prof.measured and prof.device.startswith("cuda")
    assert prof["blocks.0"].fwd_seconds > 0 and prof["blocks.0"].bwd_seconds > 0
    with torch.device("meta"):
        meta = models.GPT(cfg)
    prof_meta = profile(meta, x.to("meta"), precision="bf16-mixed")  # fakes stand in for cuda
    assert prof_meta.device.startswith("cuda") and not prof_meta.measured
    _same_bytes(prof, prof_meta)


def test_a_chain_whose_outputs_the_parent_collects_is_not_sequential() -> None:
    # Segments yield one output per segment: a parent that keeps every block's output
    # (hidden states, skip connections) would read other tensors, so no segments there.
    class Stack(nn.Module):
        def __init__(self, collect: bool) -> None:
            super().__init__()
            self.collect = collect
            self.layers = nn.ModuleList(
                [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = []
            for layer in self.layers:
                x = layer(x)
                hidden.append(x)
            return x + hidden[2] if self.collect else x

    x = torch.randn(8, 16)
    assert profile(Stack(collect=False), x)["layers"].sequential
    assert not profile(Stack(collect=True), x)["layers"].sequential


def test_a_layer_list_the_model_loops_over_takes_its_layers_place_in_forward_order() -> None:
    # `late` is registered first but runs last; `early`, a ModuleList, is never called
    # itself. Placed last, the list's backward would be modelled as running first, with
    # everything `late` saved still held (a recommender's embedding tables, +12%).
    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late = nn.Sequential(
                nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
            )
            self.early = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.late(torch.cat([layer(x) for layer in self.early], dim=1)).sum()

    import memfit

    model = Towers()
    result = memfit.checkpoint.make_plan(
        model, torch.randn(64, 32), lambda m, x: m(x), precision="fp32", verify=False
    )
    assert [c.name for c in result.profile.root.children] == ["early", "late"]
    early = result.profile.root.children[0]
    assert [c.name for c in early.children] == [f"early.{i}" for i in range(4)]
