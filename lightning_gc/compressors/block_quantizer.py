"""The payload, encode and decode shared by the quantising compressors (:mod:`lightning_gc.compressors.quantize`).

Every element of a quantised tensor becomes a few-bit code, with float32 scales per tensor or per
chunk. Payload per rank and bucket (all-gathered, the same size on every rank)::

    [ scales of tensor 0 .. S-1 : float32 ][ codes of tensor 0 ][ codes of tensor 1 ] ...
    [ dense tensors' values : float32, from a 4-byte boundary ] (4-byte padded)

A quantised tensor has one block of scales, or one per ``chunk_size`` elements where the
compressor takes ``chunk_size``. Each tensor's codes start on a byte boundary. As in DGC (§3) and
the other compressors, 1-D tensors (biases, norms) and those under ``min_compress_numel`` elements
are not quantised: they leave exactly, as float32 values in one block
(:class:`~lightning_gc.compressors.dense.DenseBlock`). They are a small part of the bytes (0.09 % of
ResNet-18's gradient), but quantised one by one they took half of the codec's ops. Decoding sums
every rank's values and divides by the world size.

The payload is all-gathered (``exchange="gather"``) or exchanged in two phases
(:mod:`lightning_gc.exchanges.two_phase`), where each rank's chunk of the bucket is a payload of
this layout of its own.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import EncodeContext, PlannedCompressor, split_segments
from lightning_gc.compressors.chunks import ChunkFormat, ExchangeChoice, encode_seed
from lightning_gc.compressors.dense import DenseBlock
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import aligned, mean_into, summing_dtype
from lightning_gc.kernels.packing import packed_bytes

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


class BlockQuantizer(ExchangeChoice, PlannedCompressor[_QuantPlan]):
    """Shared payload layout, encode and decode; subclasses define scales and codes.

    A quantised tensor's scales are ``scales_per_block`` float32 numbers for each block: the whole
    tensor, or each run of ``chunk_size`` elements when ``chunk_size`` is set. 1-D tensors and
    those under ``min_compress_numel`` elements travel as float32 values. The payload is all-gathered
    (``exchange="gather"``) or exchanged in two phases (:mod:`lightning_gc.exchanges.two_phase`),
    where a tensor split between two ranks' chunks has scales for each piece.

    Args (every quantiser's; each names its default ``chunk_size``):
        chunk_size: elements sharing one block of scales (>= 8); ``None``: one block per tensor.
        exchange: ``"gather"`` (the payload all-gathered), ``"two_phase"`` (a compressed
            all-reduce, flat in the world size) or ``"auto"`` (two-phase from three ranks on).
        server_feedback: whether a two-phase chunk owner keeps what re-encoding the mean dropped
            (``None``: the codec's default, see :class:`~lightning_gc.compressors.chunks.ExchangeChoice`).
        min_compress_numel: tensors with fewer elements, and every 1-D tensor (biases, norms), are
            sent dense as float32 (>= 1; default 1024, as in DGC).
    """

    arguments = ("chunk_size", "min_compress_numel", *ExchangeChoice.exchange_arguments)
    code_bits: int
    scales_per_block: int = 1
    decodes_own_row = False  # decode adds a float32 bucket's own row from ``decoded``

    def __init__(
        self,
        chunk_size: int | None,
        exchange: str = "gather",
        server_feedback: bool | None = None,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
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

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        self.encode_chunk(velocity, plan.fmt, plan.payload, plan.decoded, encode_seed(context.step, context.rank))
        plan.rank = context.rank
        payload = Payload.all_gather(plan.payload, plan.gathered, elements_sent=velocity.numel())
        return Encoded(payload, Sent.whole(plan.decoded), context=plan)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
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
