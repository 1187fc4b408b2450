"""The checks the built-in models' configs share: sizes that must be positive ints, and a
dropout probability in [0, 1). Each error names the config class and the field.

Example::

    check_positive_ints(GPTConfig(n_layer=0), ("n_layer",))
    # ConfigError: GPTConfig.n_layer must be a positive int, got 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfit.errors import ConfigError


def check_positive_ints(config: Any, names: Sequence[str]) -> None:
    """Raise a ConfigError for the first field of ``names`` on ``config`` that is not a
    positive int.

    Example::

        check_positive_ints(LSTMConfig(), ("n_layer", "hidden_size"))   # passes
    """
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{type(config).__name__}.{name} must be a positive int, got {value!r}"
            )


def check_dropout(config: Any) -> None:
    """Raise a ConfigError when ``config.dropout`` is not in [0, 1).

    Example::

        check_dropout(GPTConfig(dropout=0.1))   # passes
    """
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(
            f"{type(config).__name__}.dropout must be in [0, 1), got {config.dropout}"
        )
