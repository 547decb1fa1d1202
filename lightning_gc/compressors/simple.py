"""The simplest compressors: none (plain all-reduce), casts to 16-bit floats, and exact top-k."""

from __future__ import annotations

import torch

from lightning_gc.compressors.base import (
    Compressor,
    EncodeContext,
    Encoded,
    PlannedCompressor,
    decode_whole_bucket,
    encode_whole_bucket,
    mean_into,
    saturating_copy_,
)
from lightning_gc.compressors.registry import register
from lightning_gc.compressors.sparse import SparseCompressor
from lightning_gc.kernels import topk_indices
from lightning_gc.layout import BucketLayout


@register
class NoCompressor(Compressor):
    """Sends every value exactly through one all-reduce per bucket: DDP through the same path
    (a baseline that still counts bytes and, with momentum correction, equals SGD momentum)."""

    name = "none"
    biased = False

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        return encode_whole_bucket(velocity, out)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        decode_whole_bucket(encoded, out, world_size)

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return layout.numel * element_size


class _CastCompressor(PlannedCompressor[torch.Tensor]):
    """All-reduce of the velocity cast to ``wire_dtype``; the rounding stays in memory.

    The sum over ranks is accumulated in ``wire_dtype`` by the collective. 2 bytes per element.
    Values saturate at ``finfo(wire_dtype).max / world_size``, rounded down so the sum stays finite
    (see :func:`saturation_limit`).
    """

    wire_dtype: torch.dtype

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> torch.Tensor:
        """The plan is the bucket's send buffer in ``wire_dtype``."""
        return torch.empty(layout.numel, dtype=self.wire_dtype, device=like.device)

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        wire = self.plan(context, velocity)
        saturating_copy_(wire, velocity, context.world_size)  # the sum over ranks stays finite
        return Encoded(
            summed=wire,
            dense_all=True,
            bytes_sent=wire.numel() * wire.element_size(),
            elements_sent=wire.numel(),
            dense_sent=wire,  # memory subtracts it in place (mixed dtypes): v keeps the rounding
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        assert encoded.summed is not None
        mean_into(out, encoded.summed, world_size)

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
