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
elements are candidates, and its top-k is exact. Here, the segments' sample and the table their
kernels read (:class:`~.selection_segments_triton.SegmentTable`); their candidate stage (count,
compact, sort, emit) is :mod:`.selection_segments_triton`'s, with the hit predicate and sort key
both paths share.
"""

from __future__ import annotations

import functools

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
from lightning_gc.kernels.selection_segments_triton import (
    SegmentTable,
    hits,
    magnitude_key,
    segment_topk_of_candidates_,
)

CANDIDATE_HEADROOM = 4
"""Candidate buffer capacity, in multiples of the expected candidate count (which is ~2k)."""

SEGMENTED_CAPACITY_SHARE = 0.25
"""A bucket's segments are selected together while their candidate capacities add up to at most
this share of the bucket; above it (dense warm-up stages) one at a time, so the candidates' keys,
positions and sort (32 bytes a slot) stay a bounded fraction of the gradient's memory."""


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
def _count_kernel(values_ptr, numel, threshold_ptr, counts_ptr, tie_counts_ptr, BLOCK: tl.constexpr):
    base, offsets, inside = program_block(numel, BLOCK)
    magnitude = tl.abs(tl.load(values_ptr + base + offsets, mask=inside, other=0.0).to(tl.float32))
    above, tie = hits(magnitude, tl.load(threshold_ptr), inside)
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
    above, tie = hits(magnitude, tl.load(threshold_ptr), inside)
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
    tl.store(keys_ptr + i, magnitude_key(x, segment), mask=inside)


@functools.lru_cache(maxsize=256)
def _segment_table(segments: SegmentedTopK, sample_ratio: float, device: torch.device) -> SegmentTable | None:
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
    return SegmentTable(
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
    segment_topk_of_candidates_(values, table, sorted_samples, segments.total_k, out_indices, out_values)
