"""TensorFlow's CPU memory statistics: the one meter of ``memfit.keras``.

The profile, the step measurement and ``MonitorCallback`` read memory through
:func:`allocator_meter` and nothing else. TensorFlow's CPU allocator counts every tensor
only when it is its BFC allocator, which ``TF_CPU_ALLOCATOR_USE_BFC=true`` selects. The
variable is read once, when TensorFlow starts: when its eager context is made (the first
tensor, variable or model), not when ``tensorflow`` is imported. Without it TensorFlow
2.21 counts only oneDNN's allocations of 256 KiB and more, or, with oneDNN off, keeps no
statistics at all; a plan made from such counts would be silently wrong.

So importing ``memfit.keras`` sets the variable while TensorFlow has not started (a value
the user set is kept), and the meter checks, once per process, that the allocator really
counts a small tensor before anything reads it. Where it does not, the meter is refused
with a :class:`memfit.errors.ConfigError` that says why and what to set. This module
imports TensorFlow only inside :func:`allocator_meter`: ``memfit.keras`` itself calls
:func:`request_counting_allocator` at import, before anything loads Keras.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from memfit.errors import ConfigError

__all__ = [
    "BFC_VARIABLE",
    "AllocatorMeter",
    "allocator_meter",
    "refusal",
    "request_counting_allocator",
    "tensorflow_started",
]

#: The environment variable that puts TensorFlow's BFC allocator on the CPU.
BFC_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"
#: The device whose allocator memfit.keras reads.
DEVICE = "CPU:0"
#: The probe's tensor: well under the 256 KiB from which oneDNN's allocator counts, so
#: only an allocator that counts every tensor sees it.
PROBE_BYTES = 16 * 1024
#: What TensorFlow reads as true (tsl's ReadBoolFromEnvVar, case-insensitive).
_TRUE = ("1", "true")

# The probe's verdict: None until it ran, then "" (counts every tensor) or what the
# allocator does instead. The allocator is fixed once TensorFlow started, so once is enough.
_verdict: str | None = None


def tensorflow_started() -> bool:
    """Whether TensorFlow's eager context exists, so its devices and their allocators are
    made and ``TF_CPU_ALLOCATOR_USE_BFC`` is no longer read. Imports nothing.

    Example::

        import tensorflow as tf
        tensorflow_started()   # False: imported, not started
        tf.constant(1.0)
        tensorflow_started()   # True
    """
    if "tensorflow" not in sys.modules:
        return False
    context = sys.modules.get("tensorflow.python.eager.context")
    made = getattr(context, "context_safe", lambda: None)()
    # The handle is set when the context is initialised (devices made). Should a future
    # TensorFlow rename it, this reads "not started": setting the variable is then harmless,
    # and the meter's probe still decides.
    return made is not None and getattr(made, "_context_handle", None) is not None


def request_counting_allocator() -> bool:
    """Set ``TF_CPU_ALLOCATOR_USE_BFC=true`` unless the user set a value, while TensorFlow
    has not started; whether TensorFlow will read the variable (it has not started yet).

    Example::

        request_counting_allocator()   # at import of memfit.keras
    """
    if tensorflow_started():
        return False
    os.environ.setdefault(BFC_VARIABLE, "true")
    return True


@dataclass(frozen=True)
class AllocatorMeter:
    """TensorFlow's CPU allocator, checked to count every tensor (made by
    :func:`allocator_meter`).

    Example::

        meter = allocator_meter("memfit.keras.measure_step")
        meter.reset_peak()
        before = meter.current()
        run_step()
        step_peak = meter.peak() - before
    """

    tf: Any
    """The ``tensorflow`` module."""

    def current(self) -> float:
        """Bytes the allocator holds now."""
        return float(self.tf.config.experimental.get_memory_info(DEVICE)["current"])

    def peak(self) -> float:
        """The most bytes it held since the last :meth:`reset_peak`."""
        return float(self.tf.config.experimental.get_memory_info(DEVICE)["peak"])

    def reset_peak(self) -> None:
        """Start a new peak from what it holds now."""
        self.tf.config.experimental.reset_memory_stats(DEVICE)


def allocator_meter(feature: str) -> AllocatorMeter:
    """The meter ``feature`` reads memory with; a ConfigError, naming ``feature``, what the
    allocator does instead and what to set, when TensorFlow's CPU allocator does not count
    every tensor. The first call runs a probe (one 16 KiB tensor).

    Example::

        meter = allocator_meter("memfit.keras.plan")
        meter.current()   # bytes TensorFlow's CPU allocator holds
    """
    # Imported here: memfit.keras imports this module before anything may load Keras.
    from memfit.keras.backend import tensorflow

    tf = tensorflow(feature)
    problem = _problem(tf)
    if problem:
        raise ConfigError(refusal(feature, problem))
    return AllocatorMeter(tf)


def refusal(feature: str, problem: str) -> str:
    """What ``feature`` says when the allocator ``problem`` (what it does instead of
    counting every tensor) leaves it nothing to measure with: the cause and the remedy.

    Example::

        refusal("memfit.keras.plan", "keeps no statistics")
    """
    value = os.environ.get(BFC_VARIABLE)
    if value is not None and value.strip().lower() not in _TRUE:
        cause = (
            f"{BFC_VARIABLE} is {value!r} in the environment, which keeps TensorFlow's BFC "
            "allocator off the CPU"
        )
    else:
        cause = (
            f"TensorFlow started (made its first tensor, variable or model) without "
            f"{BFC_VARIABLE}=true in the environment, and it reads that variable only when "
            "it starts: memfit.keras, which sets it, was imported after that"
        )
    return (
        f"{feature} cannot measure memory: TensorFlow's CPU allocator {problem}. {cause}. "
        f"With {BFC_VARIABLE}=true TensorFlow uses its BFC allocator on the CPU, which "
        f"counts every tensor. Set {BFC_VARIABLE}=true in the environment before "
        "TensorFlow starts (in the shell, or in os.environ before the first TensorFlow "
        "operation), or import memfit.keras before building a model or running any "
        "TensorFlow operation (it sets the variable then)."
    )


def _problem(tf: Any) -> str:
    """What the allocator does instead of counting every tensor; empty when it counts
    (probed once: the allocator is fixed once TensorFlow started)."""
    global _verdict
    if _verdict is None:
        _verdict = _probe(tf)
    return _verdict


def _probe(tf: Any) -> str:
    def current() -> int:
        return int(tf.config.experimental.get_memory_info(DEVICE)["current"])

    try:
        current()
    except ValueError:  # "Allocator stats not available": oneDNN off, no BFC
        return "keeps no statistics"
    # A few tries: another thread's allocation or release could move the counter between
    # two reads; an allocator that counts shows the tensor in both directions at once.
    for _ in range(3):
        with tf.device(f"/{DEVICE}"):
            before = current()
            probe = tf.fill([PROBE_BYTES // 4], 1.0)  # float32
            held = current()
            del probe
            after = current()
        if held - before >= PROBE_BYTES and held - after >= PROBE_BYTES:
            return ""
    return (
        f"does not count small tensors (a {PROBE_BYTES // 1024} KiB tensor did not show in its "
        "counter: without its BFC allocator TensorFlow counts only oneDNN's allocations of "
        "256 KiB and more)"
    )
