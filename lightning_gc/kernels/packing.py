"""Bit packing and stochastic quantisation (QSGD, TernGrad), in torch; Triton twin: :mod:`.packing_triton`.

Codes of ``width`` bits (1, 2, 4 or 8) are packed little-end first, ``8 // width`` to a byte: code
``j`` of byte ``b`` sits at bits ``[j*width, (j+1)*width)``; the tail is zero-padded. Signs are
1-bit codes, 1 where ``x < 0``. Stochastic quantisation rounds ``r = |x| / scale * levels``
(clamped to ``levels``) to an integer level without bias::

    level = floor(r) + [uniform < r - floor(r)]       uniform = rng.counter_uniform(seed, i)
    code  = (level << 1) | (x < 0)                     at code_width(levels) bits
    x'    = sign * level / levels * scale              (stochastic_dequantize; E[x'] = x)

so the result is reproducible from ``seed``. ``scale`` is one per tensor or one per ``chunk_size``
consecutive elements; QSGD uses the chunk's ``||x||_2``, TernGrad ``levels = 1`` with ``max |x|``.
"""

from __future__ import annotations

import functools
import math

import torch

from lightning_gc.kernels.rng import counter_uniform

CODE_WIDTHS = (1, 2, 4, 8)
CHUNK = 1 << 18
"""Elements per step of the chunked torch quantiser (a multiple of 8, so chunks start on bytes)."""


def code_width(levels: int) -> int:
    """Bits per code ``(level << 1) | negative`` for ``levels`` quantisation levels (a power of 2)."""
    needed = 1 + int(levels).bit_length()
    for width in CODE_WIDTHS[1:]:
        if width >= needed:
            return width
    raise ValueError(f"`levels` must be in [1, 127] to fit 8-bit codes, got {levels!r}")


def packed_bytes(numel: int, width: int) -> int:
    return -(-numel * width // 8)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``width``-bit codes (uint8, each < 2**width) little-end first: code j of byte b sits
    at bits ``[j*width, (j+1)*width)`` of byte b. The tail is zero-padded.

    Byte-wide work only: OR-ing the ``8 // width`` strided columns of the codes, shifted, into the
    output costs ``8 // width`` passes over ``numel / (8 // width)`` bytes (sign bits have a faster,
    fused path: :func:`pack_signs`)."""
    per_byte = 8 // width
    codes = codes.reshape(-1)
    out = torch.zeros(packed_bytes(codes.numel(), width), dtype=torch.uint8, device=codes.device)
    whole = codes.numel() // per_byte
    columns = codes[: whole * per_byte].view(whole, per_byte)
    body = out[:whole]
    for j in range(per_byte):
        body |= columns[:, j] << (j * width)
    for j, code in enumerate(codes[whole * per_byte :]):  # the last, partial byte
        out[whole] |= code << (j * width)
    return out


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8 (byte-wide shifts)."""
    shifts = torch.arange(0, 8, width, device=packed.device, dtype=torch.uint8)
    used = packed[: packed_bytes(numel, width)].view(-1, 1)
    return ((used >> shifts) & ((1 << width) - 1)).view(-1)[:numel]


