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

    Each byte's ``8 // width`` codes are read as one integer word and gathered into its top byte
    by one multiply (:func:`gathered_bytes`): four passes over ``numel / (8 // width)`` words, where
    OR-ing strided columns costs ``8 // width`` strided passes."""
    per_byte = 8 // width
    codes = codes.reshape(-1)
    whole = codes.numel() // per_byte
    out = torch.empty(packed_bytes(codes.numel(), width), dtype=torch.uint8, device=codes.device)
    out[:whole] = gathered_bytes(codes[: whole * per_byte], width)
    if whole < out.numel():  # the last, partial byte: its missing codes are 0
        tail = torch.zeros(per_byte, dtype=torch.uint8, device=codes.device)
        tail[: codes.numel() - whole * per_byte] = codes[whole * per_byte :]
        out[whole:] = gathered_bytes(tail, width)
    return out


_ONE_ELEMENT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
"""The dtype whose one element is this many bytes: an integer word for :func:`gathered_bytes` (up
to 8), a table row copied as one element for :func:`gather_rows`."""


def gathered_bytes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes of ``p = 8 // width`` consecutive codes each (``codes``: uint8, each < 2**width, a
    multiple of ``p`` of them), code k of a byte at bits ``[k*width, (k+1)*width)``.

    The ``p`` codes of a byte are read as one ``p``-byte word (little-endian: code k at bit ``8k``)
    and multiplied by ``M = sum_k 2**(8(p-1) - k(8-width))``, which moves code k to bit
    ``8(p-1) + k*width`` of the top byte. Every term of the product lands code j at bit
    ``8(p-1) + 8(j-k) + k*width``, a multiple of ``width`` that no other ``(j, k)`` shares, so no
    two terms overlap and nothing carries; only ``j = k`` lands in the top byte, and the product's
    wrap modulo ``2**(8p)`` drops only bits above it. (For signs, ``width = 1``, ``M`` is
    ``0x0102040810204080``.)
    """
    per_byte = 8 // width
    if per_byte == 1:
        return codes
    if codes.storage_offset() % per_byte:  # a word view must start on a word
        codes = codes.clone()
    multiplier = sum(1 << (8 * (per_byte - 1) - k * (8 - width)) for k in range(per_byte))
    words = codes.view(_ONE_ELEMENT[per_byte])
    return ((words * multiplier) >> (8 * (per_byte - 1))).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8, each byte's ``8 // width``
    codes read from a 256-row table (:func:`gather_rows`; shifting every byte by every code's offset
    is a broadcast that CPU kernels do not vectorise, about 10x slower)."""
    used = packed[: packed_bytes(numel, width)]
    out = torch.empty(used.numel(), 8 // width, dtype=torch.uint8, device=packed.device)
    return gather_rows(_byte_codes(width, packed.device), used.int(), out).view(-1)[:numel]


def gather_rows(table: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = table[indices[i]]`` for a contiguous ``(rows, C)`` table and ``(n, C)`` ``out``;
    returns ``out``.

    Rows of 1 to 16 bytes are gathered as one element of a dtype that wide (the bits are copied,
    never computed on): a one-dimensional ``index_select`` of such elements runs about 4x faster on
    a CPU core than one copying short rows of a two-dimensional table.
    """
    wide = _ONE_ELEMENT.get(table.shape[1] * table.element_size())
    if wide is None or not out.is_contiguous() or out.storage_offset() % table.shape[1]:
        return torch.index_select(table, 0, indices, out=out)
    torch.index_select(table.view(wide).view(-1), 0, indices, out=out.view(wide).view(-1))
    return out


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element, 1 where ``values < 0`` (so 0 counts as positive), 8 per byte: the
    signs as 0/1 bytes (zero-padded to a whole byte), gathered 8 at a time by :func:`gathered_bytes`."""
    flat = values.reshape(-1)
    bits = torch.zeros(packed_bytes(flat.numel(), 1) * 8, dtype=torch.bool, device=flat.device)
    torch.lt(flat, 0, out=bits[: flat.numel()])
    return gathered_bytes(bits.view(torch.uint8), 1)


def sign_select(packed: torch.Tensor, numel: int, if_negative: torch.Tensor, if_positive: torch.Tensor) -> torch.Tensor:
    """float32 ``if_negative`` where :func:`pack_signs`'s bit is set, else ``if_positive`` (both
    one-element tensors), for the first ``numel`` elements: a look-up of each byte's eight values
    in a 256 x 8 table, one gather instead of unpacking and selecting element by element. (Rows of
    32 bytes are past :func:`gather_rows`'s widest element; splitting bytes into half-bytes to get
    16-byte rows measured slower.)"""
    table = torch.where(_byte_bits(packed.device), if_negative.float(), if_positive.float())
    return table.index_select(0, packed[: packed_bytes(numel, 1)].int()).view(-1)[:numel]


def set_bits_per_block(packed: torch.Tensor, numel: int, block: int | None) -> torch.Tensor:
    """How many of the first ``numel`` bits of ``packed`` are set in each run of ``block`` bits
    (the last run shorter; ``None``: one run of all ``numel``), as int64; bits past ``numel`` must
    be 0, as :func:`pack_signs` and :func:`pack_codes` leave them.

    Bytes are counted by a 256-entry table, a pass over ``numel / 8`` bytes instead of a compare
    over ``numel`` values; runs that are not whole bytes unpack their bits first.
    """
    used = packed[: packed_bytes(numel, 1)]
    if block is None or block % 8 == 0:
        per_byte = _byte_set_bits(packed.device).index_select(0, used.int())
        if block is None:
            return per_byte.sum().reshape(1)
        bytes_per_row = block // 8
        return torch.nn.functional.pad(per_byte, (0, -per_byte.numel() % bytes_per_row)).view(-1, bytes_per_row).sum(1)
    bits = unpack_codes(packed, 1, numel)
    return torch.count_nonzero(torch.nn.functional.pad(bits, (0, -numel % block)).view(-1, block), dim=1)


@functools.cache
def _byte_set_bits(device: torch.device) -> torch.Tensor:
    """Set bits of each byte value 0..255 (int32)."""
    return _byte_codes(1, device).sum(1, dtype=torch.int32)


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """256 x 8 bools: bit j of byte value b, little end first (the order of :func:`pack_codes`)."""
    return _byte_codes(1, device).bool()


@functools.cache
def _byte_codes(width: int, device: torch.device) -> torch.Tensor:
    """256 x ``8 // width`` uint8: the ``width``-bit codes of byte value b, little end first."""
    shifts = torch.arange(0, 8, width, device=device)
    return ((torch.arange(256, device=device).view(-1, 1) >> shifts) & ((1 << width) - 1)).to(torch.uint8)


@functools.cache
def _byte_levels(width: int, device: torch.device) -> torch.Tensor:
    """256 x ``8 // width`` float32: the signed level ``+-(code >> 1)`` (negative where the code's
    low bit is set) of each code in byte value b, little end first."""
    codes = _byte_codes(width, device).to(torch.int32)
    levels = codes >> 1
    return torch.where(codes & 1 == 1, -levels, levels).to(torch.float32)


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


def select_by_block(condition: torch.Tensor, if_true: torch.Tensor, if_false: torch.Tensor, block: int) -> torch.Tensor:
    """float32 ``if_true[i // block]`` where ``condition[i]`` (bool) holds, else ``if_false[i // block]``:
    one ``where`` over the whole blocks with each block's pair broadcast, the last, shorter block
    apart (no per-element copy of the pairs)."""
    numel = condition.numel()
    out = torch.empty(numel, dtype=torch.float32, device=condition.device)
    whole = numel // block
    rows = (whole, block)
    torch.where(
        condition[: whole * block].view(rows),
        if_true[:whole, None].float(),
        if_false[:whole, None].float(),
        out=out[: whole * block].view(rows),
    )
    if whole * block < numel:
        torch.where(
            condition[whole * block :], if_true[whole].float(), if_false[whole].float(), out=out[whole * block :]
        )
    return out


def scale_by_block_(run: torch.Tensor, per_block: torch.Tensor, block: int, start: int) -> torch.Tensor:
    """``run[i] *= per_block[(start + i) // block]`` in place, for a contiguous ``run`` that starts
    at element ``start`` (a multiple of ``block``) of blocks of ``block`` elements: each whole block
    times its entry broadcast, the last, shorter one apart. Returns ``run``."""
    whole, first = run.numel() // block, start // block
    run[: whole * block].view(whole, block).mul_(per_block[first : first + whole, None])
    if whole * block < run.numel():
        run[whole * block :].mul_(per_block[first + whole])
    return run


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
        r = scale_by_block_(x.abs(), factors.reshape(-1), chunk_size or flat.numel(), start).clamp_(max=float(levels))
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
    """Values (float32) of :func:`stochastic_quantize`'s codes: ``sign * level * (scale / levels)``.

    Each byte's ``8 // width`` signed levels are read at once from a 256-row table (no unpacking),
    then each run of ``chunk_size`` elements is multiplied by its step ``scale / levels`` in place,
    broadcast over the run (no per-element copy of the steps). Works in steps of about
    :data:`CHUNK` elements (:func:`step_length`), so the multiply reads what the gather just wrote
    from cache. The result is a view of the first ``numel`` values of a buffer of whole bytes' codes.
    """
    width = code_width(levels)
    per_byte = 8 // width
    steps = scales.to(torch.float32).reshape(-1) / levels
    table = _byte_levels(width, packed.device)
    out = torch.empty(packed_bytes(numel, width) * per_byte, dtype=torch.float32, device=packed.device)
    indices = packed[: packed_bytes(numel, width)].int()
    step = step_length(chunk_size)
    for start in range(0, numel, step):
        count = min(step, numel - start)
        first_byte = start // per_byte
        run = out[start : start + packed_bytes(count, width) * per_byte]
        gather_rows(table, indices[first_byte : first_byte + run.numel() // per_byte], run.view(-1, per_byte))
        scale_by_block_(run[:count], steps, chunk_size or numel, start)
    return out[:numel]
