"""Quantising compressors: every element as a few-bit code, with float32 scales per tensor or chunk.

The payload (scales, then codes, then the dense tensors' float32 values) and its encode and decode
are :class:`~lightning_gc.compressors.block_quantizer.BlockQuantizer`'s; here, what each quantiser
makes of a run of values:

* ``qsgd`` (Alistarh et al. 2017): ``x -> ||x||_2 * sign(x) * l / s`` with the level ``l`` rounded
  stochastically so that the result is unbiased; ``s`` = ``levels``; the norm is taken per chunk
  of 512 elements by default, as in the paper (the variance grows with the elements sharing it).
* ``terngrad`` (Wen et al. 2017): ternary ``max|x| * sign(x) * b`` with ``b ~ Bernoulli(|x| / max|x|)``,
  i.e. the same stochastic rounding with one level and scale ``max|x|`` (per chunk of 512 by
  default); unbiased, 2-bit codes.
* ``int8``: the same rounding to 127 levels of ``|x| / max|x|`` per chunk of 512: 8-bit codes,
  unbiased, every element within ``max|x| / 127`` of its value.
* ``signsgd`` (EF-signSGD, Karimireddy et al. 2019): ``mean|x| * sign(x)`` per tensor or chunk,
  1 bit per element; biased, so error feedback keeps what the signs lose.
* ``onebit`` (1-bit SGD, Seide et al. 2014): 1 bit per element choosing between two values per
  chunk, the mean of its non-negative and the mean of its negative elements (the reconstruction
  that minimises the squared error for a given sign pattern); error feedback.

Rounding randomness is a pure function of (step, rank, tensor)
(:func:`~lightning_gc.compressors.chunks.encode_seed`), so runs are reproducible and ranks draw
independently.

Every quantiser takes ``exchange``: ``"gather"`` (default, the payload all-gathered),
``"two_phase"`` (a compressed all-reduce whose traffic per rank is flat in the world size, with
server-side error feedback, :mod:`lightning_gc.exchanges.two_phase`) or ``"auto"``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from lightning_gc import kernels
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.block_quantizer import BlockQuantizer
from lightning_gc.compressors.registry import register
from lightning_gc.kernels.packing import select_by_block, set_bits_per_block, sign_select

DEFAULT_CHUNK = 512
"""Elements sharing one scale in the unbiased quantisers by default (the QSGD paper's bucket size)."""


class _StochasticLevels(BlockQuantizer):
    """Unbiased stochastic rounding to ``levels`` levels of ``|x| / scale``, one scale per
    ``chunk_size`` elements (default :data:`DEFAULT_CHUNK`) or per tensor (``chunk_size=None``).

    Why chunks: the rounding error's variance grows with the vector sharing one scale. For QSGD,
    ``E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2`` (Alistarh et al. 2017, Lemma 3.1)
    for ``d`` elements sharing the norm: a 262,144-element tensor at ``s = 7`` carries ~73x its own
    energy in noise, a 512-element chunk ~3x, at 32 extra bits per 512 elements (+1.6 % at 4 bits).
    The QSGD paper quantises in buckets of 512 for this reason; TernGrad's ``max |x|`` scale grows
    with ``d`` in the same way.
    """

    levels: int

    def __init__(self, chunk_size: int | None = DEFAULT_CHUNK, **settings: Any) -> None:
        super().__init__(chunk_size, **settings)

    @abstractmethod
    def scales_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """One float32 scale per row of ``rows`` (a chunk each, zero-padded at the end)."""

    def encode_run(self, values: torch.Tensor, scales: torch.Tensor, seed: int) -> torch.Tensor:
        scales.copy_(self.scales_of_rows(_chunked(values, self.chunk_size)))
        return kernels.stochastic_quantize(values, scales, self.levels, seed, self.chunk_size)

    def decode_codes(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        return kernels.stochastic_dequantize(codes, scales, self.levels, numel, self.chunk_size)


@register
class QSGDCompressor(_StochasticLevels):
    """QSGD: ``levels`` stochastic levels of ``|x| / ||x||_2`` per chunk of ``chunk_size`` elements, unbiased.

    Args:
        levels: quantisation levels ``s`` in [2, 127] (one level is TernGrad); codes take 4 bits
            up to 7 levels, 8 bits up to 127 (the sign is one of the bits).
        chunk_size: elements sharing one norm (>= 8; 512 as in the QSGD paper); ``None``: one norm
            per tensor, whose variance grows with the tensor's size (see the class above).
        **settings: ``exchange``, ``server_feedback``, ``min_compress_numel``: see :class:`BlockQuantizer`.
    """

    name = "qsgd"
    arguments = ("levels", *BlockQuantizer.arguments)
    biased = False

    def __init__(self, levels: int = 7, chunk_size: int | None = DEFAULT_CHUNK, **settings: Any) -> None:
        super().__init__(chunk_size, **settings)
        self.levels = check_int("levels", levels, 2, 127)
        self.code_bits = kernels.code_width(levels)

    def scales_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # ||x|| of finite values can overflow float32 (elements near 3e19): clamped to the largest
        # float32, the factor levels / scale stays finite (not 0 * inf = NaN on decode). Such a
        # chunk then mostly rounds to level 0. (A float64 norm would be exact but costs 28x on a CPU.)
        return torch.linalg.vector_norm(rows, dim=1).clamp(max=torch.finfo(torch.float32).max)


class _MaxAbsLevels(_StochasticLevels):
    """Stochastic levels of ``|x| / max|x|`` per chunk: the chunk's largest element maps to the top
    level, so every element's error is below ``max|x| / levels``."""

    def scales_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.abs().amax(dim=1)


@register
class TernGradCompressor(_MaxAbsLevels):
    """TernGrad: unbiased ternary ``{-1, 0, +1} * max|x|`` per chunk of ``chunk_size`` elements, 2 bits each.

    Args:
        chunk_size: elements sharing one ``max|x|`` (>= 8, default 512); ``None``: one per tensor.
        **settings: ``exchange``, ``server_feedback``, ``min_compress_numel``: see :class:`BlockQuantizer`.
    """

    name = "terngrad"
    biased = False
    levels = 1
    code_bits = 2


@register
class Int8Compressor(_MaxAbsLevels):
    """8-bit max-abs codes: ``x -> max|x| * sign(x) * l / 127`` per chunk of ``chunk_size`` elements,
    the level ``l`` in [0, 127] rounded stochastically, unbiased (INTELLECT-1-style int8 pseudo-gradients).

    Unlike ``qsgd`` at 127 levels (scale ``||x||_2``, so a Gaussian chunk of 512 uses ~6 levels), the
    largest element of each chunk maps to level 127: every element's error is below ``max|x| / 127``.

    Args:
        chunk_size: elements sharing one ``max|x|`` (>= 8, default 512); ``None``: one per tensor.
        **settings: ``exchange``, ``server_feedback``, ``min_compress_numel``: see :class:`BlockQuantizer`.
    """

    name = "int8"
    biased = False
    levels = 127
    code_bits = 8


def _block_counts(numel: int, rows: torch.Tensor) -> torch.Tensor | float:
    """Elements of a run of ``numel`` in each of :func:`_chunked`'s ``rows`` (the last row's
    padding excluded), as float32; a plain number for one row (no tensor to build per tensor)."""
    count, width = rows.shape
    if count == 1:
        return float(numel)
    counts = torch.full((count,), float(width), device=rows.device)
    counts[-1] = numel - width * (count - 1)
    return counts


def _chunked(values: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """``values`` as rows of ``chunk_size`` (one row without chunks), the last row zero-padded."""
    flat = values.reshape(-1).float()
    if chunk_size is None:
        return flat.view(1, -1)
    padding = -flat.numel() % chunk_size
    return torch.nn.functional.pad(flat, (0, padding)).view(-1, chunk_size)


class _SignQuantizer(BlockQuantizer):
    """1 bit per element (the sign; 0 counts as positive), values rebuilt from per-block scales."""

    code_bits = 1

    def __init__(self, chunk_size: int | None = None, **settings: Any) -> None:
        super().__init__(chunk_size, **settings)

    @abstractmethod
    def scales_of_signs(self, values: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        """The float32 scales of ``values``, whose packed sign bits are ``signs``."""

    def encode_run(self, values: torch.Tensor, scales: torch.Tensor, seed: int) -> torch.Tensor:
        signs = kernels.pack_signs(values)
        scales.copy_(self.scales_of_signs(values, signs))
        return signs

    def _select(
        self, codes: torch.Tensor, if_negative: torch.Tensor, if_positive: torch.Tensor, numel: int
    ) -> torch.Tensor:
        """float32 values: each block's ``if_negative`` entry where the sign bit is set, else its
        ``if_positive`` entry (one entry per block)."""
        if self.chunk_size is None:  # one pair for the whole run: a byte-table look-up
            return sign_select(codes, numel, if_negative, if_positive)
        negative = kernels.unpack_codes(codes, 1, numel).view(torch.bool)  # codes are 0 or 1
        return select_by_block(negative, if_negative, if_positive, self.chunk_size)


@register
class SignSGDCompressor(_SignQuantizer):
    """EF-signSGD: ``mean|x| * sign(x)`` per tensor (or per ``chunk_size`` elements), with error feedback.

    Args:
        chunk_size: elements sharing one scale (>= 8); ``None``: one scale per tensor. Smaller
            chunks follow the gradient's magnitude more closely at 32 bits per chunk.
        **settings: ``exchange``, ``server_feedback``, ``min_compress_numel``: see :class:`BlockQuantizer`.
    """

    name = "signsgd"

    def scales_of_signs(self, values: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        rows = _chunked(values, self.chunk_size)
        return rows.abs().sum(1) / _block_counts(values.numel(), rows)

    def decode_codes(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        return self._select(codes, -scales, scales, numel)


@register
class OneBitCompressor(_SignQuantizer):
    """1-bit SGD: per tensor (or chunk), negative elements become the mean of the negative ones and
    the others the mean of the non-negative ones; with error feedback.

    Args:
        chunk_size: elements sharing one pair of values (>= 8); ``None``: one pair per tensor.
        **settings: ``exchange``, ``server_feedback``, ``min_compress_numel``: see :class:`BlockQuantizer`.
    """

    name = "onebit"
    scales_per_block = 2

    def scales_of_signs(self, values: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        rows = _chunked(values, self.chunk_size)
        negatives = set_bits_per_block(signs, values.numel(), self.chunk_size)
        # the padded tail holds zeros: they add nothing to either sum and count as non-negative
        positives = _block_counts(values.numel(), rows) - negatives
        positive_sum = rows.clamp(min=0).sum(1)
        mean_positive = positive_sum / positives.clamp(min=1)
        mean_negative = (rows.sum(1) - positive_sum) / negatives.clamp(min=1)
        return torch.stack([mean_positive, mean_negative], dim=1).reshape(-1)

    def decode_codes(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        pairs = scales.view(-1, 2)
        return self._select(codes, pairs[:, 1], pairs[:, 0], numel)
