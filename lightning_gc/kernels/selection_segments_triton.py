"""The candidate stage of a bucket's segments selected together (:func:`.selection_triton.sampled_topk_segments_`).

Each segment has its own threshold: the sample key at its ``pick`` among the sorted keys of every
segment's samples (``pick = -1``: no sample, threshold -1, an exact top-k). One launch of each
kernel serves all segments, as :func:`.selection_triton.sampled_topk_` does for one tensor: per
block of :data:`~.launch.BLOCK` elements a count of the hits above the segment's threshold and of
the ties (:func:`hits`), prefix sums of the counts, and each block compacts its hits, in position
order, into its segment's candidate slots (a fixed capacity each), every hit above the threshold
before any tie. A candidate is keyed ``segment << 33 | (2**31 - 1 - bits(|x|))``
(:func:`magnitude_key`; the bits of a non-negative float order as the float does), so one
ascending sort groups the candidates by segment, each one's largest magnitudes first, and a
segment's ``k`` output slots take its first ``k`` (a no-op ``(start, 0)`` past those it kept).

:func:`hits` and :func:`magnitude_key` are the predicate and key of every Triton selection, the
one-tensor kernels of :mod:`.selection_triton` included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import BLOCK, launch

_MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)
_LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def hits(magnitude, threshold, inside):
    """(above the threshold, tied with it): never a zero, unless the selection is exact (``threshold < 0``)."""
    candidate = inside & (magnitude > tl.minimum(threshold, 0.0))  # > 0, or > -1 (anything) when exact
    return candidate & (magnitude > threshold), candidate & (magnitude == threshold)


@triton.jit
def magnitude_key(x, segment):
    """``segment << 33 | (2**31 - 1 - bits(|x|))``: ascending order = by segment, then by
    descending magnitude."""
    bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True).to(tl.int64)
    return (segment.to(tl.int64) << 33) | (tl.full([], _MAGNITUDE_BITS, tl.int64) - bits)


@triton.jit
def _segment_threshold(sorted_samples_ptr, pick):
    # The pick-th smallest sample key is the segment's rank-th largest sampled magnitude; pick < 0
    # (no sample: exact top-k) gives -1, which every magnitude passes.
    key = tl.load(sorted_samples_ptr + tl.maximum(pick, 0))
    bits = (tl.full([], _MAGNITUDE_BITS, tl.int64) - (key & tl.full([], _LOW32, tl.int64))).to(tl.int32)
    return tl.where(pick >= 0, bits.to(tl.float32, bitcast=True), -1.0)


@triton.jit
def _segment_block_hits(
    values_ptr, block_segment_ptr, block_first_ptr, stop_ptr, pick_ptr, sorted_samples_ptr, block, BLOCK: tl.constexpr
):
    """Block ``block``'s segment, positions, values and which of them pass the segment's threshold
    (:func:`_hits`: above it, tied with it)."""
    segment = tl.load(block_segment_ptr + block)
    offsets = tl.load(block_first_ptr + block) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(stop_ptr + segment)
    threshold = _segment_threshold(sorted_samples_ptr, tl.load(pick_ptr + segment))
    x = tl.load(values_ptr + offsets, mask=inside, other=0.0)
    above, tie = hits(tl.abs(x.to(tl.float32)), threshold, inside)
    return segment, offsets, x, above, tie


@triton.jit
def _segment_count_kernel(
    values_ptr, block_segment_ptr, block_first_ptr, stop_ptr, pick_ptr, sorted_samples_ptr, counts_ptr,
    tie_counts_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    segment, offsets, x, above, tie = _segment_block_hits(
        values_ptr, block_segment_ptr, block_first_ptr, stop_ptr, pick_ptr, sorted_samples_ptr, block, BLOCK
    )
    tl.store(counts_ptr + block, tl.sum(above.to(tl.int64), axis=0))
    tl.store(tie_counts_ptr + block, tl.sum(tie.to(tl.int64), axis=0))


@triton.jit
def _segment_compact_kernel(
    values_ptr, block_segment_ptr, block_first_ptr, stop_ptr, pick_ptr, sorted_samples_ptr, counts_ptr,
    through_ptr, tie_counts_ptr, tie_through_ptr, first_block_ptr, last_block_ptr, slots_first_ptr, slots_stop_ptr,
    cand_key_ptr, cand_index_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Block b of segment s writes its hits above the threshold, in position order, from slot
    # slots_first[s] + (such hits of s's blocks before b) on, and its ties after all of s's hits
    # above it; ``through`` and ``tie_through`` are the inclusive prefix sums of the counts.
    block = tl.program_id(0)
    segment, offsets, x, above, tie = _segment_block_hits(
        values_ptr, block_segment_ptr, block_first_ptr, stop_ptr, pick_ptr, sorted_samples_ptr, block, BLOCK
    )
    first, last = tl.load(first_block_ptr + segment), tl.load(last_block_ptr + segment)
    above_before_block = tl.load(through_ptr + block) - tl.load(counts_ptr + block)
    above_before_segment = tl.load(through_ptr + first) - tl.load(counts_ptr + first)
    above_in_segment = tl.load(through_ptr + last) - above_before_segment
    ties_before_block = tl.load(tie_through_ptr + block) - tl.load(tie_counts_ptr + block)
    ties_before_segment = tl.load(tie_through_ptr + first) - tl.load(tie_counts_ptr + first)
    slots_first = tl.load(slots_first_ptr + segment)
    above_slot = slots_first + above_before_block - above_before_segment + tl.cumsum(above.to(tl.int64), axis=0) - 1
    tie_slot = (
        slots_first + above_in_segment + ties_before_block - ties_before_segment + tl.cumsum(tie.to(tl.int64), axis=0)
        - 1
    )  # fmt: skip
    slot = tl.where(above, above_slot, tie_slot)
    hit = above | tie
    keep = hit & (slot < tl.load(slots_stop_ptr + segment))
    tl.store(cand_key_ptr + slot, magnitude_key(x, segment), mask=keep)
    tl.store(cand_index_ptr + slot, offsets, mask=keep)


@triton.jit
def _segment_kept_kernel(
    through_ptr, counts_ptr, first_block_ptr, last_block_ptr, capacity_ptr, kept_ptr, segments, BLOCK: tl.constexpr
):
    # ``through`` and ``counts``: every hit's (above the threshold and tied), summed by the caller
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = s < segments
    first = tl.load(first_block_ptr + s, mask=inside, other=0)
    hits = tl.load(through_ptr + tl.load(last_block_ptr + s, mask=inside, other=0), mask=inside, other=0) - (
        tl.load(through_ptr + first, mask=inside, other=0) - tl.load(counts_ptr + first, mask=inside, other=0)
    )
    tl.store(kept_ptr + s, tl.minimum(hits, tl.load(capacity_ptr + s, mask=inside, other=0)), mask=inside)


@triton.jit
def _segment_emit_kernel(
    values_ptr, output_segment_ptr, first_ptr, start_ptr, kept_ptr, kept_through_ptr, order_ptr, cand_index_ptr,
    out_indices_ptr, out_values_ptr, total_k, BLOCK: tl.constexpr,
):  # fmt: skip
    # Output slot o is the j-th largest candidate of its segment s (j = o - first[s]), which the sort
    # put at (candidates kept by segments before s) + j; past the kept ones, a no-op (start[s], 0).
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = o < total_k
    segment = tl.load(output_segment_ptr + o, mask=inside, other=0)
    j = o - tl.load(first_ptr + segment, mask=inside, other=0)
    kept = tl.load(kept_ptr + segment, mask=inside, other=0)
    real = inside & (j < kept)
    rank = tl.load(kept_through_ptr + segment, mask=inside, other=0) - kept + j
    source = tl.load(order_ptr + rank, mask=real, other=0)
    index = tl.load(cand_index_ptr + source, mask=real, other=0)
    index = tl.where(real, index, tl.load(start_ptr + segment, mask=inside, other=0))
    value = tl.load(values_ptr + index, mask=real, other=0.0)
    tl.store(out_indices_ptr + o, index, mask=inside)
    tl.store(out_values_ptr + o, value, mask=inside)


@dataclass(frozen=True, eq=False)
class SegmentTable:
    """What the kernels read about a :class:`SegmentedTopK` at one sample ratio, on one device:
    per segment (``[S]``), per sample, per block of :data:`BLOCK` elements and per output slot."""

    start: torch.Tensor  # [S] int64, bucket position of the segment's first element
    stop: torch.Tensor  # [S] int64
    stride: torch.Tensor  # [S] int64, sample stride (1 where unsampled)
    salt_key: torch.Tensor  # [S] int64, salts[s] * FIBONACCI_MUL mod 2**32
    sample_first: torch.Tensor  # [S] int64, the segment's first sample
    pick: torch.Tensor  # [S] int64, sorted-sample position of its threshold, -1: exact
    slots_first: torch.Tensor  # [S] int64, its first candidate slot
    slots_stop: torch.Tensor  # [S] int64
    capacity: torch.Tensor  # [S] int64
    first_block: torch.Tensor  # [S] int64
    last_block: torch.Tensor  # [S] int64
    first: torch.Tensor  # [S] int64, its first output slot
    sample_segment: torch.Tensor  # [samples] int32
    block_segment: torch.Tensor  # [blocks] int32
    block_first: torch.Tensor  # [blocks] int64
    output_segment: torch.Tensor  # [total_k] int32
    samples: int
    slots: int


def segment_topk_of_candidates_(
    values: torch.Tensor,
    table: SegmentTable,
    sorted_samples: torch.Tensor,
    total_k: int,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Every segment's ``k`` pairs, at its output slots, from its candidates past its threshold
    (``sorted_samples``: the sorted keys of every segment's samples; module docstring)."""
    device = values.device
    blocks = table.block_segment.numel()
    counts = torch.empty(blocks, dtype=torch.int64, device=device)
    tie_counts = torch.empty(blocks, dtype=torch.int64, device=device)
    launch(_segment_count_kernel, (blocks,), values, table.block_segment, table.block_first, table.stop, table.pick,
           sorted_samples, counts, tie_counts, BLOCK=BLOCK)  # fmt: skip
    through, tie_through = torch.cumsum(counts, 0), torch.cumsum(tie_counts, 0)
    cand_key = torch.full((table.slots,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=device)
    cand_index = torch.empty(table.slots, dtype=torch.int64, device=device)
    launch(_segment_compact_kernel, (blocks,), values, table.block_segment, table.block_first, table.stop,
           table.pick, sorted_samples, counts, through, tie_counts, tie_through, table.first_block, table.last_block,
           table.slots_first, table.slots_stop, cand_key, cand_index, BLOCK=BLOCK)  # fmt: skip
    segment_count = table.start.numel()
    kept = torch.empty(segment_count, dtype=torch.int64, device=device)
    launch(_segment_kept_kernel, (triton.cdiv(segment_count, BLOCK),), through + tie_through, counts + tie_counts,
           table.first_block, table.last_block, table.capacity, kept, segment_count, BLOCK=BLOCK)  # fmt: skip
    kept_through = torch.cumsum(kept, 0)
    order = torch.sort(cand_key).indices
    launch(_segment_emit_kernel, (triton.cdiv(total_k, BLOCK),), values, table.output_segment, table.first,
           table.start, kept, kept_through, order, cand_index, out_indices, out_values, total_k,
           BLOCK=BLOCK)  # fmt: skip
