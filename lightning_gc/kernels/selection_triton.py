"""Triton twin of :mod:`.selection`: top-k without a host sync.

sample -> threshold -> count -> compact -> exact top-k: the jittered sample of :mod:`.selection`
(same positions, same integers), its ``rank``-th largest magnitude as threshold, per block a count
of the hits above it (``|x| > thr``) and of the ties (``|x| == thr``) and their prefix sums, then
each block compacts its hits, in position order, into a candidate buffer of fixed capacity, every
hit above the threshold before any tie, over which ``torch.topk`` picks ``k``. Zeros are never
candidates (a sparse gradient's sampled threshold is 0: its zeros would fill the buffer from the
front and starve the non-zeros behind them), except in an exact selection (threshold -1).

A bucket's segments are selected together (:func:`sampled_topk_segments_`): one launch of each
kernel for all of them, so the host cost per bucket no longer grows with its number of tensors
(one tensor at a time took about 0.5 ms of launches each on an H200). Ragged per-segment top-k
becomes one sort: each sampled or candidate magnitude is keyed ``segment << 33 | (2**31 - 1 -
bits(|x|))``, so an ascending sort groups the segments in order and puts each one's largest
magnitudes first (the bits of a non-negative float order as the float does). A segment whose
sample would not pay (:func:`.selection.sample_plan` is ``None``) gets threshold -1: all its
elements are candidates, and its top-k is exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import BLOCK, launch, program_block
from lightning_gc.kernels.rng import FIBONACCI_MUL as FIBONACCI_MUL_INT
from lightning_gc.kernels.rng import MASK32 as MASK32_INT
from lightning_gc.kernels.rng_triton import FIBONACCI_MUL, MASK32
from lightning_gc.kernels.selection import (
    SamplePlan,
    SegmentedTopK,
    SelectionScratch,
    sample_plan,
    sampled_one_at_a_time,
)

CANDIDATE_HEADROOM = 4
"""Candidate buffer capacity, in multiples of the expected candidate count (which is ~2k)."""

SEGMENTED_CAPACITY_SHARE = 0.25
"""A bucket's segments are selected together while their candidate capacities add up to at most
this share of the bucket; above it (dense warm-up stages) one at a time, so the candidates' keys,
positions and sort (32 bytes a slot) stay a bounded fraction of the gradient's memory."""

_MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)
_LOW32 = tl.constexpr(0xFFFFFFFF)


