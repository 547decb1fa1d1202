"""The simplest compressors: none (plain all-reduce), casts to 16-bit floats, and exact top-k."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.compressors.base import Compressor, EncodeContext, PlannedCompressor
from lightning_gc.compressors.chunks import ChunkFormat, ExchangeChoice
from lightning_gc.compressors.dense import DenseBlock, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import aligned, mean_into, saturating_copy_, widened_for_commit
from lightning_gc.compressors.registry import register
from lightning_gc.compressors.sparse import SparseCompressor
from lightning_gc.kernels import topk_indices


class _DenseChunks(ExchangeChoice, Compressor):
    """Every value on the wire, in :meth:`chunk_wire_dtype` (a chunk is its values back to back):
    the :class:`~lightning_gc.compressors.chunks.ChunkCodec` of the exact and cast compressors.
    Their two-phase form is a reduce-scatter + all-gather whose sums run in float32 on the owner."""

    arguments = ExchangeChoice.exchange_arguments

    def __init__(self, exchange: str = "gather", server_feedback: bool | None = None) -> None:
        super().__init__()
        self.init_exchange(exchange, server_feedback)

    def chunk_wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The wire dtype of values of ``dtype``."""
        return dtype

    def chunk_format(self, segments: Sequence[Segment], dtype: torch.dtype) -> ChunkFormat:
        """The segments' values back to back in the wire dtype (``layout``: their :class:`DenseBlock`)."""
        block = DenseBlock(tuple(segments), 0, self.chunk_wire_dtype(dtype))
        return ChunkFormat(segments=tuple(segments), nbytes=aligned(block.nbytes), layout=block)

    def encode_chunk(
        self, values: torch.Tensor, fmt: ChunkFormat, payload: torch.Tensor, decoded: torch.Tensor, seed: int
    ) -> None:
        fmt.layout.encode(values, payload, decoded)

    def add_decoded_chunk(
        self, payload: torch.Tensor, fmt: ChunkFormat, total: torch.Tensor, dtype: torch.dtype
    ) -> None:
        fmt.layout.add_into(payload, total)


@register
class NoCompressor(_DenseChunks):
    """Sends every value exactly through one all-reduce per bucket: DDP through the same path
    (a baseline that still counts bytes and, with momentum correction, equals SGD momentum).
    ``exchange="two_phase"`` sends them through the two-phase exchange instead, which equals
    DDP's all-reduce too (the check that the exchange itself is right)."""

    name = "none"
    biased = False

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        return encode_whole_bucket(velocity, out)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        decode_whole_bucket(encoded, out, world_size)

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return layout.numel * element_size


class _CastCompressor(_DenseChunks, PlannedCompressor[torch.Tensor]):
    """All-reduce of the velocity cast to ``wire_dtype``; the rounding stays in memory.

    The sum over ranks is accumulated in ``wire_dtype`` by the collective. 2 bytes per element.
    Values saturate at ``finfo(wire_dtype).max / world_size``, rounded down so the sum stays finite
    (see :func:`saturation_limit`). In the two-phase form the owner sums in float32.
    """

    wire_dtype: torch.dtype

    def chunk_wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> torch.Tensor:
        """The plan is the bucket's send buffer in ``wire_dtype``."""
        return torch.empty(layout.numel, dtype=self.wire_dtype, device=like.device)

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        wire = self.plan(context, velocity)
        saturating_copy_(wire, velocity, context.world_size)  # the sum over ranks stays finite
        # memory subtracts what receivers decode: v keeps the rounding
        return Encoded(Payload.all_reduce(wire), Sent.whole(widened_for_commit(wire, velocity, out)))

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        summed = encoded.payload.summed
        assert summed is not None
        mean_into(out, summed, world_size)

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return layout.numel * self.wire_dtype.itemsize


@register
class FP16Compressor(_CastCompressor):
    """Half-precision all-reduce (2x), like torch's ``fp16_compress_hook`` plus error feedback."""

    name = "fp16"
    wire_dtype = torch.float16


@register
class BF16Compressor(_CastCompressor):
    """bfloat16 all-reduce (2x): fp32's range, 8 bits of mantissa; rounding kept by error feedback."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@register
class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude per compressed tensor (``torch.topk``), with error feedback.

    Args: those of :class:`~lightning_gc.compressors.sparse.SparseCompressor` (default ratio 1 %).
    """

    name = "topk"

    def select(
        self, values: torch.Tensor, k: int, salt: int, out_indices: torch.Tensor, out_values: torch.Tensor
    ) -> None:
        indices = topk_indices(values, k)
        out_indices.copy_(indices)
        torch.index_select(values, 0, indices, out=out_values)
