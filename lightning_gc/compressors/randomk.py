"""Random-k sparsification with indices every rank derives from a shared seed: values only, all-reduced.

Each compressed tensor of ``n`` elements is cut into blocks of ``b = floor(1 / compress_ratio)``
elements (the last one shorter); one element per block is chosen, at an offset drawn from the
counter-based RNG keyed by (step, tensor). Every rank draws the same indices, so the payload is
just the values, and values at the same positions can be summed by an all-reduce: no index bytes,
no all-gather. Element ``i`` of a block of size ``s_i`` is chosen with probability ``1 / s_i``;
with ``rescale=True`` sent values are multiplied by ``s_i``, which makes the compressor unbiased.

Stratification (one per block instead of ``k`` uniformly anywhere) keeps the draw O(k), always
distinct, and spreads the choice over the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_gc.common.layout import BucketLayout, Segment, segment_positions
from lightning_gc.common.validation import check_bool, check_int
from lightning_gc.compressors.base import AdjustableRatio, EncodeContext, PlannedCompressor, split_segments
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import saturating_copy_
from lightning_gc.compressors.registry import register
from lightning_gc.kernels.rng import counter_uniform

_SEED_STEP = 1_000_003


@dataclass
class _RandomKPlan:
    compressed: tuple[tuple[Segment, int, int], ...]  # (segment, first slot, blocks)
    block_starts: torch.Tensor  # bucket position of each block's first element
    block_sizes: torch.Tensor  # float64, elements per block (exact: a bf16 copy would round 3333 to 3328)
    dense_positions: torch.Tensor
    indices: torch.Tensor
    summed: torch.Tensor  # [dense values | sampled values]
    sent: torch.Tensor  # sampled values as receivers decode them (for memory)


@register
class RandomKCompressor(AdjustableRatio, PlannedCompressor[_RandomKPlan]):
    """Shared-seed random-k: about ``compress_ratio`` of each large tensor, values only, all-reduced.

    Args:
        compress_ratio: fraction of elements sent per compressed tensor, in (0, 1).
        rescale: multiply each sent value by its block size (1 / its probability): unbiased,
            so error feedback is off by default; without it the compressor is biased and
            error feedback keeps the rest.
        min_compress_numel: smaller (and 1-D) tensors are sent dense, >= 1.
    """

    name = "randomk"
    arguments = ("compress_ratio", "rescale", "min_compress_numel")
    sends_all_at_one = False  # one value per block of floor(1 / ratio): a ratio of 1 is no compression

    def __init__(self, compress_ratio: float = 0.01, *, rescale: bool = False, min_compress_numel: int = 1024) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self.rescale = check_bool("rescale", rescale)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return not self.rescale

    def _block(self) -> int:
        """Block size ``b = floor(1 / compress_ratio)`` (at least 1)."""
        return max(1, math.floor(1 / self._compress_ratio))

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        block = self._block()
        compressed, dense = split_segments(layout.segments, self.min_compress_numel)
        sent = sum(math.ceil(s.numel / block) for s in compressed) + sum(s.numel for s in dense)
        return sent * element_size

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _RandomKPlan:
        device = like.device
        block = self._block()
        compressible, dense = split_segments(layout.segments, self.min_compress_numel)
        compressed, starts, sizes, slots = [], [], [], 0
        for segment in compressible:
            blocks = math.ceil(segment.numel / block)
            first = torch.arange(blocks, device=device) * block
            starts.append(first + segment.start)
            sizes.append(torch.clamp(segment.numel - first, max=block))
            compressed.append((segment, slots, blocks))
            slots += blocks
        cat = lambda parts, dtype: torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)  # noqa: E731
        dense_positions = segment_positions(dense, device)
        return _RandomKPlan(
            compressed=tuple(compressed),
            block_starts=cat(starts, torch.int64),
            block_sizes=cat(sizes, torch.int64).to(torch.float64),
            dense_positions=dense_positions,
            indices=torch.empty(slots, dtype=torch.int64, device=device),
            summed=like.new_empty(dense_positions.numel() + slots),
            sent=like.new_empty(slots),
        )

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        for segment, first, blocks in plan.compressed:  # the same draw on every rank: the seed has no rank
            chosen = slice(first, first + blocks)
            uniform = counter_uniform(
                context.step * _SEED_STEP + segment.order, torch.arange(blocks, device=velocity.device)
            )
            offsets = (uniform.double() * plan.block_sizes[chosen]).to(torch.int64)  # < size: uniform < 1
            torch.add(plan.block_starts[chosen], offsets, out=plan.indices[chosen])
        dense_count = plan.dense_positions.numel()
        torch.index_select(velocity, 0, plan.dense_positions, out=plan.summed[:dense_count])
        torch.index_select(velocity, 0, plan.indices, out=plan.summed[dense_count:])
        if self.rescale:  # in float64, then rounded once into the bucket's dtype, finite (fp16 ends at 65504)
            saturating_copy_(plan.sent, plan.summed[dense_count:].double() * plan.block_sizes)
        else:
            plan.sent.copy_(plan.summed[dense_count:])
        return Encoded(
            Payload.all_reduce(plan.summed),
            Sent(indices=plan.indices, values=plan.sent, dense_positions=plan.dense_positions if dense_count else None),
            context=plan,
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        plan: _RandomKPlan = encoded.context
        dense_count = plan.dense_positions.numel()
        mean = plan.summed.div_(world_size)
        out.zero_()
        out.index_copy_(0, plan.dense_positions, mean[:dense_count])
        sampled = mean[dense_count:]
        rescaled = sampled
        if self.rescale:
            rescaled = saturating_copy_(torch.empty_like(sampled, dtype=out.dtype), sampled.double() * plan.block_sizes)
        out.index_copy_(0, plan.indices, rescaled)
