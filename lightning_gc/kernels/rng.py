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


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # Low 32 bits of x * constant for uint32 x held in int64; 16-bit halves keep products < 2**49.
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & MASK32


def _lowbias32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, LOWBIAS32_MUL[0])
    x = x ^ (x >> 15)
    x = _mul32(x, LOWBIAS32_MUL[1])
    return x ^ (x >> 16)


def counter_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each offset: ``hash(hash(offset ^ key(seed)) ^ salt) >> 8``
    scaled by 2**-24 (exact in float32). A pure function of (seed, offset), so reproducible, and
    identical to :func:`lightning_gc.kernels.rng_triton.counter_uniform`. Offsets must be below 2**32."""
    x = offsets.to(torch.int64) ^ seed_key(seed)
    bits = _lowbias32_tensor(_lowbias32_tensor(x) ^ ROUND_SALT)
    return (bits >> (32 - UNIFORM_BITS)).to(torch.float32) * UNIFORM_SCALE
