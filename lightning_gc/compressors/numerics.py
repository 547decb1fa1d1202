"""Wire numerics: the arithmetic every compressor shares for putting values on the wire and
averaging what comes back, so that no narrow dtype overflows and no field is misaligned.

The invariants its functions keep:

* alignment -- every field of a gathered payload is padded to :data:`WIRE_ALIGNMENT` (4) bytes
  (:func:`aligned`), so the next field can be viewed as int32/fp32;
* saturation -- a value written into a narrower wire dtype is clamped to
  ``+-saturation_limit(dtype, summands)`` (:func:`saturating_copy_`), the largest value whose
  ``summands``-fold sum, accumulated one term at a time in that dtype as a ring all-reduce adds,
  stays finite (about ``finfo(dtype).max / summands``); with error feedback the clipped excess
  stays in memory, so it is delayed, not lost; NaN stays NaN;
* commit -- memory subtracts what receivers decode (:func:`widened_for_commit` hands it the
  narrow wire values, widened on CPU where mixed-dtype arithmetic is slow);
* averaging -- the ranks' decoded values are summed in at least float32 (:func:`summing_dtype`)
  and divided by the world size in the wider of the sum's and the output's dtypes
  (:func:`mean_into`), so a sum that the output dtype cannot hold can still give a mean it can.
"""

from __future__ import annotations

import functools

import torch

WIRE_ALIGNMENT = 4
"""Bytes every field of a gathered payload is padded to, so the next one can be viewed as int32/fp32."""


def aligned(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`WIRE_ALIGNMENT`."""
    return -(-size // WIRE_ALIGNMENT) * WIRE_ALIGNMENT


@functools.cache
def saturation_limit(dtype: torch.dtype, summands: int) -> float:
    """The largest value of ``dtype`` whose ``summands``-fold sum, accumulated in ``dtype`` one term
    at a time (as a ring all-reduce adds), stays finite: ``finfo(dtype).max / summands`` rounded
    toward zero in ``dtype`` (rounding to nearest can land above it: fp16 at 3 ranks gives 21840,
    and 3 * 21840 overflows), then lowered while the accumulated sum still overflows."""
    limit = torch.tensor(torch.finfo(dtype).max / summands, dtype=torch.float64).to(dtype)
    toward_zero = torch.zeros((), dtype=dtype)
    while True:
        total = torch.zeros((), dtype=dtype)
        for _ in range(summands):
            total = total + limit
        if limit.double() * summands <= torch.finfo(dtype).max and torch.isfinite(total):
            return float(limit)
        limit = torch.nextafter(limit, toward_zero)


def saturating_copy_(wire: torch.Tensor, values: torch.Tensor, summands: int = 1) -> torch.Tensor:
    """``wire <- values``, clamped to ``+-saturation_limit(wire.dtype, summands)`` (about
    ``finfo(wire.dtype).max / summands``); returns ``wire``.

    A narrow wire dtype (fp16: largest finite 65504) turns large values into ``inf``, and a
    collective summing ``summands`` of them can overflow even when each is finite. Clamping
    instead keeps every value and every sum finite; with error feedback the clipped excess stays
    in memory (memory subtracts what receivers decode), so it is delayed, not lost. NaN stays NaN.
    A wire dtype at least as wide as the values' is a plain copy.
    """
    wire.copy_(values)
    if torch.finfo(wire.dtype).max < torch.finfo(values.dtype).max:
        limit = saturation_limit(wire.dtype, summands)
        wire.clamp_(-limit, limit)
    return wire


def widened_for_commit(wire: torch.Tensor, velocity: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """What memory should subtract from ``velocity`` for the narrow ``wire`` values (its
    ``Sent.dense_values``): on CPU a copy of ``wire`` in ``velocity``'s dtype, written into
    ``scratch`` (a bucket-sized buffer free until decode) when the dtypes match; else ``wire``.

    Why: CPU kernels for in-place arithmetic across dtypes (``v -= fp16``) are not vectorised and
    run about 4x slower than a widening copy plus a same-dtype subtraction (22 vs 6 ms for ResNet-18's
    11.2 M gradients on one core). On GPUs the mixed-dtype subtraction is one fused kernel that
    reads less, so ``wire`` is returned as it is.
    """
    if velocity.device.type != "cpu" or scratch.dtype != velocity.dtype or scratch.numel() < wire.numel():
        return wire
    return scratch[: wire.numel()].copy_(wire)


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ranks' decoded values are summed in for a bucket of ``dtype``: float32 for
    the narrower floats (their sum over ranks could overflow before it is divided), the bucket's
    own dtype from float32 up (a float64 bucket keeps float64's precision)."""
    return torch.promote_types(dtype, torch.float32)


def mean_into(out: torch.Tensor, summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """``out <- summed / world_size``, divided in the wider of the two dtypes: a sum over ranks
    that ``out``'s dtype cannot hold (fp16: 2 x 40000) can still have a mean that it can.
    ``summed`` may be ``out`` itself, and may be overwritten; returns ``out``."""
    if summed is out:
        return out.div_(world_size)
    if torch.finfo(summed.dtype).max > torch.finfo(out.dtype).max:
        return out.copy_(summed.div_(world_size))
    return out.copy_(summed).div_(world_size)
