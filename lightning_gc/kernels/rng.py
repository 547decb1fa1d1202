"""Counter-based random numbers, bit-identical in torch (any device) and in the Triton kernels.

Every draw is a pure function of ``(seed, offset)``, so quantisation and random-k selection are
reproducible, and the torch code here equals its Triton twin in :mod:`.rng_triton` bit for bit::

    hash(x)        = lowbias32 (C. Wellons), a 32-bit integer hash with low bias, all mod 2**32:
                     x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16
    key(seed)      = hash(seed mod 2**32) ^ hash((seed >> 32) ^ SEED_HI_SALT)   (all 64 seed bits count)
    uniform(s, i)  = (hash(hash(i ^ key(s)) ^ ROUND_SALT) >> 8) * 2**-24          in [0, 1), exact in float32

The constants are plain Python ints, defined once here: the Triton side wraps these same values
as ``tl.constexpr``. :data:`FIBONACCI_MUL` also keys the jittered sample of the top-k selection
(:mod:`.selection`), whose Triton twin computes it with the same integers.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
LOWBIAS32_MUL = (0x7FEB352D, 0x846CA68B)
"""The two multipliers of the lowbias32 hash."""
ROUND_SALT = 0x9E3779B9
"""XORed in between the two hash rounds of :func:`counter_uniform`."""
SEED_HI_SALT = 0x68E31DA4
"""XORed into the high half of a 64-bit seed before it is hashed (:func:`seed_key`)."""
FIBONACCI_MUL = 0x9E3779B1
"""Knuth's multiplicative (Fibonacci) hash, a prime near ``2**32 / golden ratio``: the products of
consecutive integers spread over 32 bits."""
UNIFORM_BITS = 24
"""Random bits per uniform: the top 24 of the hash, scaled by ``2**-24``, exact in float32."""
UNIFORM_SCALE = 1.0 / (1 << UNIFORM_BITS)


def lowbias32(x: int) -> int:
    """The 32-bit hash on a Python int (for keys computed on the host)."""
    x ^= x >> 16
    x = (x * LOWBIAS32_MUL[0]) & MASK32
    x ^= x >> 15
    x = (x * LOWBIAS32_MUL[1]) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 32-bit key mixing all 64 bits of ``seed``."""
    return lowbias32(seed & MASK32) ^ lowbias32(((seed >> 32) & MASK32) ^ SEED_HI_SALT)


def _signed32(value: int) -> int:
    """The int32 with the same 32 bits as the uint32 ``value``."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of uint32 values held in int32 ``x``, in place. int32 products wrap mod 2**32 (the
    low 32 bits of the uint32 product), and an arithmetic shift masked to the bits shifted in is the
    logical one: bit-identical to the uint32 hash at half the bytes of int64 work, with no
    16-bit splitting of the products (7x faster on a CPU core than the int64 form)."""
    for shift, multiplier in ((16, LOWBIAS32_MUL[0]), (15, LOWBIAS32_MUL[1]), (16, None)):
        high = x >> shift
        high &= (1 << (32 - shift)) - 1
        x ^= high
        if multiplier is not None:
            x *= _signed32(multiplier)
    return x


def counter_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each offset: ``hash(hash(offset ^ key(seed)) ^ salt) >> 8``
    scaled by 2**-24 (exact in float32). A pure function of (seed, offset), so reproducible, and
    identical to :func:`lightning_gc.kernels.rng_triton.counter_uniform`. Offsets must be below 2**32."""
    x = offsets.to(torch.int32, copy=True)  # the low 32 bits (offsets are below 2**32), a buffer of our own
    x ^= _signed32(seed_key(seed))
    _lowbias32_(x)
    x ^= _signed32(ROUND_SALT)
    _lowbias32_(x)
    x >>= 32 - UNIFORM_BITS
    x &= (1 << UNIFORM_BITS) - 1
    return x.to(torch.float32).mul_(UNIFORM_SCALE)
