"""The least plan's predicted peak against the allocator's measurement, and the two counts
behind it that the profiler gets right: gradients the autograd engine sums in place, and
an input that many units receive, held once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.api import make_plan
from memfit.checkpoint.planner import RESERVE, cost_tree
from memfit.checkpoint.profile_stage import profile_step
from memfit.checkpoint.profiler import profile
from memfit.precision.policy import PrecisionPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class ScanBlock(nn.Module):
    """A residual block with a recurrence over time, written as a loop (a state-space
    model's slow path): every step reads one time slice of two full-size tensors, so each
    of them gets its gradient as one full-size tensor per step, summed by the autograd
    engine into one buffer."""

    def __init__(self, width: int, state: int) -> None:
        super().__init__()
        self.state = state
        self.decay = nn.Linear(width, width * state)
        self.drive = nn.Linear(width, width * state)
        self.out = nn.Linear(width * state, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, steps, width = x.shape
        decay = torch.sigmoid(self.decay(x)).view(n, steps, width, self.state)
        drive = self.drive(x).view(n, steps, width, self.state)
        h = torch.zeros(n, width, self.state)
        outs = []
        for t in range(steps):
            h = decay[:, t] * h + drive[:, t]
            outs.append(h)
        return x + self.out(torch.stack(outs, dim=1).flatten(2))


def scan_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(ScanBlock(16, 8) for _ in range(3)))


def scan_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def measured_least_error(
    model: nn.Module, batch: torch.Tensor, loss_fn: LossFn, precision: str = "fp32"
) -> tuple[float, float]:
    """(predicted, measured) peak of the least plan's step: planned at the least peak of
    the frontier, applied, one whole training step measured by the allocator after a
    warm-up step. ``bf16-mixed``: forward under CPU autocast, with memfit's fp32 islands,
    as memfit plans and trains it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    mixed = precision != "fp32"
    if mixed:
        memfit.precision.apply_precision(model, memfit.PrecisionPolicy(precision))

    def step_of(m: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                loss = loss_fn(m, batch)
            loss.backward()
            opt.step()

        return step

    step_of(model, optimizer)()  # the optimizer's state exists in every copy
    # Recompute weighed by counted FLOPs and bytes: plans the profile's timings would tie
    # (the same peak measured, predictions 1.4% apart) are not picked between by noise.
    probe_model, probe_opt = copy.deepcopy((model, optimizer))
    whole = make_plan(
        probe_model, batch, loss_fn, precision=precision, optimizer=probe_opt, costs="counted"
    ).plan
    least = min(p.peak_bytes for p in whole.frontier)
    plan_model, plan_opt = copy.deepcopy((model, optimizer))
    plan = make_plan(
        plan_model,
        batch,
        loss_fn,
        precision=precision,
        optimizer=plan_opt,
        budget=int(least / (1 - RESERVE)) + 1,
        costs="counted",
    ).plan
    memfit.apply_plan(plan_model, plan)
    step = step_of(plan_model, plan_opt)
    step()
    live = [*plan_model.parameters(), *optimizer_tensors(plan_opt), batch]
    measured = allocator_peak(step, live=live).peak_bytes
    return float(plan.predicted_peak_bytes), float(measured)


def test_summed_gradients_are_counted_as_the_engine_sums_them_in_place() -> None:
    # Before: the profiler's dispatch mode turned each of the engine's in-place sums into
    # an out-of-place add, counting a second full-size buffer at every step: about +18%.
    model = scan_model()
    batch = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(0))
    predicted, measured = measured_least_error(model, batch, scan_loss)
    error = (predicted - measured) / measured
    # About -0.7% here (5 KB under; +8.7% before): within 3%, but below the measurement.
    assert abs(error) <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


def test_a_units_backward_peak_counts_one_gradient_buffer() -> None:
    # The block's backward as the allocator sees it (a plain step, no dispatch mode) against
    # the profiler's count: saved bytes not yet reached plus what backward holds.
    torch.manual_seed(0)
    block = ScanBlock(16, 8)
    x = torch.randn(4, 32, 16, requires_grad=True)
    prof = profile(block, x, loss_fn=lambda out: out.sum(), units=["", "out"])
    loss = block(x).sum()
    live = [*block.parameters(), x, loss]
    backward = allocator_peak(loss.backward, live=live)
    # The allocator counts from the saved tensors, parameters and input alive at the start.
    resident = sum(t.numel() * t.element_size() for t in [*block.parameters(), x])
    measured = backward.peak_bytes - resident
    counted = prof.root.backward_peak_bytes
    full_buffer = 4 * 32 * 16 * 8 * 4  # one gradient of the decay (or drive) tensor
    assert counted >= measured, (counted, measured)
    # Counted as out-of-place sums, the count was about 2.9 buffers over the allocator's;
    # one buffer of it was the sums' (about 1.9 over now: the rest is not explained yet).
    assert counted - measured < 2.5 * full_buffer, (counted, measured)


class BiasedBlock(nn.Module):
    """A residual block that adds a bias to its attention-like scores and a wide MLP: it
    receives the bias from its caller, as T5's layers receive their position bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 16 * width)
        self.fc2 = nn.Linear(16 * width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = torch.softmax(h @ h.transpose(1, 2) + bias, dim=-1)
        y = x + scores @ h
        return y + self.fc2(F.gelu(self.fc1(y)))


class SharedBiasModel(nn.Module):
    """Blocks that all receive one bias tensor made once in the step (T5's position bias,
    an encoder's output that every cross-attention reads)."""

    def __init__(self, width: int = 16, steps: int = 128, blocks: int = 4) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(steps, steps))
        self.blocks = nn.ModuleList(BiasedBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.rel.expand(x.shape[0], -1, -1) * 1.0  # one tensor, every block's input
        for block in self.blocks:
            x = block(x, bias)
        return x


def test_an_input_many_pieces_keep_is_held_once() -> None:
    # Before: each recomputed block's checkpoint was counted holding its own copy of the
    # bias that every block receives (256 KiB here), though they all hold the one tensor:
    # +15.7% at the least peak (+4.1% on the zoo's T5). Now about -0.3%.
    torch.manual_seed(0)
    model = SharedBiasModel()
    batch = torch.randn(4, 128, 16, generator=torch.Generator().manual_seed(0))
    root = profile_step(model, batch, scan_loss, PrecisionPolicy("fp32")).root
    ids = [{i for i, _ in u.input_storages} for u in root.walk() if u.name.startswith("blocks.")]
    assert len(ids) == 4 and set.intersection(*ids), "the blocks receive one bias tensor"
    predicted, measured = measured_least_error(model, batch, scan_loss)
    error = (predicted - measured) / measured
    assert -0.01 <= error <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


class ConvBlock(nn.Module):
    """A residual block of two 1x1 convolutions."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(channels, 4 * channels, 1)
        self.b = nn.Conv2d(4 * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(x)))


class Segmenter(nn.Module):
    """Blocks, then a segmentation head of the model's own ops (SegFormer's decode head:
    its features concatenated, fused, activated, dropped out, classified), its logits
    upsampled to the labels' size and a cross-entropy loss, all after the last unit."""

    def __init__(self, channels: int = 16, classes: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(blocks)))
        self.fuse = nn.Parameter(torch.randn(16 * channels, 4 * channels, 1, 1) / channels)
        self.classify = nn.Parameter(torch.randn(classes, 16 * channels, 1, 1) / channels)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        f = self.blocks(x)
        h = F.relu(F.conv2d(torch.cat([f, 2 * f, 3 * f, 4 * f], 1), self.fuse))
        logits = F.conv2d(F.dropout(h, 0.1, self.training), self.classify)
        up = F.interpolate(logits, size=labels.shape[-2:], mode="bilinear", align_corners=False)
        return F.cross_entropy(up, labels)


