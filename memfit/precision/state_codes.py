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
* **fp32**: torch's own moment, a tensor of the parameter's shape (kept by memfit's step
  when it also rounds 16-bit weights: :func:`round_weight`).

Values are stored with **stochastic rounding** between the two nearest codes (or bf16
numbers), with uniform draws the caller gives (one draw serves every moment of a piece:
random numbers are the slowest part of a CPU step): unbiased, so a moment that moves by less than a
code's width a step (Adam's second moment with ``beta2=0.999``) still moves on average.

A parameter is coded in pieces of at most :data:`CHUNK` elements (:func:`read`,
:func:`write`), so the temporaries of a step are bounded whatever the parameter's size.

Example::

    kept = empty_like_state(torch.zeros(1000), "8bit", signed=True)
    write(kept, "8bit", 0, torch.randn(1000), torch.rand(draws(1000)))
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
    "blocks_of",
    "dequantize",
    "draws",
    "empty_like_state",
    "quantize",
    "read",
    "round_weight",
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


def _step(signed: bool) -> tuple[float, int, int]:
    """(octaves, the top code, octaves per code) of a signed or unsigned code."""
    octaves = FIRST_MOMENT_OCTAVES if signed else SECOND_MOMENT_OCTAVES
    top = 127 if signed else 255
    return float(octaves), top, octaves / (top - 1)


def _level(code: torch.Tensor, signed: bool) -> torch.Tensor:
    """The magnitude (of 1, the block's scale) that codes 0..top stand for: 0, then
    ``2 ** ((code - 1) * per - octaves)``. Computed, not looked up: a gather from a table
    is the slowest op of a CPU step."""
    octaves, _, per = _step(signed)
    magnitude = torch.exp2(code.float().sub(1).mul_(per).sub_(octaves))
    return magnitude.masked_fill_(code == 0, 0.0)


