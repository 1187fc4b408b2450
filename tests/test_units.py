"""Memory sizes: parse_bytes and format_bytes."""

from __future__ import annotations

import pytest

import memfit
from memfit.errors import ConfigError
from memfit.units import device_memory_bytes, format_bytes, parse_bytes

RAM = device_memory_bytes("cpu")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("512MiB", 512 * 1024**2),
        ("1.5 MB", 1_500_000),
        ("16GB", 16 * 1000**3),
        ("1TiB", 1024**4),
        ("3KiB", 3 * 1024),
        ("2kb", 2000),
        ("2gib", 2 * 1024**3),
        ("  64 B ", 64),
        ("1.5e9", 1_500_000_000),
        ("1e3", 1000),
        ("4096", 4096),
        ("0.5GiB", 1024**3 // 2),
        ("2G", 2 * 1000**3),
    ],
)
def test_parse_strings(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


def test_parse_ints_are_bytes() -> None:
    assert parse_bytes(1) == 1
    assert parse_bytes(123_456_789) == 123_456_789
    assert parse_bytes(2.0**31) == 2**31  # a whole-number float is a byte count


@pytest.mark.parametrize("fraction", [0.5, 0.25, 1.0])
def test_parse_fractions_of_device_memory(fraction: float) -> None:
    assert parse_bytes(fraction, "cpu") == int(fraction * RAM)
    # The same fraction written as a unitless string means the same thing.
    assert parse_bytes(repr(fraction), "cpu") == int(fraction * RAM)


def test_unitless_exponent_fraction_is_a_fraction() -> None:
    # "5e-1" is the number 0.5, written differently: a fraction, not 0 bytes.
    assert parse_bytes("5e-1", "cpu") == int(0.5 * RAM)


def test_public_reexport() -> None:
    # Demoted from the top level: kept for one release, with a warning naming the module.
    with pytest.warns(DeprecationWarning, match=r"memfit\.units\.parse_bytes"):
        assert memfit.parse_bytes is parse_bytes
    with pytest.warns(DeprecationWarning, match=r"memfit\.units\.format_bytes"):
        assert memfit.format_bytes is format_bytes


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "GiB",
        "two GiB",
        "2 GiBs",
        "2XB",
        "2 Gi B",
        "-1GiB",
        "1,5GB",
        "0GiB",
        "0",
        "2GiB!",
        "1e400",
        "1e400GB",
    ],
)
def test_bad_strings_raise_with_a_helpful_message(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes(bad)
    message = str(info.value)
    assert repr(bad) in message or "positive" in message
    if "positive" not in message and "too large" not in message:
        # Says what a valid size looks like.
        assert "2GiB" in message


@pytest.mark.parametrize("bad", [0, -5, 0.0, -0.5, 1.5, 2.7, float("nan"), float("inf")])
def test_bad_numbers_raise(bad: float) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [True, False, None, [1], b"2GiB"])
def test_bad_types_raise(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes(bad)  # type: ignore[arg-type]
    assert "bool" in str(info.value) or "must be" in str(info.value)


@pytest.mark.parametrize("bad", ["0.4B", "0.5B", "1.5", "2.5e0"])
def test_sizes_that_are_not_a_positive_whole_number_of_bytes_raise(bad: str) -> None:
    # "0.4B" would round to 0 bytes; "1.5" is a fractional byte count (as the float 1.5 is).
    with pytest.raises(ConfigError):
        parse_bytes(bad)


def test_a_fraction_too_small_to_be_a_byte_raises() -> None:
    with pytest.raises(ConfigError):
        parse_bytes(1e-30, "cpu")


def test_device_memory_of_cpu_is_positive() -> None:
    assert RAM > 0
    assert device_memory_bytes() > 0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (2 * 1024**3, "2.00 GiB"),
        (5 * 1024**4, "5.00 TiB"),
        (3 * 1024**5, "3072.00 TiB"),
        (-2048, "-2.00 KiB"),
        (-5, "-5 B"),
        (1.5 * 2**20, "1.50 MiB"),
    ],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("text", ["1.00 KiB", "2.00 GiB", "3.00 MiB", "7 B"])
def test_format_then_parse_round_trips(text: str) -> None:
    n = parse_bytes(text.replace(" ", ""))
    assert format_bytes(n) == text