def segmenter_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(0)  # the same dropout mask in every step
    return model(*batch)


def test_the_head_of_backward_is_measured_with_what_it_frees() -> None:
    # Before: the head of backward (the loss's and the head's backward, before any unit's)
    # was the profiler's count of what it makes, which does not subtract the head's saved
    # tensors it frees as it goes (4.0 MiB counted, 2.0 MiB held above the end of forward
    # here): +20% at the least peak (+4.1% on the zoo's SegFormer). Now the allocator
    # measures it on the step: about -0.05%.
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(2, 16, 32, 32, generator=g),
        torch.randint(0, 32, (2, 64, 64), generator=g),
    )
    torch.manual_seed(0)
    model = Segmenter()
    profiled = profile_step(model, batch, segmenter_loss, PrecisionPolicy("fp32"))
    assert profiled.edges is not None and profiled.edges.head_backward_bytes is not None
    assert profiled.edges.head_backward_bytes < profiled.profile.head_backward_bytes
    predicted, measured = measured_least_error(model, batch, segmenter_loss)
    error = (predicted - measured) / measured
    assert -0.01 <= error <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


class MLPBlock(nn.Module):
    """A pre-norm residual MLP block whose weights outweigh its activations."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def mlp_blocks(blocks: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(256) for _ in range(blocks)))
    return model, torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0))


def assert_bf16_least_within_3_percent(model: nn.Module, batch: torch.Tensor) -> None:
    predicted, measured = measured_least_error(model, batch, scan_loss, "bf16-mixed")
    error = (predicted - measured) / measured
    assert -0.01 <= error <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


def test_a_rebuild_under_autocast_saves_its_weight_copies_once() -> None:
    # Before: a rebuild under autocast was counted holding the 16-bit copies of its
    # weights twice, as what it casts again and as what its matmuls save (the same
    # tensors): +5.8% at the least peak here (+3.9% on the zoo's bf16 ViT). Then +1.8% where
    # bf16 is emulated and +2.6% where it is native, the first block's rebuild charged its
    # own gradients, which its backward makes after it; now -0.0% and +0.7%.
    model, batch = mlp_blocks(4)
    policy = PrecisionPolicy("bf16-mixed")
    memfit.precision.apply_precision(model, policy)
    root = profile_step(model, batch, scan_loss, policy).root
    memfit.precision.remove_precision(model)
    block = next(u for u in root.walk() if u.name == "0")
    weights = model[0].fc1.weight.numel() + model[0].fc2.weight.numel()
    assert block.saved_cast_bytes == 2 * weights  # both bf16 copies, saved by the matmuls
    assert_bf16_least_within_3_percent(model, batch)


def test_weight_copies_kept_units_save_are_the_autocast_caches() -> None:
    # Before: at the end of forward the autocast cache's 16-bit weight copies were counted
    # beside what the kept units save, which holds the same copies: +4.2% at the least
    # peak (+4.8% on the zoo's bf16 Whisper, whose kept head saves its own). Then +2.4%
    # where bf16 is emulated and +3.3% where it is native (the first block's rebuild
    # charged its own gradients); now -0.0% and +1.0%.
    assert_bf16_least_within_3_percent(*mlp_blocks(3))


def _grads_from(model: nn.Module, batch: torch.Tensor, loss_fn: LossFn, units: list[str]):
    policy = PrecisionPolicy("fp32")
    profiled = profile_step(model, batch, loss_fn, policy, units)
    root = cost_tree(model, profiled, policy, 1, None)
    return {u.name: u.grads_from_bytes for u in root.walk()}


def test_a_rebuild_holds_the_gradients_backward_made_before_it_not_its_own() -> None:
    # A rebuild runs before its unit's backward: the unit's own gradients are not made yet.
    # Before, each unit was charged its own as well: the first of four bf16 MLP blocks'
    # rebuild 1 MiB over (+2.6% at the least peak), a bf16 BEiT's least peak +3.6%.
    model, batch = mlp_blocks(3)
    block = sum(p.numel() * 4 for p in model[0].parameters())
    grads = _grads_from(model, batch, scan_loss, ["0", "1", "2"])
    # Beside them backward holds the loss's gradient, the fp32 scalar it starts from.
    seed = 4
    assert (grads["0"], grads["1"], grads["2"]) == (2 * block + seed, block + seed, seed)


class TiedLM(nn.Module):
    """Token embeddings, two MLP blocks and an output layer that shares the embeddings'
    weight, as tied language models are written."""

    def __init__(self, vocab: int = 512, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(MLPBlock(width), MLPBlock(width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def test_a_tied_weights_gradient_is_held_by_the_rebuilds_of_the_units_before_its_last_use() -> None:
    # The output layer's use of the shared weight comes last in forward, so backward makes
    # its part of the gradient first (held in autograd's buffer until the embedding's part
    # is added): every rebuild holds it, the embedding's own included. (Charged by forward
    # order, the blocks' rebuilds were charged their own gradients instead, not this one.)
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x).flatten(0, 1), x.flatten())

    tied = model.embed.weight.numel() * 4
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    grads = _grads_from(model, ids, loss_fn, ["embed", "blocks.0", "blocks.1"])
    tied += 4  # and the loss's gradient, the fp32 scalar backward starts from
    assert grads["blocks.1"] == tied
    assert grads["blocks.0"] == tied + block
    assert grads["embed"] == tied + 2 * block


class PartsModel(nn.Module):
    """A click-through model as such models are written: each feature's part made by its
    own unit and gathered in a list, which the forward holds while the top MLP runs on their
    concatenation (a forward moment above the end of forward's), and a 1-wide output (the
    gradient the head of backward hands on is far smaller than a block's)."""

    def __init__(self, tables: int = 6, rows: int = 512, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)
        )
        self.top = nn.Sequential(
            nn.Linear(dim * (tables + 1), 4 * hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(4 * hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.bottom(batch["dense"])]
        parts += [table(ids) for table, ids in zip(self.embeddings, batch["bags"])]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def click_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch), batch["clicks"])


