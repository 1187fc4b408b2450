"""Tests of memfit.memory: exact byte counts, roles, agreement with torch's MemTracker."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.fake import estimate_step_memory
from memfit.memory import KINDS, MemoryReport, measure

F32 = 4  # bytes per float32 element


def nbytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def check_sums(report: MemoryReport) -> None:
    assert set(report.by_kind) == set(KINDS)
    assert sum(report.by_kind.values()) == report.peak_bytes
    assert sum(report.by_dtype.values()) == report.peak_bytes
    assert all(v >= 0 for v in report.by_kind.values())
    for kind in KINDS:
        assert report.peak_by_kind[kind] >= report.by_kind[kind]


# ---------------------------------------------------------------- exact small cases


def test_empty_fn() -> None:
    report = measure(lambda: None, scan_live=False, device="cpu")
    assert report.peak_bytes == 0
    assert report.by_kind == dict.fromkeys(KINDS, 0)
    assert report.by_dtype == {}
    assert report.result is None
    assert report.low_precision_share == 0.0
    check_sums(report)


def test_empty_fn_counts_what_is_alive() -> None:
    keep = torch.empty(1000)
    gc.collect()  # so that no garbage is freed (and counted) while measuring
    report = measure(lambda: 7)
    assert report.result == 7
    assert report.peak_bytes == report.start_bytes == report.end_bytes
    assert report.start_bytes >= keep.nbytes
    check_sums(report)


def test_single_allocation_exact() -> None:
    report = measure(lambda: torch.empty(1000, dtype=torch.float32), scan_live=False)
    assert report.peak_bytes == 1000 * F32
    assert report.by_kind["temp"] == 1000 * F32
    assert report.by_dtype == {"torch.float32": 1000 * F32}
    assert report.end_bytes == 1000 * F32  # the result is still alive
    assert report.result.shape == (1000,)
    check_sums(report)


def test_single_allocation_on_top_of_live_tensors() -> None:
    report = measure(lambda: torch.empty(333, dtype=torch.float64))
    assert report.peak_bytes - report.start_bytes == 333 * 8
    assert report.by_dtype["torch.float64"] >= 333 * 8


def test_python_scalar_tensor_counted() -> None:
    # torch.tensor builds its data outside dispatch; it must still count once.
    report = measure(lambda: torch.tensor([1.0, 2.0, 3.0]), scan_live=False)
    assert report.peak_bytes == 3 * F32


def test_views_not_double_counted() -> None:
    def fn():
        a = torch.empty(1000)
        return a, a[10:], a.view(10, 100), a.view(10, 100).t(), a.view(torch.int32), a.detach()

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == 1000 * F32
    assert report.by_dtype == {"torch.float32": 1000 * F32}


def test_in_place_ops_allocate_nothing() -> None:
    def fn():
        a = torch.zeros(1000)
        a.add_(1).mul_(2).clamp_(max=3)
        a[:10].fill_(5)
        return a

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == 1000 * F32


def test_out_resize_counts_the_growth() -> None:
    def fn():
        out = torch.empty(0)
        torch.add(torch.ones(1000), 1, out=out)  # out grows to 1000 elements
        return out

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == 2000 * F32
    assert report.end_bytes == 1000 * F32


def test_freed_temp_lowers_live_bytes() -> None:
    def fn():
        a = torch.empty(1000)
        del a
        b = torch.empty(500)
        return b

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == 1000 * F32
    assert report.end_bytes == 500 * F32


def test_view_keeps_storage_alive() -> None:
    def fn():
        a = torch.empty(1000)
        v = a[:1]
        del a
        b = torch.empty(500)  # a's storage is still alive through v
        return v, b

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == 1500 * F32
    assert report.end_bytes == 1500 * F32


def test_saved_tensors_freed_by_autograd() -> None:
    def fn():
        x = torch.randn(1000, requires_grad=True)
        y = x.exp()  # exp saves its output for backward
        s = y.sum()
        del y  # now only autograd holds y
        s.backward()  # ... and frees it here
        return x.grad

    report = measure(fn, scan_live=False)
    assert report.end_bytes == 1000 * F32  # only the gradient is left
    assert report.peak_by_kind["activations"] == 1000 * F32


def test_activation_bytes_exact() -> None:
    def fn():
        x = torch.randn(1000, requires_grad=True)
        y = x.exp()
        return x, y.sum()

    report = measure(fn, scan_live=False)
    assert report.by_kind["activations"] == 1000 * F32  # y, saved by exp
    assert report.peak_bytes == 2000 * F32 + F32


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 5000), st.sampled_from(["f32", "bf16"])),
            st.tuples(st.just("free"), st.integers(0, 100), st.just("")),
        ),
        max_size=25,
    )
)
def test_peak_of_a_sequence_is_exact(ops) -> None:
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    expected_peak = live = 0
    sizes = []
    for op, n, dt in ops:  # the reference: a running sum of storage bytes
        if op == "alloc":
            sizes.append(n * dtypes[dt].itemsize)
            live += sizes[-1]
            expected_peak = max(expected_peak, live)
        elif sizes:
            live -= sizes.pop(n % len(sizes))

    def fn():
        held = []
        for op, n, dt in ops:
            if op == "alloc":
                held.append(torch.empty(n, dtype=dtypes[dt]))
            elif held:
                held.pop(n % len(held))
        return held

    report = measure(fn, scan_live=False)
    assert report.peak_bytes == expected_peak
    assert report.end_bytes == live
    check_sums(report)


def test_exception_propagates_and_cleans_up() -> None:
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    n_hooks = len(_global_optimizer_pre_hooks)
    model = nn.Linear(4, 4)

    def fn():
        model(torch.randn(2, 4)).sum().backward()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        measure(fn, model=model)
    assert _get_current_dispatch_mode() is None
    assert len(_global_optimizer_pre_hooks) == n_hooks
    assert not model.weight._post_accumulate_grad_hooks


def test_torch_func_needs_track_saved_off() -> None:
    from memfit.errors import ConfigError

    def fn():
        return torch.func.grad(lambda x: x.sin().sum())(torch.ones(100))

    with pytest.raises(ConfigError, match="track_saved=False"):
        measure(fn, scan_live=False)
    report = measure(fn, scan_live=False, track_saved=False)
    assert torch.equal(report.result, torch.ones(100).cos())
    assert report.peak_bytes >= 2 * 100 * F32
    check_sums(report)


# ---------------------------------------------------------------- training steps


def make_mlp(seed: int = 0, width: int = 64, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
    ).to(dtype)


class TinyTransformer(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(1)
        )
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return self.norm(x)


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {
        "mlp": lambda: make_mlp(seed),
        "transformer": lambda: TinyTransformer(),
        "transformer-ckpt": lambda: TinyTransformer(ckpt=True),
    }[name]()


def make_step(model, optimizer, batch: int, autocast: torch.dtype | None = None, x=None):
    """One training step; the batch is made inside it unless ``x`` is given."""
    in_dim = 32

    def step():
        optimizer.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(1)
        shape = (batch, 8, in_dim) if isinstance(model, TinyTransformer) else (batch, in_dim)
        inp = torch.randn(shape, generator=g) if x is None else x
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(inp).float().square().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def setup(name="mlp", batch=16, autocast=None, warm=1, opt=torch.optim.Adam):
    model = make_model(name)
    optimizer = opt(model.parameters(), lr=1e-2)
    step = make_step(model, optimizer, batch, autocast)
    for _ in range(warm):
        step()
    return model, optimizer, step


def test_mlp_adam_params_grads_optimizer_exact() -> None:
    # A small batch puts the peak in the optimizer step, where every grad is alive.
    model, optimizer, step = setup("mlp", batch=4, warm=1)
    params = list(model.parameters())
    report = measure(step, model=model, optimizer=optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert report.by_kind["params"] == nbytes(params)
    assert report.by_kind["grads"] == nbytes(p.grad for p in params)
    assert report.by_kind["optimizer"] == nbytes(state)
    for kind, tensors in (("params", params), ("grads", [p.grad for p in params])):
        assert report.peak_by_kind[kind] == nbytes(tensors)
    assert report.peak_by_kind["optimizer"] == nbytes(state)
    assert report.start_bytes == nbytes(params) + nbytes(state) + nbytes(p.grad for p in params)
    check_sums(report)


def test_first_step_counts_lazy_optimizer_state() -> None:
    model, optimizer, step = setup("mlp", batch=4, warm=0)
    params = list(model.parameters())
    report = measure(step, model=model, optimizer=optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert report.start_bytes == nbytes(params)
    assert report.peak_by_kind["optimizer"] == nbytes(state)
    assert report.peak_by_kind["grads"] == nbytes(p.grad for p in params)


def test_grads_freed_inside_fn_still_counted_as_grads() -> None:
    model, optimizer, step = setup("mlp", batch=4, warm=1)
    params = list(model.parameters())
    grad_bytes = nbytes(p.grad for p in params)

    def step_then_clear():
        loss = step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    report = measure(step_then_clear, model=model, optimizer=optimizer)
    assert report.peak_by_kind["grads"] == grad_bytes
    assert report.end_bytes < report.start_bytes  # the grads died


def test_finds_model_and_optimizer_without_being_told() -> None:
    model, optimizer, step = setup("mlp", batch=4, warm=1)
    told = measure(step, model=model, optimizer=optimizer)
    gc.collect()
    found = measure(step)
    for kind in ("params", "grads", "optimizer"):
        assert found.peak_by_kind[kind] >= told.peak_by_kind[kind]
    # Everything else alive in this process comes on top, the step itself adds the same.
    assert found.peak_bytes - found.start_bytes == told.peak_bytes - told.start_bytes


def test_master_weights_count_as_optimizer() -> None:
    model = make_mlp(dtype=torch.bfloat16)
    working = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in working]
    optimizer = torch.optim.Adam(masters, lr=1e-2)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        for w, m in zip(working, masters):
            m.grad = w.grad.float()
            w.grad = None
        optimizer.step()
        with torch.no_grad():
            for w, m in zip(working, masters):
                w.copy_(m)

    step()
    report = measure(step, model=model, optimizer=optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert report.peak_by_kind["params"] == nbytes(working)
    assert report.peak_by_kind["optimizer"] == nbytes(state) + nbytes(masters)
    assert report.peak_by_kind["grads"] >= nbytes(m.grad for m in masters)
    check_sums(report)
    # Without the model, optimizer-held tensors are parameters unless marked as masters
    # (the working weights are then just tensors the step reads).
    unmarked = measure(step, optimizer=optimizer)
    assert unmarked.peak_by_kind["params"] == nbytes(masters)
    for m in masters:
        m._memfit_master = True
    marked = measure(step, optimizer=optimizer)
    assert marked.peak_by_kind["optimizer"] == nbytes(state) + nbytes(masters)
    assert marked.peak_bytes == report.peak_bytes


def test_bf16_autocast_shows_bf16_bytes() -> None:
    model, optimizer, step = setup("mlp", batch=512, autocast=torch.bfloat16)
    report = measure(step, model=model, optimizer=optimizer)
    assert report.by_dtype.get("torch.bfloat16", 0) > 0
    assert report.low_precision_share > 0.5
    assert report.by_kind["activations"] > 0
    fp32 = measure(setup("mlp", batch=512)[2], model=model, optimizer=optimizer)
    assert report.peak_bytes < fp32.peak_bytes
    check_sums(report)


def test_checkpointing_lowers_peak_and_recompute_counts_as_activations() -> None:
    plain = measure(setup("transformer", batch=16)[2])
    model, optimizer, step = setup("transformer-ckpt", batch=16)
    ckpt = measure(step, model=model, optimizer=optimizer)
    assert ckpt.peak_bytes - ckpt.start_bytes < plain.peak_bytes - plain.start_bytes
    assert ckpt.peak_by_kind["activations"] > 0
    check_sums(ckpt)


def test_forward_only_graph_is_freed_after_measuring() -> None:
    model = make_mlp()

    def forward():
        return model(torch.randn(8, 32)).sigmoid()  # sigmoid saves its output

    report = measure(forward, model=model)
    out = report.result
    assert report.by_kind["activations"] > 0
    freed = []
    weakref.finalize(out.untyped_storage(), freed.append, True)
    del out, report
    gc.collect()
    assert freed == [True]


@pytest.mark.parametrize(
    ("name", "autocast"),
    [("mlp", None), ("mlp", torch.bfloat16), ("transformer-ckpt", torch.bfloat16)],
    ids=["mlp-fp32", "mlp-bf16", "transformer-ckpt-bf16"],
)
def test_measuring_does_not_change_results(name, autocast) -> None:
    outcomes = []
    for measured in (False, True):
        model = make_model(name)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = make_step(model, optimizer, 8, autocast)
        step()

        def step_keep_grads(step=step, model=model):
            loss = step()
            return loss, [p.grad.clone() for p in model.parameters()]

        if measured:
            loss, grads = measure(step_keep_grads, model=model, optimizer=optimizer).result
        else:
            loss, grads = step_keep_grads()
        outcomes.append((loss, grads, [p.detach().clone() for p in model.parameters()]))
    (loss0, grads0, params0), (loss1, grads1, params1) = outcomes
    assert torch.equal(loss0, loss1)
    for a, b in zip(grads0 + params0, grads1 + params1):
        assert torch.equal(a, b)


def test_double_backward_unchanged() -> None:
    # Saved outputs are handed to autograd detached; higher-order grads must not notice.
    def fn():
        x = torch.linspace(-2, 2, 50, requires_grad=True)
        y = (x.exp() * x.tanh()).sigmoid().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        return g.detach(), h

    expected = fn()
    got = measure(fn, scan_live=False).result
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- independent check


def memtracker_peak(model, optimizer, step, device=None) -> int:
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    MemTracker = mem_tracker.MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    device = device or torch.device("cpu")
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "batch"), [("mlp", 256), ("mlp", 4), ("transformer", 8), ("transformer-ckpt", 4)]
)
def test_agrees_with_torch_memtracker(name, batch, autocast) -> None:
    # Two identical copies: each tracker sees exactly the same step.
    model, optimizer, step = setup(name, batch=batch, autocast=autocast)
    ours = measure(step, model=model, optimizer=optimizer)
    model, optimizer, step = setup(name, batch=batch, autocast=autocast)
    theirs = memtracker_peak(model, optimizer, step)
    assert ours.peak_bytes == pytest.approx(theirs, rel=0.02)
    check_sums(ours)


# ---------------------------------------------------------------- report and estimate


def test_summary_and_to_dict() -> None:
    model, optimizer, step = setup("mlp", batch=512, autocast=torch.bfloat16)
    report = measure(step, model=model, optimizer=optimizer)
    text = report.summary()
    for word in (*KINDS, "torch.bfloat16", "peak memory on cpu", "KiB"):
        assert word in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["peak_bytes"] == report.peak_bytes
    assert d["by_kind"] == report.by_kind
    assert d["device"] == "cpu"
    assert d["low_precision_share"] == pytest.approx(report.low_precision_share)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fake_estimate_matches_measurement(autocast) -> None:
    def inputs():
        return torch.randn(64, 32)

    est = estimate_step_memory(make_mlp, inputs, autocast_dtype=autocast)
    assert est.method == "tracker"
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    x = inputs()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x).float().sum()
        loss.backward()
        optimizer.step()

    step()
    real = measure(step, model=model, optimizer=optimizer)
    assert est.peak_bytes == real.peak_bytes
    assert est.by_kind == real.by_kind


# ---------------------------------------------------------------- CUDA


def test_untracked_allocator_bytes_fold_into_temp() -> None:
    from memfit.memory import _add_untracked

    by_kind = {"params": 10, "grads": 0, "optimizer": 0, "activations": 5, "temp": 3}
    by_dtype = {"torch.float32": 18}
    _add_untracked(by_kind, by_dtype, 7)
    assert by_kind["temp"] == 10 and by_dtype["untracked"] == 7
    _add_untracked(by_kind, by_dtype, -12)  # more tracked than allocated: take from temp first
    assert by_kind == {"params": 10, "grads": 0, "optimizer": 0, "activations": 3, "temp": 0}
    assert sum(by_kind.values()) == sum(by_dtype.values()) == 13


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match="device='cpu'"):
        measure(lambda: None, device="cuda")
    with pytest.raises(ConfigError, match="device='cpu'"):
        estimate_step_memory(make_mlp, lambda: torch.randn(2, 32), device="cuda")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_cuda_single_allocation() -> None:
    report = measure(lambda: torch.empty(1 << 20, device="cuda"), device="cuda")
    assert report.method == "cuda-allocator"
    # A cached block a little larger than asked for may be handed out whole.
    assert 4 << 20 <= report.peak_bytes - report.start_bytes <= 5 << 20
    assert report.by_dtype["torch.float32"] >= 4 << 20
    check_sums(report)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_step_agrees_with_memtracker(autocast) -> None:
    def build():
        model = make_mlp(width=512).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step():
            optimizer.zero_grad(set_to_none=True)
            x = torch.randn(1024, 32, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast is not None):
                loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()

        step()
        return model, optimizer, step

    model, optimizer, step = build()
    ours = measure(step, model=model, optimizer=optimizer)
    model, optimizer, step = build()
    theirs = memtracker_peak(model, optimizer, step, torch.device("cuda", 0))
    assert ours.tracked_peak_bytes == pytest.approx(theirs, rel=0.02)
    assert ours.peak_bytes >= ours.tracked_peak_bytes * 0.98
    check_sums(ours)


def test_allocator_peak_inside_a_running_profiler_leaves_it_running() -> None:
    # The Engine measures its first planned step with the allocator; a user profiling
    # their loop must keep their trace.
    from memfit.allocator import allocator_peak

    x = torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        inner = allocator_peak(lambda: x @ x)
        y = x + 1
    assert inner.peak_bytes >= 256 * 256 * 4
    assert any(e.name == "aten::add" for e in prof.events()) and y.shape == x.shape


def test_allocator_bytes_no_tensor_shows_are_in_each_kinds_peak() -> None:
    # On CUDA the allocator's peak holds what no tensor shows (cuBLAS keeps a workspace per
    # handle from its first matmul on): folded into 'temp' at the peak, it must be in
    # temp's own peak too. The CUDA report is built here from a CPU tracker and allocator
    # bytes 64 MiB above the tracked peak, as an H200's two handles showed.
    from memfit.memory import _AllocatorBytes, _track, _tracker_report

    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    result, tracker = _track(
        lambda: model(x).square().sum().backward(),
        torch.device("cpu"),
        model,
        None,
        False,
        512,
        True,
    )
    tracked = tracker.replay()[0]
    extra = 64 * 2**20
    report = _tracker_report(
        tracker, torch.device("cpu"), result, _AllocatorBytes(0, tracked + extra, extra)
    )
    check_sums(report)
    assert report.peak_bytes == tracked + extra
    assert report.by_dtype["untracked"] == extra
    assert report.peak_by_kind["temp"] >= extra
