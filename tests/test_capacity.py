"""The capacity view (``memfit.capacity``, ``memfit estimate --scale``) and the estimator's
batch search it rests on: every number is checked against estimates run directly."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import memfit
from memfit.capacity_view import BASELINE, Capacity
from memfit.checkpoint.planner import storage_choices
from memfit.cli.estimate_command import builtin_spec
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.estimator import MAX_BATCH

pytestmark = pytest.mark.usefixtures("one_thread")

# ``memfit.estimate`` is also the name of the function the package exports.
estimate_module = sys.modules["memfit.estimator"]

MEMORY = 6 * 2**20
SIZES = [(1, 32), (2, 64), (4, 256)]


def _family(depth: int, width: int):
    items = [f"n_layer={depth}", f"n_embd={width}", f"n_head={width // 32}", "block_size=32"]
    return builtin_spec("gpt", items)[0]()


_, INPUTS, LOSS = builtin_spec("gpt", ["block_size=32"])


def _estimates(depth: int, width: int, precision: str, strategies: list[str], batch_size: int):
    return memfit.estimate(
        lambda: _family(depth, width),
        INPUTS,
        batch_size=batch_size,
        loss_fn=LOSS,
        precisions=[precision],
        strategies=strategies,
        device_memory=MEMORY,
    ).rows


def _estimate(depth: int, width: int, precision: str, strategy: str, batch_size: int):
    return _estimates(depth, width, precision, [strategy], batch_size)[0]


@pytest.fixture(scope="module")
def cap() -> Capacity:
    return memfit.capacity(
        _family, INPUTS, sizes=SIZES, batch_size=4, device_memory=MEMORY, loss_fn=LOSS
    )


def test_rows_agree_with_direct_estimates(cap: Capacity) -> None:
    assert cap.combos() == [
        (p, s, "") for p in ("fp32", "bf16-mixed") for s in ("none", "full", "optimal")
    ]
    assert len(cap.rows) == len(SIZES) * 6
    strategies = ["none", "full", "optimal"]
    for (depth, width), precision in [(s, p) for s in SIZES for p in ("fp32", "bf16-mixed")]:
        rows = [r for s in strategies for r in cap.of(precision, s) if r.size == f"{depth}x{width}"]
        if rows[0].peak_bytes is None:  # not profiled: the static bytes alone exceed it
            assert all(r.static_bytes > MEMORY and not r.fits for r in rows)
            assert all(r.max_micro_batch == 0 for r in rows)
            direct = _estimates(depth, width, precision, strategies, 1)
            assert not any(d.fits for d in direct)
            continue
        for row, direct in zip(rows, _estimates(depth, width, precision, strategies, 4)):
            assert row.strategy == direct.strategy
            assert row.peak_bytes == direct.peak_bytes and row.fits == direct.fits
            assert row.max_micro_batch == direct.max_micro_batch
    # The largest size is out of reach, the smallest fits everywhere.
    assert all(r.peak_bytes is None for r in cap.rows if (r.depth, r.width) == SIZES[-1])
    assert all(r.fits for r in cap.rows if (r.depth, r.width) == SIZES[0])


def test_max_micro_batch_is_the_largest_that_fits_for_every_strategy(cap: Capacity) -> None:
    for precision, strategy in [("fp32", "none"), ("bf16-mixed", "full"), ("fp32", "optimal")]:
        row = next(r for r in cap.of(precision, strategy) if (r.depth, r.width) == (2, 64))
        best = row.max_micro_batch
        assert best > 4
        assert _estimate(2, 64, precision, strategy, best).fits
        assert not _estimate(2, 64, precision, strategy, best + 1).fits


def test_headline_compares_with_plain_training(cap: Capacity) -> None:
    ref = cap.reference()
    assert ref is not None and (ref.precision, ref.strategy, ref.tiers) == BASELINE
    base_batch = cap.largest_batch(*BASELINE)
    for h in cap.headline():
        model = cap.largest_model(h["precision"], h["strategy"])
        assert h["largest_model"] == model.size
        assert h["model_x"] == model.parameters / ref.parameters
        assert h["batch_x"] == h["largest_batch"] / base_batch
        same_size = [r for r in cap.of(h["precision"], h["strategy"]) if r.size == ref.size]
        assert h["largest_batch"] == same_size[0].max_micro_batch
    # Checkpointing fits a larger batch than plain training on the same model.
    assert cap.largest_batch("fp32", "full") > base_batch
    doc = json.loads(cap.to_json())
    assert doc["reference"] == ref.size and len(doc["rows"]) == len(cap.rows)
    table = cap.summary()
    assert "largest model" in table and ref.size in table and "\x1b[" not in table


def test_plot_writes_a_png(cap: Capacity, tmp_path) -> None:
    path = cap.plot(tmp_path / "fig" / "capacity.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_sizes_and_strategies_are_refused() -> None:
    kw = {"batch_size": 1, "device_memory": MEMORY, "loss_fn": LOSS}
    with pytest.raises(ConfigError, match="at least one"):
        memfit.capacity(_family, INPUTS, sizes=[], **kw)
    with pytest.raises(ConfigError, match="positive ints"):
        memfit.capacity(_family, INPUTS, sizes=[(0, 64)], **kw)
    with pytest.raises(ConfigError, match="unknown strategy"):
        memfit.capacity(_family, INPUTS, sizes=[(1, 32)], strategies=["most"], **kw)
    with pytest.raises(ConfigError, match="no rows"):
        memfit.capacity(
            _family, INPUTS, sizes=[(1, 32)], precisions=["fp32"], strategies=["none"], **kw
        ).of("bf16-mixed", "none")


def test_cli_scale_json_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "cap.png"
    args = ["estimate", "--scale", "--sizes", "1x32,2x64", "--set", "block_size=32"]
    args += ["--batch-size", "2", "--device-memory", "6MiB", "--precision", "fp32"]
    args += ["--strategy", "none", "--strategy", "full"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [h["strategy"] for h in doc["headline"]] == ["none", "full"]
    assert {(r["depth"], r["width"]) for r in doc["rows"]} == {(1, 32), (2, 64)}
    assert main([*args, "--plot", str(png)]) == 0
    assert "figure:" in capsys.readouterr().out and png.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--scale"], "--device-memory"),
        (["--scale", "--device-memory", "1GB", "--sizes", "32by4096"], "DEPTHxWIDTH"),
        (["--scale", "--device-memory", "1GB", "--model", "resnet"], "built-in gpt"),
        (["--plot", "x.png"], "--scale"),
    ],
)
def test_cli_scale_errors(extra, message, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@given(
    last=st.integers(1, MAX_BATCH),
    probe=st.integers(-5, MAX_BATCH + 5),
    step=st.integers(1, 4096),
)
def test_largest_finds_the_end_of_a_prefix_from_any_start(last: int, probe: int, step: int) -> None:
    asked: list[int] = []

    def fits(b: int) -> bool:
        asked.append(b)
        return b <= last

    assert estimate_module._largest(fits, probe, step) == last
    assert all(1 <= b <= MAX_BATCH for b in asked)


def test_a_good_guess_is_checked_in_two_fake_steps(monkeypatch) -> None:
    profiled: list[int] = []
    real = estimate_module.Estimator.profiled

    def counting(self, policy, batch_size):
        if (policy.mode, batch_size) not in self.profiles:
            profiled.append(batch_size)
        return real(self, policy, batch_size)

    monkeypatch.setattr(estimate_module.Estimator, "profiled", counting)
    row = _estimate(2, 64, "fp32", "none", 1)
    # Batch 1 (the row), 2 and 4 (the line), then the guess and the one after it.
    assert profiled[:3] == [1, 2, 4] and len(profiled) == 5
    assert profiled[3:] == [row.max_micro_batch, row.max_micro_batch + 1]


def test_fsdp_ranks_fit_a_model_one_device_cannot() -> None:
    # 51.7 MB of weights, gradients and AdamW state: more than the memory on one device.
    kw = {"batch_size": 1, "device_memory": 40 * 2**20, "loss_fn": LOSS, "precisions": ["fp32"]}
    kw["strategies"] = ["none"]
    one = memfit.capacity(_family, INPUTS, sizes=[(4, 256)], **kw)
    assert one.rows[0].peak_bytes is None and not one.rows[0].fits  # static alone too big
    sharded = memfit.capacity(
        _family, INPUTS, sizes=[(4, 256)], world_size=16, data_parallel="fsdp", **kw
    )
    row = sharded.rows[0]
    assert row.fits and row.max_micro_batch >= 1
    # Shards of 1/16, and two blocks gathered while they compute.
    assert row.static_bytes < one.rows[0].static_bytes / 4
    with pytest.raises(ConfigError, match="data_parallel"):
        memfit.capacity(_family, INPUTS, sizes=[(1, 32)], data_parallel="zero", **kw)


def test_affine_profile_moves_numbers_and_refuses_other_differences() -> None:
    from typing import NamedTuple

    from memfit.interpolate import NotAffine, affine_profile

    class Row(NamedTuple):
        bytes: int
        name: str

    low, high = [Row(10, "a"), (1.0, 2.0)], [Row(30, "a"), (2.0, 2.0)]
    assert affine_profile(low, high, 8, 2, 4) == [Row(70, "a"), (4.0, 2.0)]
    assert affine_profile(low, high, 0, 2, 4)[0].bytes == 0  # never below zero
    with pytest.raises(NotAffine):
        affine_profile([Row(1, "a")], [Row(2, "b")], 3, 1, 2)
    with pytest.raises(NotAffine):
        affine_profile([1, 2], [1, 2, 3], 3, 1, 2)


def _tier_estimates(
    depth: int, width: int, precision: str, bits: str, release: bool, storage: str = ""
):
    return memfit.estimate(
        lambda: _family(depth, width),
        INPUTS,
        batch_size=4,
        loss_fn=LOSS,
        precisions=[precision],
        strategies=["none", "optimal"],
        device_memory=MEMORY,
        optimizer_state=bits,
        release_gradients=release,
        activation_storage=storage_choices([storage] if storage else []),
    ).rows


def test_memory_tiers_are_searched_and_named() -> None:
    cap = memfit.capacity(
        _family,
        INPUTS,
        sizes=SIZES[:2],
        batch_size=4,
        device_memory=MEMORY,
        loss_fn=LOSS,
        precisions=["fp32", "bf16-sr"],
        strategies=["none", "optimal"],
        memory_tiers="all",
    )
    tiers = ["", "8bit state", "released grads", "fp8 activations", "8bit state + released grads"]
    tiers.append("8bit state + released grads + fp8 activations")
    assert cap.combos() == [
        (p, s, t) for p in ("fp32", "bf16-sr") for t in tiers for s in ("none", "optimal")
    ]
    # Each row is the estimate made with its tiers directly.
    settings = {
        "": ("fp32", False, ""),
        tiers[1]: ("8bit", False, ""),
        tiers[2]: ("fp32", True, ""),
    }
    settings[tiers[3]] = ("fp32", False, "fp8")
    settings[tiers[4]] = ("8bit", True, "")
    settings[tiers[5]] = ("8bit", True, "fp8")
    for precision in ("fp32", "bf16-sr"):
        for name, (bits, release, storage) in settings.items():
            direct = _tier_estimates(2, 64, precision, bits, release, storage)
            rows = [r for s in ("none", "optimal") for r in cap.of(precision, s, name)]
            rows = [r for r in rows if r.size == "2x64"]
            for row, d in zip(rows, direct):
                assert row.tiers == name and row.strategy == d.strategy
                assert row.peak_bytes == d.peak_bytes
                assert row.max_micro_batch == d.max_micro_batch
    # Every tier holds less than plain training, and together they fit a larger batch.
    plain = cap.largest_batch("fp32", "none")
    both = cap.largest_batch("bf16-sr", "optimal", tiers[4])
    assert both > plain
    static = {t: cap.of("bf16-sr", "none", t)[-1].static_bytes for t in tiers}
    assert static[tiers[1]] < static[""] and static[tiers[4]] < static[""]
    headline = {(h["precision"], h["strategy"], h["tiers"]): h for h in cap.headline()}
    assert headline[("bf16-sr", "optimal", tiers[4])]["batch_x"] == both / plain
    table = cap.summary()
    assert "tiers" in table and "released grads" in table
    assert json.loads(cap.to_json())["rows"][-1]["tiers"] == tiers[5]


def test_bad_memory_tiers_are_refused() -> None:
    kw = {"batch_size": 1, "device_memory": MEMORY, "loss_fn": LOSS, "sizes": [(1, 32)]}
    with pytest.raises(ConfigError, match="memory_tiers takes"):
        memfit.capacity(_family, INPUTS, memory_tiers="some", **kw)
    with pytest.raises(ConfigError, match="data-parallel"):
        memfit.capacity(_family, INPUTS, memory_tiers="all", world_size=2, **kw)


def test_cli_tiers_and_released_gradients(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--set", "block_size=32", "--batch-size", "2", "--precision", "fp32"]
    args += ["--strategy", "none"]
    assert main([*args, "--json", "--release-gradients"]) == 0
    released = json.loads(capsys.readouterr().out)
    assert main([*args, "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    # Released: one tensor's gradient at a time, not every gradient.
    assert released["rows"][0]["parts"]["grads"] < kept["rows"][0]["parts"]["grads"]
    assert main([*args, "--tiers", "all"]) == 2
    assert "add --scale" in capsys.readouterr().err
    scale = [*args, "--scale", "--sizes", "1x32", "--device-memory", "6MiB"]
    assert main([*scale, "--release-gradients"]) == 2
    assert "--tiers all" in capsys.readouterr().err


def test_the_chunked_loss_is_a_tier_where_capacity_is_given_one() -> None:
    import functools

    from memfit.models.gpt import chunked_gpt_loss

    # A vocabulary large beside the width: the logits are most of a step's activations.
    items = ["block_size=32", "vocab_size=4096"]
    _, inputs, loss = builtin_spec("gpt", items)

    def family(depth: int, width: int):
        size = [f"n_layer={depth}", f"n_embd={width}", f"n_head={width // 32}"]
        return builtin_spec("gpt", size + items)[0]()

    kw = {"sizes": [(2, 64)], "batch_size": 2, "device_memory": 12 * 2**20, "loss_fn": loss}
    kw |= {"precisions": ["fp32"], "strategies": ["optimal"], "memory_tiers": "all"}
    chunked = functools.partial(chunked_gpt_loss, chunk_tokens=16)
    cap = memfit.capacity(family, inputs, chunked_loss_fn=chunked, **kw)
    names = [t for _, _, t in cap.combos()]
    assert "chunked loss" in names
    assert "8bit state + released grads + fp8 activations + chunked loss" in names
    plain, pieces = (
        cap.largest_batch("fp32", "optimal"),
        cap.largest_batch("fp32", "optimal", "chunked loss"),
    )
    assert pieces > plain > 0
    # The row is the estimate made with the chunked loss directly.
    direct = memfit.estimate(
        lambda: family(2, 64),
        inputs,
        batch_size=2,
        loss_fn=chunked,
        precisions=["fp32"],
        strategies=["optimal"],
        device_memory=kw["device_memory"],
    ).rows[0]
    assert direct.max_micro_batch == pieces
    # Without a chunked loss there is no such tier.
    assert not any("chunked" in t for _, _, t in memfit.capacity(family, inputs, **kw).combos())