def _padded(numel: int) -> int:
    return -(-numel // BLOCK) * BLOCK


def blocks_of(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x`` flattened in fp32 and padded with zeros to whole blocks of ``block``
    elements, one block a row.

    >>> blocks_of(torch.ones(3), block=4)
    tensor([[1., 1., 1., 0.]])
    """
    flat = x.reshape(-1).float()
    pad = -flat.numel() % block
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, block)


def quantize(x: torch.Tensor, signed: bool, draw: torch.Tensor | None) -> dict[str, Any]:
    """``x`` (fp32) as 8-bit codes and one scale per block, rounded stochastically between
    the two nearest levels with ``draw`` (uniform in [0, 1), at least :func:`draws` of
    ``x``'s size), to the nearest without.

    Example::

        q = quantize(torch.randn(1000), signed=True, draw=None)
        dequantize(q, (1000,))   # close to the input, within one level
    """
    blocks = blocks_of(x)
    unit = blocks.abs()
    scale = unit.amax(dim=1, keepdim=True)
    unit = unit.div_(torch.where(scale > 0, scale, torch.ones_like(scale)))
    octaves, top, per = _step(signed)
    # Each value's place on the codes' scale, continuous: code - 1 (code 1 is 2**-octaves,
    # the top code the block's scale). Two neighbouring levels are 2**per apart, so the
    # linear fraction of the way from the lower to the upper is (2**(per*f) - 1) /
    # (2**per - 1), f the fractional part of the place: no level is looked up or computed.
    place = torch.log2(unit).add_(octaves).div_(per)
    low = place.floor()
    fraction = place.sub_(low).mul_(per).exp2_().sub_(1.0).div_(2.0**per - 1.0)
    # Below code 1, between 0 (code 0) and code 1's level: linear.
    below = low < 0
    fraction = torch.where(below, unit.mul_(2.0**octaves), fraction)
    del place, unit
    low = low.clamp_(min=-1.0).add_(1.0)  # the lower code: 0 for 0 and tiny values
    if draw is None:
        up = fraction >= 0.5
    else:
        up = draw[: fraction.numel()].view(fraction.shape) < fraction
    code = low.add_(up).clamp_(max=top)
    del fraction, up, below
    if signed:
        code = code.mul_(blocks.sign()).to(torch.int8)
    else:
        code = code.to(torch.uint8)
    return {"codes": code.reshape(-1), "scale": scale.reshape(-1).view(torch.int32)}


def dequantize(q: dict[str, Any], shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that :func:`quantize`'s codes and scales stand for."""
    codes = q["codes"]
    signed = codes.dtype == torch.int8
    values = _level(codes.abs() if signed else codes, signed)
    if signed:
        values = values.mul_(codes.sign())
    values = values.view(-1, BLOCK).mul_(q["scale"].view(torch.float32).view(-1, 1))
    numel = 1
    for n in shape:
        numel *= n
    return values.reshape(-1)[:numel].reshape(shape)


def _rounded(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) in bfloat16: ``noise`` (16 random bits, int32) added below bf16's
    mantissa before the low 16 bits are cut, which rounds up with the probability of the
    cut part; an update smaller than the last bit is kept on average."""
    flat = x.float().contiguous().reshape(-1)
    bits = flat.view(torch.int32)
    cut = (bits + noise).bitwise_and_(~0xFFFF)
    # Inf and NaN keep their bits (adding noise could turn an inf into a NaN).
    cut = torch.where(torch.isfinite(flat), cut, bits & ~0xFFFF)
    return cut.view(torch.float32).to(torch.bfloat16)


def round_bf16(x: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, flat) in bfloat16, rounded stochastically with the high 16 bits of
    ``draw`` (uniform in [0, 1)), as its bits in an int16 tensor."""
    noise = draw[: x.numel()].mul(65536.0).to(torch.int32)
    return _rounded(x, noise).view(torch.int16)


def round_weight(x: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) as a bfloat16 tensor of its shape, rounded stochastically (Gupta et
    al., "Deep Learning with Limited Numerical Precision", 2015). The 16 random bits are
    the low ones of ``draw``'s 24 (a moment's rounding uses the high ones), so one draw
    serves a piece's weights and moments.

    Example::

        w = round_weight(torch.full((4,), 1.0 + 2**-10), torch.rand(draws(4)))
        w.dtype   # torch.bfloat16; each element is 1.0 or 1.0078125
    """
    noise = draw[: x.numel()].mul(16777216.0).to(torch.int32).bitwise_and_(0xFFFF)
    return _rounded(x, noise).view(x.shape)


def empty_like_state(p: torch.Tensor, bits: str, signed: bool) -> Any:
    """A kept moment for parameter ``p`` holding zeros."""
    if bits == "fp32":
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
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
    """Elements ``start:stop`` of a kept moment in fp32 (``start`` a multiple of BLOCK);
    for ``"fp32"``, a view that updates it in place."""
    if bits == "fp32":
        return kept.view(-1)[start:stop]
    if bits == "8bit":
        end = min(_padded(stop), kept["codes"].numel())
        part = {
            "codes": kept["codes"][start:end],
            "scale": kept["scale"][start // BLOCK : end // BLOCK],
        }
        return dequantize(part, (stop - start,))
    return kept[start:stop].view(torch.bfloat16).float()


def draws(numel: int) -> int:
    """How many uniform draws :func:`write` takes for ``numel`` values (whole blocks)."""
    return _padded(numel)


def write(kept: Any, bits: str, start: int, values: torch.Tensor, draw: torch.Tensor) -> None:
    """Store fp32 ``values`` as elements ``start:`` of a kept moment (``start`` a
    multiple of BLOCK), rounded stochastically with ``draw`` (:func:`draws` of them)."""
    if bits == "fp32":
        target = kept.view(-1)[start : start + values.numel()]
        if target.data_ptr() != values.data_ptr():  # read() gave a view, updated in place
            target.copy_(values)
        return
    if bits == "8bit":
        q = quantize(values, kept["codes"].dtype == torch.int8, draw)
        n = q["codes"].numel()
        kept["codes"][start : start + n] = q["codes"]
        kept["scale"][start // BLOCK : (start + n) // BLOCK] = q["scale"]
        return
    kept[start : start + values.numel()] = round_bf16(values, draw)


def pieces(numel: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` pieces a parameter of ``numel`` elements is coded in."""
    return [(a, min(a + CHUNK, numel)) for a in range(0, numel, CHUNK)]
