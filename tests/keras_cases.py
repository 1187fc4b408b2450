"""Tiny Keras models and helpers for the memfit.keras tests (TensorFlow backend, CPU)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:  # one thread: tiny models, and two test workers share the machine
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
except RuntimeError:  # TensorFlow already started in this process
    pass

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(n: int = 6, width: int = 256, dropout: float = 0.0, name: str = "mlp") -> keras.Model:
    """A Functional chain: Dense layers, an optional dropout in the middle, a LayerNorm
    and a 10-way head."""
    inputs = keras.Input((64,), name="features")
    x = keras.layers.Dense(width, activation="relu", name="inp")(inputs)
    for k in range(n):
        x = keras.layers.Dense(width, activation="gelu", name=f"d{k}")(x)
        if dropout and k == n // 2:
            x = keras.layers.Dropout(dropout, name="drop")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    outputs = keras.layers.Dense(10, name="head")(x)
    return keras.Model(inputs, outputs, name=name)


def residual(width: int = 32) -> keras.Model:
    """A Functional graph that is not a chain: two residual adds."""
    inputs = keras.Input((16,))
    h = keras.layers.Dense(width, name="up")(inputs)
    a = keras.layers.Dense(width, activation="relu", name="a")(h)
    h = h + a
    b = keras.layers.Dense(width, activation="relu", name="b")(h)
    h = h + b
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs, name="residual")


def batch(n: int = 512, features: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, features), dtype=np.float32), rng.integers(0, 10, n)


def gradients(model: keras.Model, x: Any, y: Any, compiled: bool = False) -> list[np.ndarray]:
    """The loss's gradients for the model's trainable variables (eager or tf.function)."""

    def step(x: Any, y: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    if not compiled:
        return [g.numpy() for g in step(tf.constant(x), tf.constant(y))]
    # Grappler's remapper fuses MatMul + BiasAdd + activation, and a remat boundary changes
    # what it fuses: the results then differ by rounding (2.4e-7 measured). Without it the
    # graph runs the same kernels as eager.
    options = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        return [g.numpy() for g in tf.function(step)(tf.constant(x), tf.constant(y))]
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": options.get("remapping", True)})