GATHER_BITS = 0x0102040810204080
"""Multiplier that moves the low bit of each of an int64's 8 bytes into its top byte, byte ``j``'s
to bit ``56 + j``: byte j's bit lands at ``8j + 56 - 7k`` for the multiplier's term ``k``, which is
``56 + j`` only for ``k = j``, and all 64 landing places differ, so no carries (the product wraps
mod 2**64, which keeps the top byte)."""


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element, 1 where ``values < 0`` (so 0 counts as positive), 8 per byte: the
    signs as 0/1 bytes, 8 to an int64, gathered into one byte by a multiply (:data:`GATHER_BITS`)."""
    flat = values.reshape(-1)
    bits = torch.zeros(packed_bytes(flat.numel(), 1) * 8, dtype=torch.bool, device=flat.device)
    torch.lt(flat, 0, out=bits[: flat.numel()])
    words = bits.view(torch.uint8).view(torch.int64)
    return ((words * GATHER_BITS) >> 56).to(torch.uint8)


def sign_select(packed: torch.Tensor, numel: int, if_negative: torch.Tensor, if_positive: torch.Tensor) -> torch.Tensor:
    """float32 ``if_negative`` where :func:`pack_signs`'s bit is set, else ``if_positive`` (both
    one-element tensors), for the first ``numel`` elements: a look-up of each byte's eight values
    in a 256 x 8 table, one gather instead of unpacking and selecting element by element."""
    table = torch.where(_byte_bits(packed.device), if_negative.float(), if_positive.float())
    return table.index_select(0, packed[: packed_bytes(numel, 1)].int()).view(-1)[:numel]


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """256 x 8 bools: bit j of byte value b, little end first (the order of :func:`pack_codes`)."""
    return ((torch.arange(256, device=device).view(-1, 1) >> torch.arange(8, device=device)) & 1).bool()


def quantize_factor(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """``levels / scales`` as float32 (0 where a scale is 0), computed once so both implementations
    multiply by the same correctly rounded factors (GPU division may be approximate)."""
    scales = scales.to(torch.float32)
    positive = scales > 0
    safe = torch.where(positive, scales, torch.ones_like(scales))
    return torch.where(positive, levels / safe, torch.zeros_like(scales))


def step_length(chunk_size: int | None) -> int:
    """Elements per step of the chunked loops below: about :data:`CHUNK`, a multiple of 8 (a step's
    packed codes start on a byte) and of ``chunk_size`` (its scales start on a block)."""
    unit = 8 if chunk_size is None else math.lcm(8, chunk_size)
    return unit * max(1, CHUNK // unit)


def per_element(per_block: torch.Tensor, chunk_size: int | None, start: int, count: int) -> torch.Tensor:
    """Each of elements ``start .. start + count``'s entry of ``per_block``: entry ``i // chunk_size``
    (``start`` a multiple of ``chunk_size``), or the single entry (broadcast) when ``chunk_size`` is ``None``."""
    if chunk_size is None:
        return per_block.reshape(1)
    first = start // chunk_size
    return per_block[first : first - (-count // chunk_size)].repeat_interleave(chunk_size)[:count]


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Unbiased stochastic rounding of ``|values| / scale * levels`` to an integer level, packed.

    ``level = floor(r) + [uniform < r - floor(r)]`` with ``r = |x| / scale * levels`` (clamped to
    ``levels``) and the uniform drawn by :func:`counter_uniform` at offset = element index, so
    ``E[sign * level / levels * scale] = x`` and the result is reproducible. ``scales`` holds one
    scale for the whole tensor (``chunk_size=None``) or one per ``chunk_size`` consecutive elements.
    QSGD uses ``scale = ||x||_2`` of the chunk; TernGrad is ``levels = 1`` with ``scale = max |x|``.
    Codes are ``(level << 1) | negative`` at :func:`code_width` bits.

    Works in steps of about :data:`CHUNK` elements (:func:`step_length`): the temporaries then stay
    cache-sized instead of gradient-sized buffers that each fault their pages in again; integer work
    is byte-wide (codes fit 8 bits).
    """
    width = code_width(levels)
    factors = quantize_factor(scales, levels)
    flat = values.reshape(-1)
    out = torch.empty(packed_bytes(flat.numel(), width), dtype=torch.uint8, device=flat.device)
    per_byte = 8 // width
    step = step_length(chunk_size)
    for start in range(0, flat.numel(), step):
        x = flat[start : start + step].to(torch.float32)
        r = torch.clamp(x.abs() * per_element(factors, chunk_size, start, x.numel()), max=float(levels))
        floor = torch.floor(r)
        uniform = counter_uniform(seed, torch.arange(start, start + x.numel(), device=x.device))
        codes = floor.to(torch.uint8).add_(uniform < r.sub_(floor))  # the level
        codes <<= 1
        codes |= x < 0
        out[start // per_byte : start // per_byte + packed_bytes(x.numel(), width)] = pack_codes(codes, width)
    return out


def stochastic_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, levels: int, numel: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Values (float32) of :func:`stochastic_quantize`'s codes: ``sign * level / levels * scale``
    (each code's ``sign * level`` looked up in a table of the ``2**width`` codes)."""
    width = code_width(levels)
    steps = scales.to(torch.float32).reshape(-1) / levels
    codes = torch.arange(1 << width, device=packed.device)
    signed_levels = torch.where(codes & 1 == 1, -(codes >> 1), codes >> 1).to(torch.float32)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    unpacked = unpack_codes(packed, width, numel)
    step = step_length(chunk_size)
    for start in range(0, numel, step):
        chunk = signed_levels.index_select(0, unpacked[start : start + step].int())
        torch.mul(chunk, per_element(steps, chunk_size, start, chunk.numel()), out=out[start : start + chunk.numel()])
    return out
