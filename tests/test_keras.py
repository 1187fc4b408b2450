"""memfit.keras: lazy import, precision policies per layer, loss scaling as LossScaler does."""

from __future__ import annotations

import subprocess
import sys

import keras
import keras_cases  # noqa: F401  (TensorFlow set up first)
import numpy as np
import pytest
import tensorflow as tf
import torch

import memfit
import memfit.keras as mk
from memfit.errors import ConfigError


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


def test_import_memfit_does_not_import_tensorflow_until_a_name_is_used() -> None:
    out = _run(
        "import sys, memfit\n"
        "mod = memfit.keras\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
        "mod.precision\n"
        "print('keras' in sys.modules)\n"
    )
    assert out.split() == ["False", "False", "True"]


def test_missing_tensorflow_names_the_extra() -> None:
    out = _run(
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "def hidden(name, *a, **k):\n"
        "    return None if name.split('.')[0] in ('keras', 'tensorflow') else real(name, *a, **k)\n"
        "importlib.util.find_spec = hidden\n"
        "import memfit\n"
        "try:\n"
        "    memfit.keras.plan\n"
        "except memfit.errors.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    assert "pip install 'memfit[keras]'" in out


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = mk.nothing


def _small(final: str = "head") -> keras.Model:
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="dense")(inputs)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dense(16, activation="relu", name="dense2")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name=final)(x))


@pytest.mark.parametrize(
    ("mode", "compute"),
    [("fp32", "float32"), ("bf16-mixed", "bfloat16"), ("fp16", "float16")],
)
def test_policy_dtypes_per_layer(mode: str, compute: str) -> None:
    before = keras.config.dtype_policy().name
    with mk.precision(mode) as scope:
        model = _small()
        assert keras.config.dtype_policy().name == mk.keras_policy(mode)
    assert keras.config.dtype_policy().name == before
    dtypes = {layer.name: (layer.compute_dtype, layer.variable_dtype) for layer in model.layers}
    # The masters are Keras's own float32 variables; normalization and the head compute in
    # float32, the rest in the mode's dtype.
    assert dtypes["dense"] == (compute, "float32")
    assert dtypes["dense2"] == (compute, "float32")
    assert dtypes["ln"] == ("float32", "float32")
    assert dtypes["bn"] == ("float32", "float32")
    assert dtypes["head"] == ("float32", "float32")
    expected = {} if compute == "float32" else {model.name: ["ln", "bn", "head"]}
    assert scope.islands == expected
    out = model(np.ones((2, 8), np.float32))
    assert out.dtype == tf.float32


def test_policy_of_a_sequential_and_without_the_final_island() -> None:
    with mk.precision("bf16-mixed", final_fp32=False):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2, name="last")]
        )
    assert [layer.compute_dtype for layer in model.layers] == ["bfloat16", "bfloat16"]
    with mk.precision("bf16-mixed"):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2, name="last")]
        )
    assert [layer.compute_dtype for layer in model.layers] == ["bfloat16", "float32"]


def test_policy_is_restored_when_the_build_fails() -> None:
    before = keras.config.dtype_policy().name
    with pytest.raises(RuntimeError, match="boom"), mk.precision("bf16-mixed"):
        raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == before


def test_master_modes_and_unknown_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="no Keras dtype policy"), mk.precision("bf16-master"):
        pass
    with pytest.raises(ConfigError, match="unknown precision"):
        mk.keras_policy("fp8")


def test_wrap_optimizer_keeps_bf16_and_fp32_optimizers() -> None:
    sgd = keras.optimizers.SGD(0.1)
    assert mk.wrap_optimizer(sgd, "bf16-mixed") is sgd
    assert mk.wrap_optimizer(sgd, "fp32") is sgd
    wrapped = mk.wrap_optimizer(sgd, "fp16-mixed")
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert wrapped.initial_scale == 8192.0
    assert wrapped.dynamic_growth_steps == 2000
    assert mk.scaler_state(wrapped).scale == 8192.0


@pytest.mark.parametrize(
    "settings",
    [
        {"growth_factor": 4.0},
        {"backoff_factor": 0.25},
        {"hysteresis": 2},
        {"min_scale": 1.0},
        {"max_scale": 2.0**24},
    ],
)
def test_scaler_settings_keras_cannot_express_are_refused(settings: dict) -> None:
    with pytest.raises(ConfigError, match="LossScaleOptimizer can set init_scale") as info:
        mk.wrap_optimizer(keras.optimizers.SGD(0.1), "fp16-mixed", **settings)
    assert next(iter(settings)) in str(info.value)


def test_bad_scaler_values_and_optimizers_are_refused() -> None:
    with pytest.raises(ConfigError, match="init_scale"):
        mk.wrap_optimizer(keras.optimizers.SGD(0.1), "fp16-mixed", init_scale=0.0)
    with pytest.raises(ConfigError, match="growth_interval"):
        mk.wrap_optimizer(keras.optimizers.SGD(0.1), "fp16-mixed", growth_interval=0)
    with pytest.raises(ConfigError, match="needs a Keras optimizer"):
        mk.wrap_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), "fp16-mixed")
    inner = keras.optimizers.SGD(0.1)
    wrapped = mk.wrap_optimizer(inner, "fp16-mixed")
    with pytest.raises(ConfigError, match="inner_optimizer"):
        mk.wrap_optimizer(wrapped, "fp16-mixed")


