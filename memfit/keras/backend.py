"""TensorFlow and Keras for ``memfit.keras``, imported here only, with the extra named when
they are missing.

``memfit`` itself never imports TensorFlow: the modules of ``memfit.keras`` import this one,
and ``memfit.keras`` imports them on first use.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from memfit.errors import ConfigError

#: The extra that installs what memfit.keras needs.
EXTRA = "keras"
INSTALL = f"pip install 'memfit[{EXTRA}]'"

if importlib.util.find_spec("keras") is None:
    raise ConfigError(
        f"memfit.keras needs Keras 3 and TensorFlow, not installed here; install memfit's "
        f"'{EXTRA}' extra: {INSTALL}"
    )

# Importing Keras imports TensorFlow without starting it; the package's import already set
# TF_CPU_ALLOCATOR_USE_BFC where it still can take effect (memfit.keras.memory).
import keras  # noqa: E402

#: The oldest Keras memfit.keras runs on (keras.remat, the plans' executor, arrived in 3.9).
MIN_KERAS = (3, 9)


def _release(text: str) -> tuple[int, ...]:
    """``"3.9.0"`` -> ``(3, 9, 0)``; a part that is not a number ends the tuple."""
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


if _release(keras.__version__) < MIN_KERAS:
    raise ConfigError(
        f"memfit.keras needs Keras {'.'.join(map(str, MIN_KERAS))} or newer, found keras "
        f"{keras.__version__}; upgrade it: {INSTALL}"
    )


def tensorflow(feature: str) -> Any:
    """The ``tensorflow`` module, for what needs Keras on its TensorFlow backend.

    Raises a ConfigError naming ``feature`` when Keras runs on another backend (set with
    ``KERAS_BACKEND`` before Keras is imported) or TensorFlow is not installed.

    Example::

        tf = tensorflow("memfit.keras.plan")
    """
    name = keras.backend.backend()
    if name != "tensorflow":
        hint = (
            " On the torch backend Keras layers are torch modules: plan and train them with "
            "memfit's PyTorch path (memfit.plan, memfit.Engine; docs/keras.md says what works)."
            if name == "torch"
            else ""
        )
        raise ConfigError(
            f"{feature} needs Keras on its TensorFlow backend, but Keras runs on {name!r} "
            f"(KERAS_BACKEND). Set KERAS_BACKEND=tensorflow before Keras is imported.{hint}"
        )
    if importlib.util.find_spec("tensorflow") is None:
        raise ConfigError(f"{feature} needs TensorFlow, not installed here: {INSTALL}")
    import tensorflow as tf

    return tf
