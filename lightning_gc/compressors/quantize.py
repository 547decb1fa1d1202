"""Quantising compressors: every element as a few-bit code, with float32 scales per tensor or chunk.

Payload per rank and bucket (all-gathered, the same size on every rank)::

    [ scales of tensor 0 .. S-1 : float32 ][ codes of tensor 0 ][ codes of tensor 1 ] ...
    [ dense tensors' values : float32, from a 4-byte boundary ] (4-byte padded)

A quantised tensor has one block of scales, or one per ``chunk_size`` elements where the
compressor takes ``chunk_size``. Each tensor's codes start on a byte boundary. As in DGC (§3) and
the other compressors, 1-D tensors (biases, norms) and those under ``min_compress_numel`` elements
are not quantised: they leave exactly, as float32 values in one block
(:class:`~lightning_gc.compressors.dense.DenseBlock`). They are a small part of the bytes (0.09 % of
ResNet-18's gradient), but quantised one by one they took half of the codec's ops. Decoding sums
every rank's values and divides by the world size.

* ``qsgd`` (Alistarh et al. 2017): ``x -> ||x||_2 * sign(x) * l / s`` with the level ``l`` rounded
  stochastically so that the result is unbiased; ``s`` = ``levels``; the norm is taken per chunk
  of 512 elements by default, as in the paper (the variance grows with the elements sharing it).
* ``terngrad`` (Wen et al. 2017): ternary ``max|x| * sign(x) * b`` with ``b ~ Bernoulli(|x| / max|x|)``,
  i.e. the same stochastic rounding with one level and scale ``max|x|`` (per chunk of 512 by
  default); unbiased, 2-bit codes.
* ``signsgd`` (EF-signSGD, Karimireddy et al. 2019): ``mean|x| * sign(x)`` per tensor or chunk,
  1 bit per element; biased, so error feedback keeps what the signs lose.
* ``onebit`` (1-bit SGD, Seide et al. 2014): 1 bit per element choosing between two values per
  chunk, the mean of its non-negative and the mean of its negative elements (the reconstruction
  that minimises the squared error for a given sign pattern); error feedback.

Rounding randomness is a pure function of (step, rank, tensor)
(:func:`~lightning_gc.compressors.two_phase.encode_seed`), so runs are reproducible and ranks draw
independently.

Every quantiser takes ``exchange``: ``"gather"`` (default, the payload above all-gathered),
``"two_phase"`` (a compressed all-reduce whose traffic per rank is flat in the world size, with
server-side error feedback, :mod:`lightning_gc.compressors.two_phase`) or ``"auto"``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_gc import kernels
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import EncodeContext, Encoded, PlannedCompressor, split_segments
from lightning_gc.compressors.dense import DenseBlock
from lightning_gc.compressors.numerics import aligned, mean_into, summing_dtype
from lightning_gc.compressors.registry import register
from lightning_gc.compressors.two_phase import ChunkFormat, TwoPhaseExchange, encode_seed
from lightning_gc.kernels.packing import packed_bytes, select_by_block, set_bits_per_block, sign_select

DEFAULT_CHUNK = 512
"""Elements sharing one scale in the unbiased quantisers by default (the QSGD paper's bucket size)."""
DEFAULT_MIN_COMPRESS_NUMEL = 1024
"""Tensors with fewer elements (and every 1-D tensor) are sent dense by default, as in DGC."""


@dataclass(frozen=True)
class _CodeLayout:
    """Where each quantised tensor's scales and codes, and the dense tensors' values, sit in a
    payload (see the module docstring)."""

    quantised: tuple[Segment, ...]
    scale_starts: tuple[int, ...]  # first float32 scale slot of each quantised tensor; last entry: the total
    code_offsets: tuple[int, ...]  # byte offset of each quantised tensor's codes in the payload
    code_sizes: tuple[int, ...]
    dense: DenseBlock


@dataclass
class _QuantPlan:
    fmt: ChunkFormat  # the whole bucket's payload format
    payload: torch.Tensor
    gathered: torch.Tensor
    decoded: torch.Tensor  # this rank's values as receivers decode them (error feedback; decode adds its own row)
    # float32 sum of every rank's decoded values (fp16 could overflow before /N); None: from float32 up, out sums
    total: torch.Tensor | None
    rank: int = -1  # the rank that encoded into this plan last (its row of gathered decodes to ``decoded``)


class _BlockQuantizer(TwoPhaseExchange, PlannedCompressor[_QuantPlan]):
    """Shared payload layout, encode and decode; subclasses define scales and codes.

    A quantised tensor's scales are ``scales_per_block`` float32 numbers for each block: the whole
    tensor, or each run of ``chunk_size`` elements when ``chunk_size`` is set. 1-D tensors and
    those under ``min_compress_numel`` elements travel as float32 values. The payload is all-gathered
    (``exchange="gather"``) or exchanged in two phases (:mod:`lightning_gc.compressors.two_phase`),
    where a tensor split between two ranks' chunks has scales for each piece.
    """

    code_bits: int
    scales_per_block: int = 1
    decodes_own_row = False  # decode_one_phase adds a float32 bucket's own row from ``decoded``

    def __init__(
        self, chunk_size: int | None, min_compress_numel: int, exchange: str, server_feedback: bool | None
    ) -> None:
        super().__init__()
        self.chunk_size = None if chunk_size is None else check_int("chunk_size", chunk_size, 8)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)
        self.init_exchange(exchange, server_feedback)

    def scale_count(self, numel: int) -> int:
        """Scales stored for a tensor of ``numel`` elements (none for an empty tensor)."""
        blocks = min(1, numel) if self.chunk_size is None else -(-numel // self.chunk_size)
        return blocks * self.scales_per_block

    @abstractmethod
    def encode_run(self, values: torch.Tensor, scales: torch.Tensor, seed: int) -> torch.Tensor:
        """Write the float32 scales of one tensor's ``values`` into ``scales`` (``scale_count(numel)``
        of them) and return the packed codes (uint8) of ``values``."""

    @abstractmethod
    def decode_codes(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """float32 values of packed ``codes``."""

    # ------------------------------------------------------------------ one run of tensors
    def chunk_format(self, segments: Sequence[Segment], dtype: torch.dtype | None = None) -> ChunkFormat:
        """Scales of every quantised tensor first, then each one's codes from a byte boundary, then
        the dense tensors' float32 values from a 4-byte boundary, padded to 4 bytes. Which tensors are
        quantised follows the whole tensor (:func:`~lightning_gc.compressors.base.split_segments`)."""
        quantised, dense = split_segments(segments, self.min_compress_numel)
        scale_starts, slots = [], 0
        for segment in quantised:
            scale_starts.append(slots)
            slots += self.scale_count(segment.numel)
        offset = 4 * slots
        offsets, sizes = [], []
        for segment in quantised:
            offsets.append(offset)
            sizes.append(packed_bytes(segment.numel, self.code_bits))
            offset += sizes[-1]
        block = DenseBlock(tuple(dense), aligned(offset))
        layout = _CodeLayout(tuple(quantised), tuple(scale_starts + [slots]), tuple(offsets), tuple(sizes), block)
        return ChunkFormat(segments=tuple(segments), nbytes=aligned(block.start + block.nbytes), layout=layout)

    def encode_chunk(
        self, values: torch.Tensor, fmt: ChunkFormat, payload: torch.Tensor, decoded: torch.Tensor, seed: int
    ) -> None:
        codes_at: _CodeLayout = fmt.layout
        all_scales = payload[: 4 * codes_at.scale_starts[-1]].view(torch.float32)
        for position, segment in enumerate(codes_at.quantised):
            if segment.numel == 0:  # nothing to scale or send (a zero-size piece)
                continue
            run = segment.of(values)
            scales = all_scales[codes_at.scale_starts[position] : codes_at.scale_starts[position + 1]]
            codes = self.encode_run(run, scales, seed + segment.order)
            start = codes_at.code_offsets[position]
            payload[start : start + codes_at.code_sizes[position]].copy_(codes)
            segment.of(decoded).copy_(self._decoded(codes, scales, segment.numel, decoded.dtype))
        codes_at.dense.encode(values, payload, decoded)

    def add_decoded_chunk(
        self, payload: torch.Tensor, fmt: ChunkFormat, total: torch.Tensor, dtype: torch.dtype
    ) -> None:
        codes_at: _CodeLayout = fmt.layout
        all_scales = payload[: 4 * codes_at.scale_starts[-1]].view(torch.float32)
        for position, segment in enumerate(codes_at.quantised):
            if segment.numel == 0:
                continue
            start = codes_at.code_offsets[position]
            codes = payload[start : start + codes_at.code_sizes[position]]
            scales = all_scales[codes_at.scale_starts[position] : codes_at.scale_starts[position + 1]]
            segment.of(total).add_(self._decoded(codes, scales, segment.numel, dtype))
        codes_at.dense.add_into(payload, total)

    # ------------------------------------------------------------------ the whole bucket, all-gathered
    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return self.chunk_format(layout.segments).nbytes

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _QuantPlan:
        fmt = self.chunk_format(layout.segments)
        summing = summing_dtype(like.dtype)
        return _QuantPlan(
            fmt=fmt,
            payload=torch.zeros(fmt.nbytes, dtype=torch.uint8, device=like.device),
            gathered=torch.empty(world_size * fmt.nbytes, dtype=torch.uint8, device=like.device),
            decoded=like.new_empty(layout.numel),
            total=None if summing == like.dtype else like.new_empty(layout.numel, dtype=summing),
        )

    def encode_one_phase(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        self.encode_chunk(velocity, plan.fmt, plan.payload, plan.decoded, encode_seed(context.step, context.rank))
        plan.rank = context.rank
        return Encoded(
            gathered=plan.payload,
            gathered_out=plan.gathered,
            dense_all=True,
            bytes_sent=plan.payload.numel(),
            elements_sent=velocity.numel(),
            context=plan,
            dense_sent=plan.decoded,
        )

    def decode_one_phase(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        plan: _QuantPlan = encoded.context
        total = out if plan.total is None else plan.total  # float32 and float64 buckets sum in out
        total.zero_()
        # this rank's own row is decoded already, bit for bit in float32 (the codec's contract): add
        # it in its place, so every rank sums in the same order; in fp16 ``decoded`` was rounded
        own = plan.rank if plan.decoded.dtype == torch.float32 else -1
        for sender, row in enumerate(plan.gathered.view(world_size, -1)):
            if sender == own:
                total.add_(plan.decoded)
            else:
                self.add_decoded_chunk(row, plan.fmt, total, out.dtype)
        mean_into(out, total, world_size)

    def _decoded(self, codes: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The decoded float32 values, clamped to ``dtype``'s finite range: a decoded QSGD value can
        reach ``||x||``, beyond fp16's 65504 even when every element fits. Memory keeps the excess."""
        values = self.decode_codes(codes, scales, numel)
        limit = torch.finfo(dtype).max
        return values.clamp_(-limit, limit) if limit < torch.finfo(torch.float32).max else values


class _StochasticLevels(_BlockQuantizer):
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
        min_compress_numel: tensors with fewer elements, and every 1-D tensor (biases, norms), are
            sent dense as float32 (>= 1; default 1024, as in DGC).
    """

    name = "qsgd"
    arguments = ("levels", "chunk_size", "min_compress_numel", *TwoPhaseExchange.exchange_arguments)
    biased = False

    def __init__(
        self,
        levels: int = 7,
        chunk_size: int | None = DEFAULT_CHUNK,
        exchange: str = "gather",
        server_feedback: bool | None = None,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
    ) -> None:
        super().__init__(chunk_size, min_compress_numel, exchange, server_feedback)
        self.levels = check_int("levels", levels, 2, 127)
        self.code_bits = kernels.code_width(levels)

    def scales_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # ||x|| of finite values can overflow float32 (elements near 3e19): clamped to the largest
        # float32, the factor levels / scale stays finite (not 0 * inf = NaN on decode). Such a
        # chunk then mostly rounds to level 0. (A float64 norm would be exact but costs 28x on a CPU.)
        return torch.linalg.vector_norm(rows, dim=1).clamp(max=torch.finfo(torch.float32).max)


@register
class TernGradCompressor(_StochasticLevels):
    """TernGrad: unbiased ternary ``{-1, 0, +1} * max|x|`` per chunk of ``chunk_size`` elements, 2 bits each.

    Args:
        chunk_size: elements sharing one ``max|x|`` (>= 8, default 512); ``None``: one per tensor.
        min_compress_numel: tensors with fewer elements, and every 1-D tensor (biases, norms), are
            sent dense as float32 (>= 1; default 1024, as in DGC).
    """

    name = "terngrad"
    arguments = ("chunk_size", "min_compress_numel", *TwoPhaseExchange.exchange_arguments)
    biased = False
    levels = 1
    code_bits = 2

    def __init__(
        self,
        chunk_size: int | None = DEFAULT_CHUNK,
        exchange: str = "gather",
        server_feedback: bool | None = None,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
    ) -> None:
        super().__init__(chunk_size, min_compress_numel, exchange, server_feedback)

    def scales_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.abs().amax(dim=1)


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


class _SignQuantizer(_BlockQuantizer):
    """1 bit per element (the sign; 0 counts as positive), values rebuilt from per-block scales."""

    code_bits = 1
    arguments = ("chunk_size", "min_compress_numel", *TwoPhaseExchange.exchange_arguments)

    def __init__(
        self,
        chunk_size: int | None = None,
        exchange: str = "gather",
        server_feedback: bool | None = None,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
    ) -> None:
        super().__init__(chunk_size, min_compress_numel, exchange, server_feedback)

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
        min_compress_numel: tensors with fewer elements, and every 1-D tensor (biases, norms), are
            sent dense as float32 (>= 1; default 1024, as in DGC).
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
        min_compress_numel: tensors with fewer elements, and every 1-D tensor (biases, norms), are
            sent dense as float32 (>= 1; default 1024, as in DGC).
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