def parts_model_and_batch() -> tuple[PartsModel, dict[str, torch.Tensor]]:
    """A seeded :class:`PartsModel` and a batch of 1024 clicks."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = {
        "dense": torch.randn(1024, 13, generator=g),
        "bags": torch.randint(0, 512, (6, 1024, 8), generator=g),
        "clicks": (torch.rand(1024, generator=g) < 0.2).float(),
    }
    return PartsModel(), batch


def test_a_forward_moment_above_the_end_of_forward_is_predicted() -> None:
    # Before: no unit's forward was a moment of the cost model, and the end of forward and
    # the head of backward were counted with the largest gradient in flight between units
    # (2 MiB here), which neither has. The two nearly cancelled at the zoo's recommender's
    # least plan (+3.1%) and over-predicted its unplanned step (+4.8%).
    model, batch = parts_model_and_batch()
    root = profile_step(model, batch, click_loss, PrecisionPolicy("fp32")).root
    dropout = next(u for u in root.walk() if u.name == "top.2")
    # Its forward holds its output and the list of parts above all saved by its end.
    assert dropout.forward_peak_bytes >= 1024 * 512 * 4, dropout.forward_peak_bytes
    predicted, measured = measured_least_error(model, batch, click_loss)
    error = (predicted - measured) / measured
    assert -0.01 <= error <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


def test_a_concatenation_a_checkpoint_keeps_is_not_counted_again_where_it_was_unsaved() -> None:
    # Under autocast the top MLP's first Linear saves a bf16 copy of the concatenated
    # features, not the fp32 concatenation, which the forward holds unsaved while the top
    # MLP runs: the unplanned step's forward moments and the loss's spike count it as held
    # beyond what is saved. A plan that checkpoints the top MLP's start keeps it as the
    # checkpoint's input, and counted it twice (the zoo's recommender: +4.3%).
    model, batch = parts_model_and_batch()
    policy = PrecisionPolicy("bf16-mixed")
    memfit.precision.apply_precision(model, policy)
    try:
        profiled = profile_step(model, batch, click_loss, policy)
    finally:
        memfit.precision.remove_precision(model)
    units = {u.name: u for u in profiled.root.walk()}
    features = units["top"].input_storages
    assert features and features[0][1] == 1024 * 32 * 7 * 4, features  # fp32, (n, 224)
    # Held unsaved through the dropout's forward and at the last unit's end.
    assert features[0] in units["top.2"].forward_unsaved_inputs, units["top.2"]
    assert features[0] in profiled.forward_end_unsaved_inputs, profiled.forward_end_unsaved_inputs
    predicted, measured = measured_least_error(model, batch, click_loss, "bf16-mixed")
    error = (predicted - measured) / measured
    assert -0.03 <= error <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"
