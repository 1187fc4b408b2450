"""How low-bit optimizer state is coded: blockwise 8-bit logarithmic codes, or bf16 bits.

A kept moment is one of:

* **8-bit**: ``{"codes": int8 or uint8 [padded numel], "scale": int32 [blocks]}``. The
  flattened tensor is cut into blocks of :data:`BLOCK` elements; a block's scale is its
  largest magnitude (fp32, stored as its bits in an int32 tensor: ``load_state_dict``
  casts floating-point state to the parameter's dtype, which would round it for a 16-bit
  parameter). An element is a code on a logarithmic scale below the scale: unsigned
  codes (a second moment, never negative) 1..255 over :data:`SECOND_MOMENT_OCTAVES`
  octaves, signed ones (a first moment, momentum) ±1..127 over
  :data:`FIRST_MOMENT_OCTAVES`; code 0 is 0.
* **bf16**: an int16 tensor holding the bfloat16 bits (for the same reason).

Values are stored with **stochastic rounding** between the two nearest codes (or bf16
numbers), drawn from a given generator: unbiased, so a moment that moves by less than a
code's width a step (Adam's second moment with ``beta2=0.999``) still moves on average.

A parameter is coded in pieces of at most :data:`CHUNK` elements (:func:`read`,
:func:`write`), so the temporaries of a step are bounded whatever the parameter's size.

Example::

    kept = empty_like_state(torch.zeros(1000), "8bit", signed=True)
    write(kept, "8bit", 0, torch.randn(1000), generator)
    read(kept, "8bit", 0, 1000)   # close to what was written
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "BLOCK",
    "CHUNK",
    "FIRST_MOMENT_OCTAVES",
    "SECOND_MOMENT_OCTAVES",
    "dequantize",
    "empty_like_state",
    "quantize",
    "read",
    "write",
]

BLOCK = 256
"""Elements per block of 8-bit state, each block with its own fp32 scale."""
CHUNK = BLOCK * 4096
"""The most elements of one parameter coded at once (a multiple of :data:`BLOCK`)."""
SECOND_MOMENT_OCTAVES = 40
"""The 8-bit second moment's range below its block's largest value: 2**-40 (255 levels)."""
FIRST_MOMENT_OCTAVES = 20
"""The 8-bit first moment's (and momentum's) range below its block's largest magnitude:
2**-20 (127 levels each side of 0)."""


def _levels(count: int, octaves: int) -> torch.Tensor:
    """The magnitudes of codes 0..count: 0, then ``count`` levels from 2**-octaves to 1."""
    exponents = torch.linspace(-float(octaves), 0.0, count, dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp2(exponents)]).float()


# Unsigned codes 0..255 for the second moment, magnitudes 0..127 for signed ones.
_UNSIGNED = _levels(255, SECOND_MOMENT_OCTAVES)
_SIGNED = _levels(127, FIRST_MOMENT_OCTAVES)


def _padded(numel: int) -> int:
    return -(-numel // BLOCK) * BLOCK


def quantize(x: torch.Tensor, signed: bool, generator: torch.Generator | None) -> dict[str, Any]:
    """``x`` (fp32) as 8-bit codes and one scale per block, rounded stochastically between
    the two nearest levels (to the nearest without a ``generator``).

    Example::

        q = quantize(torch.randn(1000), signed=True, generator=None)
        dequantize(q, (1000,))   # close to the input, within one level
    """
    flat = x.reshape(-1).float()
    pad = _padded(flat.numel()) - flat.numel()
    blocks = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    negative = blocks < 0 if signed else None
    unit = blocks.abs().div_(torch.where(scale > 0, scale, torch.ones_like(scale)))
    levels = (_SIGNED if signed else _UNSIGNED).to(x.device)
    top = levels.numel() - 1
    octaves = FIRST_MOMENT_OCTAVES if signed else SECOND_MOMENT_OCTAVES
    # The level at or below each value, from its logarithm (float codes: no int64 index
    # tensors, which would be the step's largest temporaries), then corrected by one where
    # the logarithm's rounding missed.
    low = torch.log2(unit.clamp_min(2.0**-octaves)).add_(octaves).mul_((top - 1) / octaves)
    low = low.add_(1).floor_().clamp_(1, top)
    low = torch.where(unit < levels[low.int()], low - 1, low)
    up_one = (low + 1).clamp_(max=top)
    low = torch.where(unit >= levels[up_one.int()], up_one, low)
    del up_one
    low = torch.where(unit < levels[1], torch.zeros_like(low), low)
    high = (low + 1).clamp_(max=top)
    below = levels[low.int()]
    fraction = (unit - below).div_((levels[high.int()] - below).clamp_(min=1e-38)).clamp_(0, 1)
    del below, unit
    if generator is None:
        code = torch.where(fraction >= 0.5, high, low)
    else:
        draw = torch.rand(fraction.shape, generator=generator, device=x.device)
        code = torch.where(draw < fraction, high, low)
    del fraction, high, low
    if signed:
        code = torch.where(negative, -code, code).to(torch.int8)
    else:
        code = code.to(torch.uint8)
    return {"codes": code.reshape(-1), "scale": scale.reshape(-1).view(torch.int32)}


def dequantize(q: dict[str, Any], shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that :func:`quantize`'s codes and scales stand for."""
    codes = q["codes"]
    signed = codes.dtype == torch.int8
    levels = (_SIGNED if signed else _UNSIGNED).to(codes.device)
    values = levels[codes.abs().int() if signed else codes.int()]
    if signed:
        values = torch.where(codes < 0, -values, values)
    values = values.view(-1, BLOCK).mul_(q["scale"].view(torch.float32).view(-1, 1))
    numel = 1
    for n in shape:
        numel *= n
    return values.reshape(-1)[:numel].reshape(shape)


