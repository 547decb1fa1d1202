"""Triton twin of :mod:`.rng`: the counter hash and uniforms inside kernels, bit-identical to torch.

The constants are :mod:`.rng`'s Python ints, wrapped as ``tl.constexpr`` (the only globals a
``@triton.jit`` function may read); the arithmetic is on uint32, whose products wrap mod 2**32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_gc.kernels import rng

MASK32 = tl.constexpr(rng.MASK32)
FIBONACCI_MUL = tl.constexpr(rng.FIBONACCI_MUL)
_LOWBIAS32_MUL_0 = tl.constexpr(rng.LOWBIAS32_MUL[0])
_LOWBIAS32_MUL_1 = tl.constexpr(rng.LOWBIAS32_MUL[1])
_ROUND_SALT = tl.constexpr(rng.ROUND_SALT)
_DROPPED_BITS = tl.constexpr(32 - rng.UNIFORM_BITS)
_UNIFORM_SCALE = tl.constexpr(rng.UNIFORM_SCALE)


@triton.jit
def lowbias32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], _LOWBIAS32_MUL_0, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], _LOWBIAS32_MUL_1, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def counter_uniform(key, offsets):
    # Twin of rng.counter_uniform: key = rng.seed_key(seed), computed on the host.
    x = offsets.to(tl.uint32) ^ key.to(tl.uint32)
    bits = lowbias32(lowbias32(x) ^ tl.full([], _ROUND_SALT, tl.uint32))
    return (bits >> _DROPPED_BITS).to(tl.float32) * _UNIFORM_SCALE
