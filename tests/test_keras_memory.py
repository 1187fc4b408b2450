"""memfit.keras's memory meter: TensorFlow's CPU allocator, whatever the import order.

TensorFlow reads TF_CPU_ALLOCATOR_USE_BFC when it starts (its first tensor), not when it is
imported. The scripts below run in a fresh interpreter, without the variable, in the order
users write: TensorFlow and Keras first.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import keras_cases  # noqa: F401  (TensorFlow set up first)
import numpy as np
import pytest
import tensorflow as tf
from keras_cases import LOSS, batch, mlp

import memfit.keras as mk
from memfit.errors import ConfigError
from memfit.keras import memory

ROOT = Path(__file__).resolve().parents[1]

# The user's script: its model is made after memfit.keras is imported, or before.
IMPORTS = "import tensorflow as tf\nimport keras\n"
IMPORT_MEMFIT = "import memfit.keras as mk\n"
MODEL = """
import json, os, sys, tempfile
import numpy as np
from memfit.errors import ConfigError
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
rng = np.random.default_rng(0)
x = rng.random((64, 32), dtype=np.float32)
y = rng.integers(0, 10, 64)
inputs = keras.Input((32,))
h = inputs
for i in range(3):
    h = keras.layers.Dense(64, activation="gelu", name=f"d{i}")(h)
model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
"""
# Every tensor of this model is 16 KiB or less: only an allocator that counts every tensor
# (not oneDNN's, from 256 KiB) sees what it keeps.
USE = """
out = {"bfc": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")}
try:
    plan = mk.plan(model, x, y, loss, optimizer=keras.optimizers.Adam())
    out["kept"], out["predicted"] = plan.kept_bytes, plan.predicted_peak_bytes
except ConfigError as exc:
    out["plan_error"] = str(exc)
try:
    out["measured"] = mk.measure_step(model, x, y, loss, keras.optimizers.Adam()).peak_bytes
except ConfigError as exc:
    out["measure_error"] = str(exc)
model.compile(keras.optimizers.SGD(0.01), loss)
run = os.path.join(tempfile.mkdtemp(), "run")
model.fit(x, y, batch_size=32, epochs=1, verbose=0,
          callbacks=[mk.MonitorCallback(run, log_every=1, tensorboard=False)])
with open(os.path.join(run, "metrics.jsonl")) as f:
    out["metrics"] = [json.loads(line) for line in f]
print(json.dumps(out))
"""

# What the user reads when TensorFlow started before memfit.keras could set the variable.
REFUSAL = (
    "{feature} cannot measure memory: TensorFlow's CPU allocator {problem}. TensorFlow "
    "started (made its first tensor, variable or model) without "
    "TF_CPU_ALLOCATOR_USE_BFC=true in the environment, and it reads that variable only when "
    "it starts: memfit.keras, which sets it, was imported after that. With "
    "TF_CPU_ALLOCATOR_USE_BFC=true TensorFlow uses its BFC allocator on the CPU, which counts "
    "every tensor. Set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow "
    "starts (in the shell, or in os.environ before the first TensorFlow operation), or "
    "import memfit.keras before building a model or running any TensorFlow operation (it "
    "sets the variable then)."
)
SMALL_UNCOUNTED = (
    "does not count small tensors (a 16 KiB tensor did not show in its counter: without its "
    "BFC allocator TensorFlow counts only oneDNN's allocations of 256 KiB and more)"
)
NO_STATISTICS = "keeps no statistics"


def _user_script(code: str, onednn: str | None = None) -> tuple[dict[str, Any], str]:
    """Run ``code`` in a fresh interpreter without TF_CPU_ALLOCATOR_USE_BFC: (what it
    printed as JSON, its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    if onednn is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = onednn
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_tensorflow_and_keras_imported_first_still_measure_every_tensor() -> None:
    out, err = _user_script(IMPORTS + IMPORT_MEMFIT + MODEL + USE)
    # memfit.keras set the variable: TensorFlow was imported but had not started.
    assert out["bfc"] == "true"
    assert "plan_error" not in out and "measure_error" not in out
    # The plan saw what the 16 KiB activations keep, and the step measured agrees.
    assert out["kept"] > 0
    assert out["measured"] > 0
    assert abs(out["predicted"] / out["measured"] - 1) < 0.25
    steps = out["metrics"]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["memory/allocated_peak_bytes"] > 0 for m in steps)
    assert "cannot measure memory" not in err


@pytest.mark.parametrize(("onednn", "problem"), [("1", SMALL_UNCOUNTED), ("0", NO_STATISTICS)])
def test_tensorflow_started_first_is_refused_with_the_remedy_and_fit_still_trains(
    onednn: str, problem: str
) -> None:
    # The model is built (TensorFlow starts) before memfit.keras is imported.
    out, err = _user_script(IMPORTS + MODEL + IMPORT_MEMFIT + USE, onednn)
    assert out["bfc"] is None  # too late to set: left alone
    assert out["plan_error"] == REFUSAL.format(feature="memfit.keras.plan", problem=problem)
    assert out["measure_error"] == REFUSAL.format(
        feature="memfit.keras.measure_step", problem=problem
    )
    steps = out["metrics"]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(np.isfinite(m["loss"]) for m in steps)
    assert not any("memory/allocated_peak_bytes" in m for m in steps)
    warning = REFUSAL.format(feature="memfit.keras.MonitorCallback", problem=problem)
    assert err.count(warning + " Training goes on without memory/allocated_peak_bytes.") == 1


# ---------------------------------------------------------------------- in this process


def test_the_meter_counts_a_small_tensor() -> None:
    meter = memory.allocator_meter("test")
    source = tf.fill([1024], 1.0)
    before = meter.current()
    with tf.device("/CPU:0"):
        t = tf.math.negative(source)  # 4 KiB, far under oneDNN's 256 KiB
        held = meter.current()
        del t
    after = meter.current()
    # At least the tensor, both ways (an op may also keep a small cache on its first run).
    assert 4096 <= held - before < 64 * 1024
    assert held - after >= 4096


def test_once_tensorflow_started_the_variable_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tf.constant(1.0)
    assert memory.tensorflow_started()
    monkeypatch.delenv(memory.BFC_VARIABLE, raising=False)
    assert memory.request_counting_allocator() is False
    assert memory.BFC_VARIABLE not in os.environ


def test_a_value_the_user_set_off_is_named_in_the_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.BFC_VARIABLE, "false")
    assert memory.refusal("memfit.keras.plan", NO_STATISTICS) == (
        "memfit.keras.plan cannot measure memory: TensorFlow's CPU allocator keeps no "
        "statistics. TF_CPU_ALLOCATOR_USE_BFC is 'false' in the environment, which keeps "
        "TensorFlow's BFC allocator off the CPU. With TF_CPU_ALLOCATOR_USE_BFC=true "
        "TensorFlow uses its BFC allocator on the CPU, which counts every tensor. Set "
        "TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow starts (in the "
        "shell, or in os.environ before the first TensorFlow operation), or import "
        "memfit.keras before building a model or running any TensorFlow operation (it sets "
        "the variable then)."
    )


