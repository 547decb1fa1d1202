"""Triton twin of :mod:`.packing`: each program owns :data:`PACK_BLOCK` output bytes.

A program loads the ``[PACK_BLOCK, 8 // width]`` codes of its bytes and sums them shifted into
place; the quantiser computes its codes (with :func:`.rng_triton.counter_uniform`) and packs them
in the same pass, without a code buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import items_left, launch, program_block
from lightning_gc.kernels.packing import code_width, packed_bytes, quantize_factor
from lightning_gc.kernels.rng import seed_key
from lightning_gc.kernels.rng_triton import counter_uniform

PACK_BLOCK = 256


@triton.jit
def _pack_tile(codes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr):
    # codes: [PACK_BLOCK, PER_BYTE] int32 -> [PACK_BLOCK] bytes, code j at bits [j*WIDTH, (j+1)*WIDTH).
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, :]
    return tl.sum(codes << shifts, axis=1).to(tl.uint8)


@triton.jit
def _pack_codes_kernel(
    codes_ptr, out_ptr, numel, n_bytes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr
):
    base, byte, inside = program_block(n_bytes, BLOCK)
    first = base * PER_BYTE  # this program's first element; offsets below are relative to it
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    in_range = element < items_left(numel, first, BLOCK * PER_BYTE)
    codes = tl.load(codes_ptr + first + element, mask=in_range, other=0).to(tl.int32)
    tl.store(out_ptr + base + byte, _pack_tile(codes, WIDTH, PER_BYTE), mask=inside)


@triton.jit
def _unpack_codes_kernel(
    packed_ptr, out_ptr, numel, n_bytes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr
):
    base, byte, inside = program_block(n_bytes, BLOCK)
    packed = tl.load(packed_ptr + base + byte, mask=inside, other=0).to(tl.int32)
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, :]
    codes = (packed[:, None] >> shifts) & ((1 << WIDTH) - 1)
    first = base * PER_BYTE
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    tl.store(out_ptr + first + element, codes.to(tl.uint8), mask=element < items_left(numel, first, BLOCK * PER_BYTE))


@triton.jit
def _pack_signs_kernel(values_ptr, out_ptr, numel, n_bytes, BLOCK: tl.constexpr):
    base, byte, inside = program_block(n_bytes, BLOCK)
    first = base * 8
    element = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    # Compared in float32: the sign is exact, and Triton's interpreter mis-compares bfloat16.
    x = tl.load(values_ptr + first + element, mask=element < items_left(numel, first, BLOCK * 8), other=0.0)
    tl.store(out_ptr + base + byte, _pack_tile((x.to(tl.float32) < 0).to(tl.int32), 1, 8), mask=inside)


# Triton specialises integer arguments equal to 1 into compile-time constants, which have no
# ``.to``: ``levels`` is 1 for TernGrad and ``key`` can be 1, so neither is specialised.
@triton.jit(do_not_specialize=["key", "levels", "chunk"])
def _stochastic_quantize_kernel(
    values_ptr, factor_ptr, out_ptr, numel, n_bytes, key, levels, chunk,
    WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Element i is scaled by factor[i // chunk] (chunk = numel: one factor for the whole tensor).
    base, byte, bytes_inside = program_block(n_bytes, BLOCK)
    first = base * PER_BYTE
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    inside = element < items_left(numel, first, BLOCK * PER_BYTE)
    x = tl.load(values_ptr + first + element, mask=inside, other=0.0).to(tl.float32)
    position = first + element  # int64: the factor's index and the random counter need the whole position
    factor = tl.load(factor_ptr + position // chunk, mask=inside, other=0.0)
    r = tl.minimum(tl.abs(x) * factor, levels.to(tl.float32))
    floor = tl.floor(r)
    level = (floor + (counter_uniform(key, position) < (r - floor)).to(tl.float32)).to(tl.int32)
    codes = tl.where(inside, (level << 1) | (x < 0).to(tl.int32), 0)
    tl.store(out_ptr + base + byte, _pack_tile(codes, WIDTH, PER_BYTE), mask=bytes_inside)


def _byte_grid(n_bytes: int) -> tuple[int]:
    return (triton.cdiv(n_bytes, PACK_BLOCK),)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.packing.pack_codes`."""
    n_bytes = packed_bytes(codes.numel(), width)
    codes = codes.contiguous()
    out = torch.empty(n_bytes, dtype=torch.uint8, device=codes.device)
    if n_bytes:
        launch(_pack_codes_kernel, _byte_grid(n_bytes), codes, out, codes.numel(), n_bytes,
               WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.packing.unpack_codes`."""
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    packed = packed.contiguous()
    if numel:
        launch(_unpack_codes_kernel, _byte_grid(packed.numel()), packed, out, numel, packed.numel(),
               WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.packing.pack_signs`: reads values, writes bits."""
    n_bytes = packed_bytes(values.numel(), 1)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
    if n_bytes:
        launch(_pack_signs_kernel, _byte_grid(n_bytes), values, out, values.numel(), n_bytes, BLOCK=PACK_BLOCK)
    return out


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.packing.stochastic_quantize`: quantise and pack in one pass."""
    width = code_width(levels)
    n_bytes = packed_bytes(values.numel(), width)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
    if n_bytes:
        factors = quantize_factor(scales, levels).reshape(-1).contiguous()
        chunk = values.numel() if chunk_size is None else chunk_size
        launch(_stochastic_quantize_kernel, _byte_grid(n_bytes), values, factors, out, values.numel(), n_bytes,
               seed_key(seed), levels, chunk, WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out
