"""Memory sizes: "2GiB", "512MB", 0.5 (a fraction of the device's memory) or a byte count."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from memfit.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device is needed: the solvers import this
    import torch  # module and stay free of torch.

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def device_memory_bytes(device: torch.device | str | None = None) -> int:
    """Total memory of ``device``: the GPU's for CUDA, the machine's RAM for CPU."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_bytes(value: str | int | float, device: torch.device | str | None = None) -> int:
    """Turn a memory size into bytes.

    Accepts an int (bytes), a float in (0, 1] (that fraction of the device's memory), or a
    string with a decimal (kB, MB, GB) or binary (KiB, MiB, GiB) unit.

    >>> parse_bytes("2GiB")
    2147483648
    >>> parse_bytes("1.5 MB")
    1500000
    """
    if isinstance(value, bool):
        raise ConfigError(f"memory size {value!r} is a bool; give bytes, '2GiB' or a fraction")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"memory size must be positive, got {value} bytes")
        return value
    if isinstance(value, float):
        if 0 < value <= 1:
            return _at_least_one_byte(int(value * device_memory_bytes(device)), value)
        if value > 1 and value.is_integer():
            return int(value)
        raise ConfigError(
            f"memory size {value!r}: a float must be a fraction of device memory in (0, 1] "
            "or a whole number of bytes"
        )
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"cannot read memory size {value!r}: write a number and a unit such as "
                "'2GiB', '512MiB', '16GB' or '1.5e9'"
            )
        literal = match.group(1)
        number = float(literal)
        if number <= 0:
            raise ConfigError(f"memory size must be positive, got {value!r}")
        if number == float("inf"):
            raise ConfigError(f"memory size {value!r} is too large; write e.g. '2GiB'")
        if unit == "" and any(c in literal for c in ".eE"):
            # A unitless decimal means what the same float means: "0.5" and "5e-1" are
            # fractions of device memory, "1.5e9" is bytes, "1.5" is an error.
            return parse_bytes(number, device)
        return _at_least_one_byte(int(number * _UNITS[unit]), value)
    raise ConfigError(f"memory size must be a str, int or float, got {type(value).__name__}")


def check_size_text(text: str) -> str:
    """``text`` unchanged when it reads as a positive memory size (``"2GiB"``, ``"512MB"``,
    ``"1.5e9"``, or a fraction such as ``"0.5"``), else a ConfigError; checked without
    torch and without resolving a fraction against a device, so a command line can be
    checked as it is parsed (:func:`parse_bytes` gives the bytes later).

    >>> check_size_text("2GiB")
    '2GiB'
    """
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}")
    literal, unit = match.group(1), match.group(2).lower()
    number = float(literal)
    if not 0 < number < float("inf"):
        raise ConfigError(f"memory size must be positive, got {text!r}")
    if unit == "" and any(c in literal for c in ".eE") and number > 1 and not number.is_integer():
        raise ConfigError(f"memory size {text!r}: a fraction of device memory is in (0, 1]")
    return text


def _at_least_one_byte(n: int, value: object) -> int:
    if n < 1:
        raise ConfigError(f"memory size {value!r} is less than one byte; give a larger size")
    return n


def format_bytes(n: float) -> str:
    """Human-readable size with binary units: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
