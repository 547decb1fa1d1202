"""Triton twin of :mod:`.selection`: top-k without a host sync.

sample -> threshold -> count -> compact -> exact top-k: the jittered sample of :mod:`.selection`
(same positions, same integers), its ``rank``-th largest magnitude as threshold, a per-block count
of ``|x| >= thr`` and its exclusive prefix sum, then each block compacts its hits, in position
order, into a candidate buffer of fixed capacity, over which ``torch.topk`` picks ``k``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import BLOCK, launch
from lightning_gc.kernels.rng_triton import FIBONACCI_MUL, MASK32
from lightning_gc.kernels.selection import sample_plan

CANDIDATE_HEADROOM = 4
"""Candidate buffer capacity, in multiples of the expected candidate count (which is ~2k)."""


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
def _count_kernel(values_ptr, numel, threshold_ptr, counts_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    hit = (magnitude >= tl.load(threshold_ptr)) & inside
    tl.store(counts_ptr + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(
    values_ptr, numel, threshold_ptr, block_start_ptr, cand_index_ptr, cand_magnitude_ptr, capacity, BLOCK: tl.constexpr
):
    # Block b writes its hits, in position order, from slot block_start[b] on (exclusive prefix sum).
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    hit = (magnitude >= tl.load(threshold_ptr)) & inside
    slot = tl.load(block_start_ptr + tl.program_id(0)) + tl.cumsum(hit.to(tl.int32), axis=0) - 1
    keep = hit & (slot < capacity)
    tl.store(cand_index_ptr + slot, offsets.to(tl.int64), mask=keep)
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

    Candidates ``|x| >= thr`` are compacted into a buffer of fixed capacity, then an exact top-k
    runs over it. When fewer than ``k`` elements pass the threshold, the missing pairs are no-ops
    (value 0); when more than the capacity pass, the first ones by position are kept. Both cases
    only make a step send less than the exact top-k; nothing is lost, since memory keeps all that
    was not sent. With the default 2x margin and 4x headroom both are rare.
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
    counts = torch.empty(blocks, dtype=torch.int32, device=device)
    launch(_count_kernel, (blocks,), values, numel, threshold, counts, BLOCK=BLOCK)
    block_start = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    expected = -(-plan.rank * numel // plan.samples)
    capacity = max(k, min(numel, CANDIDATE_HEADROOM * expected + BLOCK))
    cand_index = torch.zeros(capacity, dtype=torch.int64, device=device)
    cand_magnitude = torch.full((capacity,), -1.0, dtype=torch.float32, device=device)
    launch(
        _compact_kernel,
        (blocks,),
        values,
        numel,
        threshold,
        block_start,
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