def candidate_capacity(numel: int, k: int, plan: SamplePlan) -> int:
    """Slots of the candidate buffer for keeping ``k`` of ``numel`` with ``plan``: the expected
    candidate count (``rank`` sampled hits scaled to the tensor) times the headroom, plus a block."""
    expected = -(-plan.rank * numel // plan.samples)
    return max(k, min(numel, CANDIDATE_HEADROOM * expected + BLOCK))


@triton.jit
def _sample_abs_kernel(values_ptr, out_ptr, key, stride, samples, BLOCK: tl.constexpr):
    # Twin of selection.sample_positions: one jittered element per block of ``stride``.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < samples
    block = i.to(tl.int64)
    hashed = (block * tl.full([], FIBONACCI_MUL, tl.int64) + key) & tl.full([], MASK32, tl.int64)
    jitter = (hashed * stride) >> 32
    x = tl.load(values_ptr + block * stride + jitter, mask=inside)
    tl.store(out_ptr + i, tl.abs(x.to(tl.float32)), mask=inside)


@triton.jit
def _hits(magnitude, threshold, inside):
    """(above the threshold, tied with it): never a zero, unless the selection is exact (``threshold < 0``)."""
    candidate = inside & (magnitude > tl.minimum(threshold, 0.0))  # > 0, or > -1 (anything) when exact
    return candidate & (magnitude > threshold), candidate & (magnitude == threshold)


@triton.jit
def _count_kernel(values_ptr, numel, threshold_ptr, counts_ptr, tie_counts_ptr, BLOCK: tl.constexpr):
    base, offsets, inside = program_block(numel, BLOCK)
    magnitude = tl.abs(tl.load(values_ptr + base + offsets, mask=inside, other=0.0).to(tl.float32))
    above, tie = _hits(magnitude, tl.load(threshold_ptr), inside)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(above.to(tl.int32), axis=0))
    tl.store(tie_counts_ptr + tl.program_id(0), tl.sum(tie.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(
    values_ptr, numel, threshold_ptr, block_start_ptr, tie_start_ptr, cand_index_ptr, cand_magnitude_ptr, capacity,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Block b writes its hits above the threshold, in position order, from slot block_start[b] on,
    # and its ties from tie_start[b] on: after every block's hits above it (exclusive prefix sums).
    base, offsets, inside = program_block(numel, BLOCK)
    magnitude = tl.abs(tl.load(values_ptr + base + offsets, mask=inside, other=0.0).to(tl.float32))
    above, tie = _hits(magnitude, tl.load(threshold_ptr), inside)
    above_slot = tl.load(block_start_ptr + tl.program_id(0)) + tl.cumsum(above.to(tl.int64), axis=0) - 1
    tie_slot = tl.load(tie_start_ptr + tl.program_id(0)) + tl.cumsum(tie.to(tl.int64), axis=0) - 1
    slot = tl.where(above, above_slot, tie_slot)
    keep = (above | tie) & (slot < capacity)
    tl.store(cand_index_ptr + slot, base + offsets, mask=keep)
    tl.store(cand_magnitude_ptr + slot, magnitude, mask=keep)


def sampled_topk_(
    values: torch.Tensor,
    k: int,
    *,
    sample_ratio: float,
    salt: int,
    scratch: object | None,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Sync-free :func:`lightning_gc.kernels.selection.sampled_topk_`.

    Candidates ``|x| >= thr`` (non-zero) are compacted into a buffer of fixed capacity, those
    above ``thr`` first, then an exact top-k runs over it. When fewer than ``k`` elements pass
    the threshold, the missing pairs are no-ops (value 0); when more than the capacity pass, the
    ties with ``thr`` that do not fit are dropped first, then the hits above it last by position.
    Both cases only make a step send less than the exact top-k; nothing is lost, since memory keeps
    all that was not sent. With the default 2x margin and 4x headroom both are rare.
    """
    numel = values.numel()
    device = values.device
    plan = None if k >= numel else sample_plan(numel, k, sample_ratio, salt)
    if plan is None:
        indices = torch.topk(values.abs(), min(k, numel), sorted=False).indices
        out_indices.copy_(indices)
        torch.index_select(values, 0, indices, out=out_values)
        return
    sample = torch.empty(plan.samples, dtype=torch.float32, device=device)
    launch(_sample_abs_kernel, (triton.cdiv(plan.samples, BLOCK),), values, sample, plan.key, plan.stride,
           plan.samples, BLOCK=BLOCK)  # fmt: skip
    threshold = torch.topk(sample, plan.rank, sorted=False).values.min().reshape(1)

    blocks = triton.cdiv(numel, BLOCK)
    counts = torch.empty(blocks, dtype=torch.int32, device=device)  # per block: at most BLOCK
    tie_counts = torch.empty(blocks, dtype=torch.int32, device=device)
    launch(_count_kernel, (blocks,), values, numel, threshold, counts, tie_counts, BLOCK=BLOCK)
    above_through = torch.cumsum(counts, 0, dtype=torch.int64)  # int64: every element may pass
    block_start = above_through - counts
    tie_start = above_through[-1] + torch.cumsum(tie_counts, 0, dtype=torch.int64) - tie_counts
    capacity = candidate_capacity(numel, k, plan)
    cand_index = torch.zeros(capacity, dtype=torch.int64, device=device)
    cand_magnitude = torch.full((capacity,), -1.0, dtype=torch.float32, device=device)
    launch(
        _compact_kernel,
        (blocks,),
        values,
        numel,
        threshold,
        block_start,
        tie_start,
        cand_index,
        cand_magnitude,
        capacity,
        BLOCK=BLOCK,
    )

    best = torch.topk(cand_magnitude, k, sorted=False)
    indices = cand_index[best.indices]
    out_indices.copy_(indices)
    chosen = torch.index_select(values, 0, indices)
    torch.where(best.values >= 0, chosen, torch.zeros((), dtype=values.dtype, device=device), out=out_values)


# ---------------------------------------------------------------------- a bucket's segments at once
@triton.jit
def _magnitude_key(x, segment):
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


@triton.jit(do_not_specialize=["step_key"])  # a new key every step: one compiled variant for all
def _segment_sample_kernel(
    values_ptr, keys_ptr, sample_segment_ptr, sample_first_ptr, start_ptr, stride_ptr, salt_key_ptr, step_key,
    samples, BLOCK: tl.constexpr,
):  # fmt: skip
    # Sample i of segment s is its j-th (j = i - sample_first[s]), placed as selection.sample_positions
    # places it with the key (step_key + salt_key[s]) mod 2**32 = (step_salt + salts[s]) * FIBONACCI_MUL.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < samples
    segment = tl.load(sample_segment_ptr + i, mask=inside, other=0)
    j = (i - tl.load(sample_first_ptr + segment, mask=inside, other=0)).to(tl.int64)
    key = (tl.load(salt_key_ptr + segment, mask=inside, other=0) + step_key) & tl.full([], MASK32, tl.int64)
    hashed = (j * tl.full([], FIBONACCI_MUL, tl.int64) + key) & tl.full([], MASK32, tl.int64)
    stride = tl.load(stride_ptr + segment, mask=inside, other=1)
    position = tl.load(start_ptr + segment, mask=inside, other=0) + j * stride + ((hashed * stride) >> 32)
    x = tl.load(values_ptr + position, mask=inside, other=0.0)
    tl.store(keys_ptr + i, _magnitude_key(x, segment), mask=inside)


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
    above, tie = _hits(tl.abs(x.to(tl.float32)), threshold, inside)
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
    tl.store(cand_key_ptr + slot, _magnitude_key(x, segment), mask=keep)
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
class _SegmentTable:
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


@functools.lru_cache(maxsize=256)
def _segment_table(segments: SegmentedTopK, sample_ratio: float, device: torch.device) -> _SegmentTable | None:
    """The kernels' view of ``segments``, or ``None`` when the candidate capacities exceed
    :data:`SEGMENTED_CAPACITY_SHARE` of the bucket (then they are selected one at a time)."""
    strides, sample_counts, picks, capacities = [], [], [], []
    samples = 0
    for numel, k in zip(segments.numels, segments.ks, strict=True):
        plan = None if k >= numel else sample_plan(numel, k, sample_ratio, salt=0)  # the salt moves only the jitter
        if plan is None:  # every element is a candidate: the exact top-k
            strides.append(1)
            sample_counts.append(0)
            picks.append(-1)
            capacities.append(numel)
        else:
            strides.append(plan.stride)
            sample_counts.append(plan.samples)
            picks.append(samples + plan.rank - 1)
            capacities.append(candidate_capacity(numel, k, plan))
        samples += sample_counts[-1]
    slots = sum(capacities)
    if slots > SEGMENTED_CAPACITY_SHARE * sum(segments.numels):
        return None
    blocks = [-(-numel // BLOCK) for numel in segments.numels]
    block_ends = torch.tensor(blocks).cumsum(0)
    capacity = torch.tensor(capacities)
    slots_stop = capacity.cumsum(0)
    sample_stop = torch.tensor(sample_counts).cumsum(0)

    def on_device(values: torch.Tensor | list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device)

    segment_ids = torch.arange(len(segments.numels))
    return _SegmentTable(
        start=on_device(list(segments.starts)),
        stop=on_device([s + n for s, n in zip(segments.starts, segments.numels, strict=True)]),
        stride=on_device(strides),
        salt_key=on_device([(salt * FIBONACCI_MUL_INT) & MASK32_INT for salt in segments.salts]),
        sample_first=on_device(sample_stop - torch.tensor(sample_counts)),
        pick=on_device(picks),
        slots_first=on_device(slots_stop - capacity),
        slots_stop=on_device(slots_stop),
        capacity=on_device(capacity),
        first_block=on_device(block_ends - torch.tensor(blocks)),
        last_block=on_device(block_ends - 1),
        first=on_device(list(segments.firsts)),
        sample_segment=on_device(segment_ids.repeat_interleave(torch.tensor(sample_counts)), torch.int32),
        block_segment=on_device(segment_ids.repeat_interleave(torch.tensor(blocks)), torch.int32),
        block_first=on_device(
            torch.cat([s + BLOCK * torch.arange(b) for s, b in zip(segments.starts, blocks, strict=True)])
        ),
        output_segment=on_device(segment_ids.repeat_interleave(torch.tensor(segments.ks)), torch.int32),
        samples=samples,
        slots=slots,
    )


def sampled_topk_segments_(
    values: torch.Tensor,
    segments: SegmentedTopK,
    *,
    sample_ratio: float,
    step_salt: int,
    scratch: SelectionScratch | None,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Sync-free :func:`lightning_gc.kernels.selection.sampled_topk_segments_`: every segment's
    pairs from one launch of each kernel (module docstring), each segment exactly as
    :func:`sampled_topk_` selects it alone (same sample, threshold, capacity and candidates) when
    its values are finite. A NaN, which reaches selection only in a step that
    ``nonfinite="skip"`` rolls back, is never a candidate here. Alone, a NaN threshold sends nothing
    and an exact top-k may pick the NaN."""
    if not segments.ks or 0 in segments.numels:  # nothing, or an empty tensor, to select from together
        table = None
    else:
        table = _segment_table(segments, sample_ratio, values.device)
    if table is None:
        sampled_one_at_a_time(
            sampled_topk_,
            values,
            segments,
            sample_ratio=sample_ratio,
            step_salt=step_salt,
            scratch=scratch,
            out_indices=out_indices,
            out_values=out_values,
        )
        return
    device = values.device
    step_key = (step_salt * FIBONACCI_MUL_INT) & MASK32_INT
    # With no samples (every segment exact, threshold -1) the one slot is loaded and ignored.
    sorted_samples = torch.empty(max(table.samples, 1), dtype=torch.int64, device=device)
    if table.samples:
        launch(_segment_sample_kernel, (triton.cdiv(table.samples, BLOCK),), values, sorted_samples,
               table.sample_segment, table.sample_first, table.start, table.stride, table.salt_key, step_key,
               table.samples, BLOCK=BLOCK)  # fmt: skip
        sorted_samples = torch.sort(sorted_samples).values
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
    launch(_segment_emit_kernel, (triton.cdiv(segments.total_k, BLOCK),), values, table.output_segment, table.first,
           table.start, kept, kept_through, order, cand_index, out_indices, out_values, segments.total_k,
           BLOCK=BLOCK)  # fmt: skip
