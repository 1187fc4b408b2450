"""memfit.keras.MonitorCallback: metrics from model.fit to memfit's sinks and report."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import keras_cases  # noqa: F401  (TensorFlow set up first)
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import memfit.keras as mk
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.monitor.report import load_run


def _fp16_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    with mk.precision("fp16-mixed"):
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
        )


def test_fit_logs_scale_skips_and_norms_and_memfit_report_renders_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _fp16_model()
    optimizer = mk.wrap_optimizer(
        keras.optimizers.SGD(0.01), "fp16-mixed", init_scale=1024.0, growth_interval=4
    )
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.random((48, 8), dtype=np.float32)
    y = rng.random((48, 4), dtype=np.float32)
    x[8:16] = 1e5  # batch 2 overflows float16: its step is skipped
    run = tmp_path / "run"
    callback = mk.MonitorCallback(run, log_every=1)
    assert not run.exists()  # nothing on disk before training starts
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[callback], verbose=0)

    log = load_run(run)
    steps, scales = log.series("amp/scale")
    assert steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # halved at the overflow, doubled after 4 finite steps in a row
    assert scales == [1024.0, 512.0, 512.0, 512.0, 512.0, 1024.0]
    assert log.series("amp/skipped")[1] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert log.latest()["amp/overflow_rate"] == pytest.approx(1 / 6)
    _, norms = log.series("grad/norm")
    assert np.isfinite(norms[0]) and norms[0] > 0 and not np.isfinite(norms[1])
    _, samples = log.series("throughput/samples_per_second")
    assert all(s > 0 for s in samples)
    assert log.precision == "fp16-mixed"
    assert log.summary["steps"] == 6 and log.summary["skipped_steps"] == 1
    assert json.loads((run / "health.json").read_text())["checks"]
    assert model.optimizer.iterations.numpy() == 5  # Keras counts applied steps only

    assert main(["report", str(run)]) == 0
    html = Path(capsys.readouterr().out.strip())
    assert html.is_file() and "Loss scale" in html.read_text()

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"loss", "amp/scale", "grad/norm"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("amp/scale")] == scales

    # The wrappers are gone after training: another fit runs Keras's own train step.
    assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)


def test_a_plan_is_logged_and_saved(tmp_path: Path) -> None:
    from keras_cases import LOSS, batch, mlp

    model = mlp(n=2, width=32)
    x, y = batch(n=32)
    plan = mk.plan(model, x, y, LOSS, strategy="full")
    planned = mk.apply_plan(model, plan)
    planned.compile(keras.optimizers.Adam(1e-3), LOSS)
    callback = mk.MonitorCallback(tmp_path / "run", log_every=2, plan=plan, tensorboard=False)
    planned.fit(x, y, batch_size=8, epochs=1, callbacks=[callback], verbose=0)
    log = load_run(tmp_path / "run")
    assert log.latest()["plan/predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert log.plan is not None and log.plan["strategy"] == "full"
    assert "amp/scale" not in log.keys()  # fp32: no scaling
    assert log.precision == "fp32"


def test_bad_log_dirs_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        mk.MonitorCallback(afile)
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run"):
        mk.MonitorCallback(used)
    mk.MonitorCallback(used, append=True)
    with pytest.raises(ConfigError, match="log_every"):
        mk.MonitorCallback(tmp_path / "new", log_every=0)
    assert not (tmp_path / "new").exists()


def test_an_uncompiled_model_is_refused(tmp_path: Path) -> None:
    callback = mk.MonitorCallback(tmp_path / "run")
    callback.set_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    with pytest.raises(ConfigError, match="compiled model"):
        callback.on_train_begin()
    assert not (tmp_path / "run").exists()


def test_a_fit_that_raises_leaves_nothing_wrapped_for_the_next_one(tmp_path: Path) -> None:
    model = _fp16_model()
    model.compile(mk.wrap_optimizer(keras.optimizers.SGD(0.01), "fp16-mixed"), "mse")
    own_step = model.train_step  # a user's own instance-level train_step is kept
    model.train_step = lambda data: own_step(data)
    users = model.train_step
    rng = np.random.default_rng(0)
    x = rng.random((32, 8), dtype=np.float32)
    y = rng.random((32, 4), dtype=np.float32)

    def batches():
        for i in range(4):
            if i == 2:
                raise ValueError("a broken batch")
            yield x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

    first = mk.MonitorCallback(tmp_path / "first", log_every=1)
    with pytest.raises(Exception, match="a broken batch"):  # TF re-raises it as its own
        model.fit(batches(), epochs=1, shuffle=False, callbacks=[first], verbose=0)
    assert model.train_step is not users  # Keras ran no on_train_end: still wrapped
    second = mk.MonitorCallback(tmp_path / "second", log_every=1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[second], verbose=0)
    assert model.train_step is users and "apply" not in vars(model.optimizer)
    log = load_run(tmp_path / "second")
    _, samples = log.series("throughput/samples_per_second")
    assert len(samples) == 4 and second.steps == 4
    assert float(second._samples.numpy()) == 32.0  # counted once a batch, not twice


def test_two_callbacks_in_one_fit_both_measure(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.random.default_rng(0).random((32, 8), dtype=np.float32)
    a = mk.MonitorCallback(tmp_path / "a", log_every=1)
    b = mk.MonitorCallback(tmp_path / "b", log_every=1)
    model.fit(x, x[:, :4], batch_size=8, epochs=1, shuffle=False, callbacks=[a, b], verbose=0)
    norms = {n: load_run(tmp_path / n).series("grad/norm")[1] for n in ("a", "b")}
    assert len(norms["a"]) == 4 and all(v > 0 for v in norms["a"])
    assert norms["a"] == pytest.approx(norms["b"])
    assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)