def test_every_reader_of_the_allocator_goes_through_the_meter() -> None:
    package = Path(mk.__file__).parent
    readers = sorted(
        path.name
        for path in package.glob("*.py")
        if any(
            name in path.read_text(encoding="utf-8")
            for name in ("get_memory_info", "reset_memory_stats")
        )
    )
    assert readers == ["memory.py"]


def test_without_a_counting_allocator_plans_are_refused_and_fit_warns_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As a process whose TensorFlow started without the BFC allocator: the probe's verdict.
    monkeypatch.setattr(memory, "_verdict", NO_STATISTICS)
    monkeypatch.delenv(memory.BFC_VARIABLE, raising=False)
    model = mlp(n=1, width=32)
    x, y = batch(n=32)
    for call in (
        lambda: mk.plan(model, x, y, LOSS),
        lambda: mk.profile(model, x, y, LOSS),
        lambda: mk.measure_step(model, x, y, LOSS),
    ):
        with pytest.raises(ConfigError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
            call()
    model.compile(keras.optimizers.SGD(0.01), LOSS)
    callback = mk.MonitorCallback(tmp_path / "run", log_every=1, tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="memfit.keras"):
        for _ in range(2):  # two fits with one callback: one warning
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    warned = [r for r in caplog.records if "cannot measure memory" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].getMessage() == (
        REFUSAL.format(feature="memfit.keras.MonitorCallback", problem=NO_STATISTICS)
        + " Training goes on without memory/allocated_peak_bytes."
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert len(logged) == 4 and all("loss" in m for m in logged)
    assert not any("memory/allocated_peak_bytes" in m for m in logged)


def test_with_a_counting_allocator_the_callback_logs_the_peak_of_the_run(tmp_path: Path) -> None:
    model = mlp(n=1, width=32)
    x, y = batch(n=32)
    model.compile(keras.optimizers.SGD(0.01), LOSS)
    # A large tensor's peak before fit is not the run's: the callback starts its own.
    meter = memory.allocator_meter("test")
    base = meter.current()
    meter.reset_peak()
    big = tf.fill([8 * 1024 * 1024], 1.0)  # 32 MiB
    del big
    assert meter.peak() >= base + 32 * 1024 * 1024
    callback = mk.MonitorCallback(tmp_path / "run", log_every=1, tensorboard=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    peaks = [json.loads(line)["memory/allocated_peak_bytes"] for line in lines]
    assert len(peaks) == 2
    assert all(0 < p < base + 32 * 1024 * 1024 for p in peaks)