def round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) in bfloat16, rounded stochastically (random bits added below bf16's
    mantissa before the low 16 bits are cut), as its bits in an int16 tensor."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32
    )
    cut = (bits + noise) & ~0xFFFF
    # Inf and NaN keep their bits (adding noise could turn an inf into a NaN).
    cut = torch.where(torch.isfinite(x), cut, bits & ~0xFFFF)
    return cut.view(torch.float32).to(torch.bfloat16).view(torch.int16)


def empty_like_state(p: torch.Tensor, bits: str, signed: bool) -> Any:
    """A kept moment for parameter ``p`` holding zeros."""
    if bits == "8bit":
        dtype = torch.int8 if signed else torch.uint8
        padded = _padded(p.numel())
        return {
            "codes": torch.zeros(padded, dtype=dtype, device=p.device),
            "scale": torch.zeros(padded // BLOCK, dtype=torch.int32, device=p.device),
        }
    return torch.zeros(p.numel(), dtype=torch.int16, device=p.device)


def is_kept(value: Any) -> bool:
    """Whether ``value`` is a moment kept in low bits (not an fp32 tensor)."""
    return (isinstance(value, dict) and "codes" in value) or (
        isinstance(value, torch.Tensor) and value.dtype == torch.int16
    )


def bits_of(value: Any) -> str:
    """``"8bit"`` or ``"bf16"``: how a kept moment is coded."""
    return "8bit" if isinstance(value, dict) else "bf16"


def read(kept: Any, bits: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a kept moment in fp32 (``start`` a multiple of BLOCK)."""
    if bits == "8bit":
        end = min(_padded(stop), kept["codes"].numel())
        part = {
            "codes": kept["codes"][start:end],
            "scale": kept["scale"][start // BLOCK : end // BLOCK],
        }
        return dequantize(part, (stop - start,))
    return kept[start:stop].view(torch.bfloat16).float()


def write(
    kept: Any, bits: str, start: int, values: torch.Tensor, generator: torch.Generator
) -> None:
    """Store fp32 ``values`` as elements ``start:`` of a kept moment (``start`` a
    multiple of BLOCK), rounded stochastically."""
    if bits == "8bit":
        q = quantize(values, kept["codes"].dtype == torch.int8, generator)
        n = q["codes"].numel()
        kept["codes"][start : start + n] = q["codes"]
        kept["scale"][start // BLOCK : (start + n) // BLOCK] = q["scale"]
        return
    kept[start : start + values.numel()] = round_bf16(values, generator)


def pieces(numel: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` pieces a parameter of ``numel`` elements is coded in."""
    return [(a, min(a + CHUNK, numel)) for a in range(0, numel, CHUNK)]