def test_fp16_overflow_skips_the_step_halves_the_scale_and_grows_as_loss_scaler() -> None:
    """Keras's LossScaleOptimizer from wrap_optimizer and memfit's LossScaler configured
    alike see the same finite and non-finite steps and keep the same scale."""
    keras.utils.set_random_seed(0)
    with mk.precision("fp16-mixed"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    optimizer = mk.wrap_optimizer(
        keras.optimizers.SGD(0.1), "fp16-mixed", init_scale=64.0, growth_interval=3
    )
    optimizer.build(model.trainable_variables)
    scaler = memfit.precision.LossScaler(init_scale=64.0, growth_interval=3)
    weight = torch.nn.Parameter(torch.zeros(2))
    torch_opt = torch.optim.SGD([weight], lr=0.1)
    x = np.random.default_rng(0).random((16, 8), dtype=np.float32)
    y = np.zeros((16, 4), np.float32)
    bad = {2, 7}
    keras_scales, torch_scales = [], []
    for step in range(12):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(keras.losses.MeanSquaredError()(y, model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        if step in bad:  # an injected overflow in one gradient
            grads = [grads[0] * np.float32("inf")] + grads[1:]
        before = [v.numpy().copy() for v in model.trainable_variables]
        iterations = mk.scaler_state(optimizer).iterations
        optimizer.apply(grads, model.trainable_variables)
        state = mk.scaler_state(optimizer)
        unchanged = all(
            np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)
        )
        assert unchanged == (step in bad)
        assert state.iterations == iterations + (step not in bad)
        keras_scales.append(state.scale)

        torch_opt.zero_grad()
        value = weight.sum() * (float("inf") if step in bad else 1.0)
        scaler.scale(value).backward()
        scaler.step(torch_opt)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert keras_scales == torch_scales
    # halved on each overflow, doubled after three finite steps in a row
    assert keras_scales == [64, 64, 32, 32, 32, 64, 64, 32, 32, 32, 64, 64]
    assert scaler.stats.skipped == len(bad)


TORCH_BACKEND = """
import os
os.environ["KERAS_BACKEND"] = "torch"
import keras, torch, memfit, memfit.keras as mk

def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="gelu")(keras.layers.Dense(32)(inputs))
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.LayerNormalization()(x)))

g = torch.Generator().manual_seed(0)
batch = (torch.rand(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
def loss_fn(model, b):
    return torch.nn.functional.cross_entropy(model(b[0]), b[1])

model = build()
assert isinstance(model, torch.nn.Module)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine = memfit.Engine(model, opt, precision="fp32")
by_engine = [engine.train_step(batch, loss_fn) for _ in range(3)]
model = build()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
by_hand = []
for _ in range(3):
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    by_hand.append(loss.detach())
print("same", all(torch.equal(a, b) for a, b in zip(by_engine, by_hand)))
with mk.precision("bf16-mixed"):
    mixed = build()
print("dtypes", ",".join(layer.compute_dtype for layer in mixed.layers))
try:
    memfit.plan(model, (batch[0],))
except memfit.errors.PlanError as exc:
    print("plan:", exc)
try:
    mk.plan(model, batch[0].numpy(), batch[1].numpy(), "sparse_categorical_crossentropy")
except memfit.errors.ConfigError as exc:
    print("keras plan:", exc)
"""


def test_keras_on_the_torch_backend_trains_with_the_engine_and_refuses_plans_clearly() -> None:
    """Keras layers on the torch backend are torch modules whose variables sit in one
    ParameterDict: memfit.Engine trains such a model exactly as a hand loop does, the
    precision scope sets Keras's policies, and both planners say why they cannot plan."""
    out = _run(TORCH_BACKEND)
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["same"] == "True"
    # the input layer, two Dense layers in bfloat16; the LayerNorm and the head in float32
    assert lines["dtypes"] == "bfloat16,bfloat16,bfloat16,float32,float32"
    assert "Keras model on the torch backend" in lines["plan:"]
    assert "Keras runs on 'torch'" in lines["keras"]


def test_islands_of_a_sequential_built_later_and_of_a_subclassed_model() -> None:
    with mk.precision("bf16-mixed") as scope:
        seq = keras.Sequential(
            [
                keras.layers.Dense(4),
                keras.layers.LayerNormalization(name="ln"),
                keras.layers.Dense(2),
            ]
        )

        class Net(keras.Model):
            def __init__(self) -> None:
                super().__init__(name="net")
                self.a = keras.layers.Dense(4)
                self.b = keras.layers.Dense(2, name="last")

            def call(self, x: object) -> object:
                return self.b(self.a(x))

        net = Net()
    # no input shape yet: the islands are the normalization and the last layer added
    assert [layer.compute_dtype for layer in seq.layers] == ["bfloat16", "float32", "float32"]
    assert scope.islands["net"] == ["last"]
    assert (net.a.compute_dtype, net.b.compute_dtype) == ("bfloat16", "float32")
    assert seq(np.ones((2, 3), np.float32)).dtype == tf.float32
