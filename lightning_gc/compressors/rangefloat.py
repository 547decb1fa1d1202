"""Range-based few-bit floating point (Wang et al., HPDC 2020): exponent bits sized to the data.

A block of values is stored as ``bits``-bit codes ``sign | exponent code c (E bits) | mantissa
(M = bits - 1 - E bits)`` plus a block header ``(emax, E)``:

* ``emax = floor(log2 max|x|)``; the exponent width ``E`` is the smallest that covers the block's
  binary range ``span = emax - floor(log2 min|x|)`` (zeros excluded) with one code to spare:
  ``2^E - 1 >= span + 1``, clamped to ``[1, bits - 2]`` so at least one mantissa bit remains.
  Narrow ranges (the survivors of a top-k selection) thus keep more mantissa bits.
* ``c = 0`` is zero; ``c >= 1`` means ``|x| = 2^(emax - c + 1) * (1 + mantissa / 2^M)``, so the
  normal range is ``[2^(emax - 2^E + 2), 2^(emax + 1))``; smaller magnitudes flush to zero.
* Mantissas round to nearest; a carry moves to the next exponent, and the top saturates at the
  largest code. The relative error of a normal value is at most ``2^-(M + 1)``.

Everything stays on the tensor's device: the header is a pair of 0-d int32 tensors, no host sync.
"""

from __future__ import annotations

import torch

from lightning_gc import kernels

CODE_BITS = (4, 8, 16)
"""Supported code widths: 4 and 8 pack through :func:`lightning_gc.kernels.pack_codes`, 16 as int16."""


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` packed ``bits``-bit codes."""
    return -(-count * bits // 8)


def header(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[emax, E]`` (int32, on ``values``' device) for the block ``values``."""
    magnitude = values.abs().float()
    nonzero = magnitude > 0
    top = torch.frexp(magnitude.max() if magnitude.numel() else magnitude.new_zeros(()))[1] - 1
    smallest = torch.where(nonzero, magnitude, torch.full_like(magnitude, float("inf"))).min()
    bottom = torch.frexp(torch.where(torch.isfinite(smallest), smallest, magnitude.new_ones(())))[1] - 1
    span = (top - bottom).clamp(min=0).float()
    width = torch.ceil(torch.log2(span + 2)).clamp(1, bits - 2)
    return torch.stack([top.to(torch.int32), width.to(torch.int32)])


def encode(values: torch.Tensor, head: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes (int32, one per value) of ``values`` under ``head`` = :func:`header`."""
    emax, width = head[0].long(), head[1].long()
    mantissa_bits = bits - 1 - width
    scale = torch.pow(2.0, mantissa_bits.float())
    magnitude = values.abs().float()
    significand, exponent = torch.frexp(magnitude)  # magnitude = significand * 2^exponent, significand in [0.5, 1)
    exponent = exponent.long() - 1
    mantissa = torch.round((2 * significand - 1) * scale).long()
    carry = mantissa >= scale.long()
    exponent = exponent + carry.long()
    mantissa = torch.where(carry, torch.zeros_like(mantissa), mantissa)
    saturate = exponent > emax
    exponent = torch.where(saturate, emax, exponent)
    mantissa = torch.where(saturate, scale.long() - 1, mantissa)
    code = emax - exponent + 1
    keep = (magnitude > 0) & (code <= (1 << width) - 1)
    body = torch.where(keep, (code << mantissa_bits) | mantissa, torch.zeros_like(code))
    sign = (values < 0).long() & keep.long()
    return ((sign << (bits - 1)) | body).to(torch.int32)


def decode(codes: torch.Tensor, head: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values of ``codes`` (int32) under ``head``; inverse of :func:`encode` up to rounding."""
    emax, width = head[0].long(), head[1].long()
    mantissa_bits = bits - 1 - width
    codes = codes.long()
    mantissa = codes & ((1 << mantissa_bits) - 1)
    code = (codes >> mantissa_bits) & ((1 << width) - 1)
    magnitude = torch.ldexp(1 + mantissa.float() / torch.pow(2.0, mantissa_bits.float()), (emax - code + 1).float())
    magnitude = torch.where(code == 0, torch.zeros_like(magnitude), magnitude)
    negative = ((codes >> (bits - 1)) & 1).bool()
    return torch.where(negative, -magnitude, magnitude)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes of ``codes`` (int32, each < 2^bits): :func:`packed_size` of them."""
    if bits == 16:
        return codes.to(torch.int16).view(torch.uint8) if codes.numel() else codes.new_empty(0, dtype=torch.uint8)
    return kernels.pack_codes(codes.to(torch.uint8), bits)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``count`` codes as int32."""
    if bits == 16:
        return packed[: 2 * count].view(torch.int16).to(torch.int32) & 0xFFFF
    return kernels.unpack_codes(packed, bits, count).to(torch.int32)
